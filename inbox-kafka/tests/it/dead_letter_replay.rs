//! What a partial replay leaves on a dead-letter topic: a log cannot delete, so the replay
//! group commits only past records it replayed with nothing left out before them. The whole
//! replay is tested on every adapter by the conformance scenario; this is Kafka's own rule.

use inbox_conformance::kafka::{brokers, create_topic, producer};
use inbox_conformance::unique_name;
use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::replay::{self, Selection};
use inbox_core::{OutgoingMessage, Publish};
use inbox_kafka::{KafkaConnection, KafkaDeadLetters};

/// The first `n` records of partition 0 of `topic` (fewer after 20 s), read without trusting
/// the high watermark (the replay sent them in batches; see above).
async fn read(topic: &str, n: usize) -> Vec<inbox_kafka::rdkafka::message::OwnedMessage> {
    use inbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use inbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", unique_name("reader"))
            .create()
            .expect("consumer");
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&topic, 0, Offset::Beginning)
            .expect("partition");
        consumer.assign(&list).expect("assign");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut out = Vec::new();
        while out.len() < n && std::time::Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(std::time::Duration::from_millis(200)) {
                out.push(m.detach());
            }
        }
        out
    })
    .await
    .expect("reader task")
}

async fn reader(topic: &str) -> KafkaDeadLetters {
    KafkaConnection::new(brokers())
        .dead_letters(topic)
        .connect()
        .await
        .expect("the reader connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_left_out_holds_back_the_commit_of_the_later_ones() {
    let source = unique_name("replay-source");
    let dlq = format!("{source}.dlq");
    create_topic(&source, 1).await;
    create_topic(&dlq, 1).await;
    let parked: Vec<OutgoingMessage> = ["a", "b", "a", "a"]
        .iter()
        .enumerate()
        .map(|(i, reason)| {
            OutgoingMessage::generate(format!("[{i}]"))
                .key("account-1")
                .header("tenant", "acme")
                .header(REASON, *reason)
                .header(ORIGINAL_SOURCE, source.as_str())
                .header(ORIGINAL_POSITION, format!("partition 0 offset {i}"))
        })
        .collect();
    // One at a time, as a source parks them: after a produce of several records, Tansu 0.6
    // reports a high watermark short of what it stored, and a reading ends at the watermark.
    let producer = producer().await;
    for message in &parked {
        producer
            .send_batch(&dlq, std::slice::from_ref(message))
            .await
            .expect("parked");
    }

    let first = replay::replay(
        &mut reader(&dlq).await,
        &producer,
        &Selection::all().reason("a"),
        false,
        &mut |_| {},
    )
    .await
    .expect("replay of reason a");
    assert_eq!((first.read, first.moved), (4, 3));
    // Offset 0 is committed; offset 1 (reason b) holds back 2 and 3, replayed but listed again.
    let left = replay::summarize(&mut reader(&dlq).await)
        .await
        .expect("list");
    assert_eq!(left.total.count, 3, "{left:?}");
    assert_eq!(left.by_reason[&Some("a".to_owned())].count, 2);

    let second = replay::replay(
        &mut reader(&dlq).await,
        &producer,
        &Selection::all(),
        false,
        &mut |_| {},
    )
    .await
    .expect("replay of the rest");
    assert_eq!(second.moved, 3);
    let left = replay::summarize(&mut reader(&dlq).await)
        .await
        .expect("list");
    assert_eq!(left.total.count, 0, "{left:?}");

    // On the source: the copies with their ID, key and headers, without the dead-letter ones.
    let copies = read(&source, 6).await;
    assert_eq!(copies.len(), 6);
    use inbox_kafka::rdkafka::message::{Headers, Message};
    let first_copy = &copies[0];
    assert_eq!(first_copy.key(), Some(&b"account-1"[..]));
    let names: Vec<&str> = first_copy
        .headers()
        .map(|h| h.iter().map(|h| h.key).collect())
        .unwrap_or_default();
    assert!(
        names.contains(&"tenant") && names.contains(&"event_id"),
        "{names:?}"
    );
    assert!(
        !names.contains(&REASON) && !names.contains(&ORIGINAL_SOURCE),
        "{names:?}"
    );
    let ids: std::collections::BTreeSet<Vec<u8>> = copies
        .iter()
        .filter_map(|m| {
            m.headers()?
                .iter()
                .find(|h| h.key == "event_id")?
                .value
                .map(<[u8]>::to_vec)
        })
        .collect();
    let parked_ids: std::collections::BTreeSet<Vec<u8>> = parked
        .iter()
        .map(|m| m.id.as_str().as_bytes().to_vec())
        .collect();
    assert_eq!(ids, parked_ids);
}
