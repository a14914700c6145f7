//! The spans an on-call engineer reads, as `tracing` records them: a transaction's span is the
//! CONSUMER's and names what failed (`error.type`), settling is a CLIENT call, a publish a
//! PRODUCER's, and each carries the group name.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use inbox_core::telemetry::traced_send;
use inbox_core::{handler_fn, Consumer, HandlerError, Message, MessageId, PublishError, Recovery};
use inbox_testkit::log::CapturedLog;
use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};
use tracing_subscriber::fmt::format::FmtSpan;

/// The lines of `log` that close a span named `name` (not one of its children), with its fields.
fn closed_spans(log: &CapturedLog, name: &str) -> Vec<String> {
    let text = log.text();
    text.lines()
        .filter(|line| {
            // `LEVEL outer{…}:inner{…}: target: close …`: the span closed is the last.
            let Some((chain, _)) = line.split_once(": close") else {
                return false;
            };
            let Some((spans, _target)) = chain.rsplit_once("}: ") else {
                return false;
            };
            let last = spans.rsplit_once("}:").map_or(spans, |(_, last)| last);
            last.split_whitespace()
                .any(|word| word.starts_with(&format!("{name}{{")))
        })
        .map(str::to_owned)
        .collect()
}

// One thread: the subscriber is the thread's default while the consumer runs.
#[tokio::test(flavor = "current_thread")]
async fn spans_carry_their_kind_group_and_error_type() {
    let log = CapturedLog::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_span_events(FmtSpan::CLOSE)
        .with_writer(move || writer.clone())
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);

    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "100");
    broker.publish(Some("evt-2"), "not a number");
    let store = MemoryStore::<i64>::new();
    let credit = handler_fn(
        async |tx: &mut MemoryTx<i64>, _: &MessageId, message: &Message| {
            *tx.state_mut() += message.json::<i64>()?;
            Ok::<_, HandlerError>(())
        },
    );
    Consumer::new("wallet", broker.source(), store.clone(), credit)
        .batch_size(1)
        .run_until_idle()
        .await
        .unwrap();
    let sent = traced_send("kafka", "orders", 2, async {
        Err(PublishError::new(
            Recovery::Reconnect,
            "producing",
            "the broker is down",
        ))
    })
    .await;
    assert!(sent.is_err());
    drop(guard);

    let process = closed_spans(&log, "inbox.process");
    assert_eq!(process.len(), 2, "{process:#?}");
    for span in &process {
        assert!(span.contains(r#"otel.kind="consumer""#), "{span}");
        assert!(
            span.contains("messaging.consumer.group.name=wallet"),
            "{span}"
        );
    }
    let failed: Vec<&String> = process
        .iter()
        .filter(|s| s.contains("error.type"))
        .collect();
    assert_eq!(failed.len(), 1, "{process:#?}");
    assert!(
        failed[0].contains(r#"error.type="handler_permanent""#),
        "{}",
        failed[0]
    );

    let settle = closed_spans(&log, "inbox.settle");
    assert!(
        settle.iter().any(|s| s.contains(r#"otel.name="ack""#)),
        "{settle:#?}"
    );
    assert!(
        settle.iter().any(|s| s.contains("otel.name=dead_letter")),
        "{settle:#?}"
    );
    for span in &settle {
        assert!(span.contains(r#"otel.kind="client""#), "{span}");
    }

    let send = closed_spans(&log, "inbox.send");
    assert_eq!(send.len(), 1, "{send:#?}");
    assert!(send[0].contains(r#"otel.kind="producer""#), "{}", send[0]);
    assert!(
        send[0].contains("messaging.destination.name=orders"),
        "{}",
        send[0]
    );
    assert!(send[0].contains(r#"error.type="reconnect""#), "{}", send[0]);
}
