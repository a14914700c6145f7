//! Messages published by NATS's own Python client (nats-py), not by this crate's producer, their
//! IDs read where the producers' conventions put them: a header, JetStream's `Nats-Msg-Id`,
//! CloudEvents in binary mode (`ce-` headers, the NATS binding), the Debezium outbox router's
//! `id` header, a JSON field of the payload. Each: two credits and a resent copy of the first
//! applied as two, and a message without the ID dead-lettered with a reason naming what was
//! missing.
//!
//! nats-py is one of the Python clients `inbox_conformance::python` installs.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_conformance::nats::{nats_url, Nats};
use inbox_conformance::{TestBroker, TestQueue};
use inbox_core::{Consumer, Handler, HandlerError, IdFrom, Message, MessageId};
use inbox_testkit::{MemoryStore, MemoryTx};
use serde_json::{json, Value};

/// Publishes each `{"headers": {..}, "body": ".."}` to `subject` with nats-py, through
/// JetStream, each confirmed.
async fn publish(subject: &str, messages: &[Value]) {
    let target = json!({"broker": "nats", "url": nats_url(), "subject": subject});
    inbox_conformance::python::publish(&target, messages).await;
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
