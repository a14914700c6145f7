//! A sharded store on the in-memory broker and stores: each message applied once, in its own
//! shard, one commit per shard, and a shard that is down holds back only its own messages.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{
    Consumer, ConsumerBinding, Handler, HandlerError, InboxStore, Message, MessageId,
    OperationError, Recovery, RetryPolicy, Sharded, StoreError,
};
use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};

/// The IDs a shard applied, in order.
type Ledger = Vec<String>;

struct Record;

impl Handler<MemoryTx<Ledger>> for Record {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Ledger>,
        id: &MessageId,
        _: &Message,
    ) -> Result<(), HandlerError> {
        tx.state_mut().push(id.to_string());
        Ok(())
    }
}

/// The tenant header is the shard key: `t0` and `t1`.
fn by_tenant(_: &MessageId, m: &Message) -> usize {
    match m.header("tenant") {
        Some(b"t1") => 1,
        _ => 0,
    }
}

fn publish(broker: &MemoryBroker, id: &str, tenant: &str, lane: Option<&str>) {
    let mut m = Message::new(Ok(MessageId::new(id).unwrap()), b"{}".to_vec());
    m.headers
        .push(("tenant".into(), tenant.as_bytes().to_vec()));
    m.meta.lane = lane.map(str::to_owned);
    broker.publish_message(m);
}

/// A memory store that is unreachable while `down` is set, as a shard's database in an outage.
#[derive(Clone, Default)]
struct Outage {
    store: MemoryStore<Ledger>,
    down: Arc<AtomicBool>,
    /// Transactions still to fail at their claim (a serialization failure, say).
    failing: Arc<AtomicU32>,
}

impl InboxStore for Outage {
    type Tx = MemoryTx<Ledger>;

    fn bind(&self, binding: &ConsumerBinding) -> Self {
        Self {
            store: self.store.bind(binding),
            down: Arc::clone(&self.down),
            failing: Arc::clone(&self.failing),
        }
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(OperationError::new(
                Recovery::Reconnect,
                "beginning a transaction",
                "shard unreachable",
            ));
        }
        self.store.begin().await
    }

    async fn claim(&self, tx: &mut Self::Tx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        let left = self.failing.load(Ordering::SeqCst);
        if left > 0 {
            self.failing.store(left - 1, Ordering::SeqCst);
            return Err(OperationError::new(
                Recovery::Retry,
                "claiming a message ID",
                "could not serialize access",
            ));
        }
        self.store.claim(tx, ids).await
    }
}

#[tokio::test]
async fn each_message_is_applied_once_in_its_own_shard_one_commit_per_shard() {
    for (lanes, lane) in [(1, None), (4, None), (2, Some("p0"))] {
        let broker = if lane.is_some() {
            MemoryBroker::with_lanes()
        } else {
            MemoryBroker::new()
        };
        // One batch whose messages alternate between the shards, each published twice.
        for i in 0..10 {
            let tenant = if i % 2 == 0 { "t0" } else { "t1" };
            publish(&broker, &format!("evt-{i}"), tenant, lane);
        }
        for i in 0..10 {
            let tenant = if i % 2 == 0 { "t0" } else { "t1" };
            publish(&broker, &format!("evt-{i}"), tenant, lane);
        }
        let shards = [MemoryStore::<Ledger>::new(), MemoryStore::new()];
        let store = Sharded::new(shards.to_vec(), by_tenant);
        let stats = Consumer::new("c", broker.source(), store, Record)
            .batch_size(10)
            .parallel_lanes(lanes)
            .run_until_idle()
            .await
            .unwrap();
        let evens: Ledger = (0..10).step_by(2).map(|i| format!("evt-{i}")).collect();
        let odds: Ledger = (1..10).step_by(2).map(|i| format!("evt-{i}")).collect();
        // Within a shard, a lane keeps its order.
        assert_eq!(
            shards[0].state().await,
            evens,
            "lanes {lanes}, lane {lane:?}"
        );
        assert_eq!(
            shards[1].state().await,
            odds,
            "lanes {lanes}, lane {lane:?}"
        );
        assert_eq!(stats.applied, 10);
        assert_eq!(stats.skipped_duplicates, 10);
        // The first batch of ten spans both shards: one transaction each.
        if lanes == 1 {
            assert_eq!(stats.commits, 2, "lane {lane:?}");
        }
        assert_eq!(broker.pending(), 0);
        assert_eq!(broker.in_flight(), 0);
    }
}

#[tokio::test]
async fn a_shard_that_is_down_holds_back_only_its_own_messages() {
    let broker = MemoryBroker::new();
    let shards = [Outage::default(), Outage::default()];
    shards[1].down.store(true, Ordering::SeqCst);
    for i in 0..20 {
        let tenant = if i % 2 == 0 { "t0" } else { "t1" };
        publish(&broker, &format!("evt-{i}"), tenant, None);
    }
    let store = Sharded::new(shards.to_vec(), by_tenant);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // Room for all twenty at once: the shard that is down holds its chunk (and its lane slot)
    // until it is back, the other goes on.
    let consumer = Consumer::new("c", broker.source(), store, Record)
        .batch_size(10)
        .parallel_lanes(2)
        .error_backoff(Duration::from_millis(5));
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    // Shard 0's ten messages are applied and acked while shard 1 is down.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while broker.acked() < 10 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "shard 0 was held back by shard 1"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(shards[0].store.state().await.len(), 10);
    assert_eq!(
        broker.acked(),
        10,
        "a message of the shard that is down was acked"
    );
    assert!(shards[1].store.state().await.is_empty());
    // Back up: its messages are applied, each once.
    shards[1].down.store(false, Ordering::SeqCst);
    while broker.acked() < 20 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "shard 1 never caught up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    let odds: Ledger = (1..20).step_by(2).map(|i| format!("evt-{i}")).collect();
    assert_eq!(shards[1].store.state().await, odds);
    assert_eq!(broker.pending() + broker.in_flight(), 0);
}

#[tokio::test]
async fn a_transaction_failing_in_one_shard_retries_only_that_shards_messages() {
    let broker = MemoryBroker::new();
    let shards = [Outage::default(), Outage::default()];
    // Every transaction of shard 1 fails at first: the whole chunk, its halves, then each
    // message alone once.
    shards[1].failing.store(8, Ordering::SeqCst);
    for i in 0..8 {
        let tenant = if i % 2 == 0 { "t0" } else { "t1" };
        publish(&broker, &format!("evt-{i}"), tenant, None);
    }
    let store = Sharded::new(shards.to_vec(), by_tenant);
    let stats = Consumer::new("c", broker.source(), store, Record)
        .batch_size(8)
        .retry(
            RetryPolicy::default()
                .max_attempts(10)
                .backoff(Duration::from_millis(1), Duration::from_millis(2)),
        )
        .run_until_idle()
        .await
        .unwrap();
    // Shard 0's four are applied in order, untouched by shard 1's failures.
    let evens: Ledger = (0..8).step_by(2).map(|i| format!("evt-{i}")).collect();
    let odds: Ledger = (1..8).step_by(2).map(|i| format!("evt-{i}")).collect();
    assert_eq!(shards[0].store.state().await, evens);
    let mut applied = shards[1].store.state().await;
    applied.sort();
    assert_eq!(applied, odds, "shard 1's messages, each once");
    assert_eq!(stats.applied, 8);
    assert!(stats.retried > 0, "{stats:?}");
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending() + broker.in_flight(), 0);
}

/// A shard in an outage takes no more than its share: when what arrives first is all the down
/// shard's (more than the whole window), the healthy shard's messages behind it are still
/// applied, on a source without lanes and on one with lanes.
#[tokio::test]
async fn a_shard_that_is_down_does_not_take_every_slot_of_the_window() {
    for lanes in [false, true] {
        let broker = if lanes {
            MemoryBroker::with_lanes()
        } else {
            MemoryBroker::new()
        };
        let shards = [Outage::default(), Outage::default()];
        shards[1].down.store(true, Ordering::SeqCst);
        // Shard 1's sixty first, in six lanes where the source has lanes: three times the
        // window of 2 × 10; then shard 0's twenty, in lanes of their own.
        for i in 0..60 {
            let lane = format!("p{}", i % 6);
            publish(&broker, &format!("down-{i}"), "t1", lanes.then_some(&*lane));
        }
        for i in 0..20 {
            let lane = format!("q{}", i % 2);
            publish(&broker, &format!("up-{i}"), "t0", lanes.then_some(&*lane));
        }
        let store = Sharded::new(shards.to_vec(), by_tenant);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = Consumer::new("c", broker.source(), store, Record)
            .batch_size(10)
            .parallel_lanes(2)
            .error_backoff(Duration::from_millis(5));
        let running = tokio::spawn(consumer.run_until(async {
            let _ = stopped.await;
        }));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while shards[0].store.state().await.len() < 20 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "lanes {lanes}: shard 0 applied {} of 20 while shard 1 was down: the down \
                 shard held the whole window",
                shards[0].store.state().await.len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(shards[1].store.state().await.is_empty());
        // Back up: every message of shard 1 is applied, each once, and nothing is left.
        shards[1].down.store(false, Ordering::SeqCst);
        while shards[1].store.state().await.len() < 60 || broker.acked() < 80 {
            assert!(
                tokio::time::Instant::now() < deadline + Duration::from_secs(10),
                "lanes {lanes}: shard 1 never caught up: {} applied, {} acked",
                shards[1].store.state().await.len(),
                broker.acked()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.send(()).unwrap();
        running.await.unwrap().unwrap();
        let mut applied = shards[1].store.state().await;
        applied.sort();
        applied.dedup();
        assert_eq!(applied.len(), 60, "lanes {lanes}: each of shard 1's once");
        assert_eq!(broker.pending() + broker.in_flight(), 0, "lanes {lanes}");
        assert!(broker.dead_letters().is_empty(), "lanes {lanes}");
    }
}
