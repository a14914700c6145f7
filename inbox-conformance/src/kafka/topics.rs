//! Topics on the broker under test: creating them (with the admin API, or through the mock
//! cluster's control port), what a group has left on them, reading them back.
//!
//! The same tests run on librdkafka's mock cluster, the `kafka-mock` process
//! (`KAFKA_BROKERS` its bootstrap address, `KAFKA_MOCK_CONTROL` its `--control` address). The
//! mock has no CreateTopics, so topics are then made through its control port.

use std::time::{Duration, Instant};

use inbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use inbox_kafka::rdkafka::message::{Headers, OwnedMessage};
use inbox_kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use inbox_kafka::KafkaConnection;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The `kafka-mock --control` address, when the tests run on librdkafka's mock cluster.
pub fn mock_control() -> Option<String> {
    std::env::var("KAFKA_MOCK_CONTROL").ok()
}

/// Creates `topic` with `partitions` partitions: with the admin API, or on the mock cluster
/// through `kafka-mock --control`.
pub async fn create_topic(topic: &str, partitions: i32) {
    let Some(control) = mock_control() else {
        return create_topic_on(&super::brokers(), topic, partitions).await;
    };
    let talk = async {
        let mut stream = tokio::net::TcpStream::connect(&control).await?;
        stream
            .write_all(format!("create-topic {topic} {partitions}\n").as_bytes())
            .await?;
        let mut answer = String::new();
        BufReader::new(stream).read_line(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(30), talk)
        .await
        .unwrap_or_else(|_| panic!("kafka-mock at KAFKA_MOCK_CONTROL={control} does not answer"))
        .unwrap_or_else(|e| panic!("kafka-mock at KAFKA_MOCK_CONTROL={control}: {e}"));
    assert_eq!(
        answer.trim_end(),
        "ok",
        "kafka-mock at KAFKA_MOCK_CONTROL={control} creating topic `{topic}`"
    );
}

/// Creates `topic` with `partitions` partitions on `brokers`, with the admin API.
pub(super) async fn create_topic_on(brokers: &str, topic: &str, partitions: i32) {
    KafkaConnection::new(brokers)
        .admin()
        .expect("admin client")
        .create_topic(topic, partitions)
        .await
        .unwrap_or_else(|e| panic!("creating topic `{topic}` on {brokers}: {e}"));
}

fn plain_consumer(brokers: &str, group: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("plain consumer")
}

/// Records not yet committed by `group`, summed over the partitions of `topic` (blocking:
/// call it from `spawn_blocking`).
pub fn lag(topic: &str, group: &str, partitions: i32) -> i64 {
    lag_on(&super::brokers(), topic, group, partitions)
}

/// [`lag`] on `brokers`.
pub(super) fn lag_on(brokers: &str, topic: &str, group: &str, partitions: i32) -> i64 {
    // Never subscribes, so it never joins the group: it only reads the group's offsets.
    let consumer = plain_consumer(brokers, group);
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(list, Duration::from_secs(10))
        .expect("committed offsets");
    let mut lag = 0;
    for p in 0..partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .expect("watermarks");
        let at = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => low,
        };
        lag += high - at;
    }
    lag
}

/// Every record on partition 0 of `topic`.
pub async fn read_all(topic: &str) -> Vec<OwnedMessage> {
    let (brokers, topic) = (super::brokers(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer = plain_consumer(&brokers, &crate::unique_name("reader"));
        let (low, high) = consumer
            .fetch_watermarks(&topic, 0, Duration::from_secs(10))
            .expect("watermarks");
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&topic, 0, Offset::Offset(low))
            .expect("partition");
        consumer.assign(&list).expect("assign");
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while (out.len() as i64) < high - low && Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
                out.push(m.detach());
            }
        }
        out
    })
    .await
    .expect("reader task")
}

/// The value of `message`'s header `name`.
pub fn header<'a>(message: &'a OwnedMessage, name: &str) -> Option<&'a [u8]> {
    message
        .headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
}
