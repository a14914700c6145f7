//! What a dead letter carries, and what it leaves behind: JetStream's own publish headers.

use inbox_conformance::nats::{builder_on, Nats};
use inbox_conformance::{TestBroker, TestQueue};
use inbox_core::replay::DeadLetters;
use inbox_core::Consumer;
use inbox_nats::async_nats::HeaderMap;
use inbox_nats::NatsConnection;
use inbox_testkit::{MemoryStore, Sum};

fn nats() -> NatsConnection {
    NatsConnection::new(inbox_conformance::nats::nats_url())
}

/// The stream keeps a message's headers, JetStream's own among them: a dead letter that
/// carried `Nats-Expected-Last-Sequence` on would be refused by its stream (the sequence has
/// moved on), and the message would come back to be parked again, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_published_with_jetstream_expectations_is_parked_without_them() {
    let queue = Nats.queue("dlq-expectations").await;
    queue.send(Some("evt-ok"), b"5").await;
    // Stored because the stream's last sequence was 1; no ID, so it is parked.
    queue
        .send_with_headers(
            &[("Nats-Expected-Last-Sequence", "1"), ("tenant", "acme")],
            b"100",
        )
        .await;
    let store = MemoryStore::<i64>::new();
    let source = builder_on(&nats(), &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap();
    let stats = Consumer::new("dlq-expectations", source, store.clone(), Sum)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    assert_eq!(store.state().await, 5);
    assert_eq!(
        queue.left().await,
        0,
        "the message left the stream's consumer"
    );

    // One stored with JetStream's headers (as this crate wrote them before): the reader leaves
    // them out, so a replay does not carry them back to the stream.
    let mut headers = HeaderMap::new();
    headers.insert("event_id", "evt-old");
    headers.insert("Nats-Expected-Stream", queue.name().as_str());
    headers.insert("tenant", "acme");
    queue
        .context()
        .publish_with_headers(queue.dead_letter_subject(), headers, "7".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let mut reader = nats()
        .dead_letters(queue.dead_letter_subject())
        .connect()
        .await
        .unwrap();
    let parked = reader.next(10).await.unwrap();
    reader.close().await.unwrap();
    assert_eq!(parked.len(), 2);
    assert_eq!(parked[0].payload, b"100");
    assert!(parked[0].reason.is_some());
    for letter in &parked {
        let names: Vec<&str> = letter.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["tenant"], "the user's headers only");
    }
    queue.cleanup().await;
}
