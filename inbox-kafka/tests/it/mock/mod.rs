//! librdkafka's mock cluster inside the test process, for the tests that need what the broker
//! the services start cannot do on cue (errors injected, members joining and leaving).
#![allow(dead_code, unreachable_pub)]

use std::fmt::Display;

use inbox_core::MessageId;
use inbox_kafka::rdkafka::mocking::MockCluster;
use inbox_kafka::rdkafka::producer::DefaultProducerContext;
use inbox_kafka::{KafkaConnection, KafkaProducer};

/// A mock cluster of `nodes` brokers with `topic` (`partitions` partitions) and its dead-letter
/// topic, each replicated on every broker, and its bootstrap address. Logs go to the test
/// output, filtered by `RUST_LOG` (warnings by default).
pub fn cluster(
    nodes: i32,
    topic: &str,
    partitions: i32,
) -> (MockCluster<'static, DefaultProducerContext>, String) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
    let mock = MockCluster::new(nodes).expect("mock cluster");
    mock.create_topic(topic, partitions, nodes).expect("topic");
    mock.create_topic(&format!("{topic}.dlq"), 1, nodes)
        .expect("dead-letter topic");
    let brokers = mock.bootstrap_servers();
    (mock, brokers)
}

pub async fn producer(brokers: &str) -> KafkaProducer {
    KafkaConnection::new(brokers)
        .producer()
        .connect()
        .await
        .expect("producer")
}

/// The ID `evt-<i>`.
pub fn evt(i: impl Display) -> MessageId {
    MessageId::new(format!("evt-{i}")).expect("id")
}
