//! Broker errors that a real broker cannot be made to return on cue, injected with librdkafka's
//! built-in mock cluster (a real Kafka-protocol server inside the test process; the client is
//! the real one): offset commits refused because the partition moved are logged, not fatal.

use std::time::Duration;

use inbox_core::testkit::{MemoryStore, MemoryTx};
use inbox_core::{async_trait, Consumer, Handler, HandlerError, Message, MessageId};
use inbox_kafka::rdkafka::mocking::MockCluster;
use inbox_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use inbox_kafka::{KafkaConfig, KafkaProducer, Record};

struct Sum;

#[async_trait]
impl Handler<MemoryTx<i64>> for Sum {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        *tx.state_mut() += message.json::<i64>()?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_refused_by_a_rebalance_are_not_fatal() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
    let mock = MockCluster::new(1).expect("mock cluster");
    mock.create_topic("credits", 3, 1).expect("topic");
    let brokers = mock.bootstrap_servers();
    let producer = KafkaProducer::new(&brokers).expect("producer");
    for i in 1..=30i64 {
        let record = Record::new(i.to_string()).partition((i % 3) as i32);
        producer.send("credits", record).await.expect("produce");
    }
    mock.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION,
        ],
    );

    let store = MemoryStore::<i64>::new();
    let source = KafkaConfig::new(&brokers, "wallet", ["credits"])
        .poll_timeout(Duration::from_millis(500))
        // A refused commit makes the member rejoin; the mock coordinator waits for the old
        // member's session to end first.
        .set_consumer("session.timeout.ms", "6000")
        .set_consumer("max.poll.interval.ms", "6000")
        .set_consumer("heartbeat.interval.ms", "500")
        .build()
        .expect("source");
    let consumer = Consumer::new("wallet", source, store.clone(), Sum).batch_size(5);
    let stats = consumer.stats();
    let run = tokio::spawn(consumer.run_until(async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while stats.snapshot().applied < 30 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Let the re-read copies of the batches whose commit was refused come back.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }));
    let stats = run
        .await
        .expect("task")
        .expect("the consumer keeps running");
    println!("mock cluster with refused commits: {stats:?}");
    assert_eq!(stats.applied, 30);
    assert_eq!(store.state().await, (1..=30).sum::<i64>());
    assert_eq!(
        stats.ack_failures, 0,
        "moved-partition commit errors are logged, not failures"
    );
    assert_eq!(stats.errors, 0);
}
