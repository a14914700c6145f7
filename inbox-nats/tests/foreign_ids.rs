//! Messages published by NATS's own Python client (nats-py), not by this crate's producer, their
//! IDs read where the producers' conventions put them: a header, JetStream's `Nats-Msg-Id`,
//! CloudEvents in binary mode (`ce-` headers, the NATS binding), the Debezium outbox router's
//! `id` header, a JSON field of the payload. Each: two credits and a resent copy of the first
//! applied as two, and a message without the ID dead-lettered with a reason naming what was
//! missing.
//!
//! nats-py is installed on first use into a virtual environment of these tests
//! (`INBOX_NATS_PY`, else `~/.cache/inbox/nats-py`).

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use inbox_conformance::nats::{nats_url, Nats};
use inbox_conformance::{TestBroker, TestQueue};
use inbox_core::{Consumer, Handler, HandlerError, IdFrom, Message, MessageId};
use inbox_testkit::{MemoryStore, MemoryTx};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use tokio::sync::OnceCell;

const NATS_PY: &str = "nats-py==2.16.0";

/// Publishes each `{"headers": {..}, "body": ".."}` to `subject` with JetStream, confirmed.
const PUBLISH: &str = r#"
import asyncio, json, sys
import nats

async def main():
    job = json.load(sys.stdin)
    nc = await nats.connect(job["url"])
    js = nc.jetstream()
    for message in job["messages"]:
        await js.publish(job["subject"], message["body"].encode(), headers=message.get("headers") or None)
    await nc.close()

asyncio.run(main())
"#;

async fn python() -> PathBuf {
    static READY: OnceCell<PathBuf> = OnceCell::const_new();
    READY
        .get_or_init(|| async {
            let dir = std::env::var_os("INBOX_NATS_PY")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap();
                    home.join(".cache/inbox/nats-py")
                });
            let python = dir.join("bin/python");
            let stamp = dir.join("requirements.txt");
            if python.exists() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == NATS_PY) {
                return python;
            }
            let venv = Command::new("python3")
                .arg("-m")
                .arg("venv")
                .arg(&dir)
                .status();
            assert!(
                venv.await.unwrap().success(),
                "python3 -m venv {}",
                dir.display()
            );
            let pip = Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .arg(NATS_PY)
                .status();
            assert!(pip.await.unwrap().success(), "pip install {NATS_PY}");
            std::fs::write(&stamp, NATS_PY).unwrap();
            python
        })
        .await
        .clone()
}

async fn publish(subject: &str, messages: &[Value]) {
    let job = json!({"url": nats_url(), "subject": subject, "messages": messages});
    let mut child = Command::new(python().await)
        .arg("-c")
        .arg(PUBLISH)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(job.to_string().as_bytes()).await.unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("nats-py publishes within 60 s")
        .unwrap();
    assert!(
        out.status.success(),
        "nats-py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Adds each credit's amount: the payload's `amount` member.
struct Credit;

impl Handler<MemoryTx<i64>> for Credit {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let credit: Value = message.json()?;
        *tx.state_mut() += credit["amount"].as_i64().ok_or("no amount")?;
        Ok(())
    }
}

/// Publishes two credits (10 and 20, IDs `first` and `second` in the convention `message`
/// writes), a resend of the first, and one without an ID; reads them as `from`; checks 30
/// applied, one skipped, the ID-less one parked with `missing` in its reason.
async fn check(
    name: &str,
    from: IdFrom,
    message: impl Fn(Option<&str>, i64) -> Value,
    missing: &str,
) {
    let queue = Nats.queue(name).await;
    let messages = [
        message(Some("first"), 10),
        message(Some("second"), 20),
        message(Some("first"), 10),
        message(None, 40),
    ];
    publish(&queue.name(), &messages).await;
    let source = queue.source_reading("nats-py", from).await.unwrap();
    let store = MemoryStore::<i64>::new();
    let stats = Consumer::new("nats-py", source, store.clone(), Credit)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(store.state().await, 30, "{name}: each credit once");
    assert_eq!(stats.skipped_duplicates, 1, "{name}: the resend skipped");
    let parked = queue.dead_letters().await;
    assert_eq!(parked.len(), 1, "{name}: {parked:?}");
    assert!(parked[0].reason.contains(missing), "{name}: {parked:?}");
    assert_eq!(queue.left().await, 0);
    queue.cleanup().await;
}

fn body(amount: i64) -> String {
    json!({"amount": amount}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_id_header() {
    check(
        "py-header",
        IdFrom::header("event_id"),
        |id, amount| match id {
            Some(id) => json!({"headers": {"event_id": id}, "body": body(amount)}),
            None => json!({"body": body(amount)}),
        },
        "header event_id is missing",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_events_binary_mode_ce_headers() {
    check(
        "py-cloudevents",
        IdFrom::cloud_events(),
        |id, amount| {
            let mut headers = json!({
                "ce-specversion": "1.0",
                "ce-source": "/payments",
                "ce-type": "com.example.credit",
            });
            if let Some(id) = id {
                headers["ce-id"] = json!(id);
            }
            json!({"headers": headers, "body": body(amount)})
        },
        "ce-id",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_outbox_id_header() {
    check(
        "py-debezium",
        IdFrom::Debezium,
        |id, amount| match id {
            // A JSON header converter writes the ID quoted.
            Some(id) => json!({"headers": {"id": format!("\"{id}\"")}, "body": body(amount)}),
            None => json!({"body": body(amount)}),
        },
        "header id is missing",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_field_of_the_payload() {
    check(
        "py-json-field",
        IdFrom::json_field("/event/id"),
        |id, amount| {
            let mut payload = json!({"amount": amount, "event": {}});
            if let Some(id) = id {
                payload["event"]["id"] = json!(id);
            }
            json!({"body": payload.to_string()})
        },
        "JSON field /event/id of the payload is missing",
    )
    .await;
}

/// `Nats-Msg-Id`: the stream itself drops the resend within its duplicate window, so here the
/// copy never reaches the consumer; a redelivery is what the inbox skips.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstreams_own_nats_msg_id() {
    let queue = Nats.queue("py-msg-id").await;
    let credit = |id: &str, amount| json!({"headers": {"Nats-Msg-Id": id}, "body": body(amount)});
    let messages = [
        credit("first", 10),
        credit("second", 20),
        credit("first", 10),
    ];
    publish(&queue.name(), &messages).await;
    assert_eq!(queue.left().await, 2, "the stream dropped the resend");
    queue.send(Some("not-read"), b"{\"amount\":40}").await;
    let source = queue
        .source_reading("nats-py", IdFrom::MessageIdProperty)
        .await
        .unwrap();
    let store = MemoryStore::<i64>::new();
    Consumer::new("nats-py", source, store.clone(), Credit)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(store.state().await, 30);
    let parked = queue.dead_letters().await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert!(
        parked[0].reason.contains("header Nats-Msg-Id is missing"),
        "{parked:?}"
    );
    queue.cleanup().await;
}
