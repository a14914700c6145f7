//! Strict order ([`Order::Strict`]): a message that fails blocks its lane until it is applied or
//! dead-lettered, so each lane is applied in the order published; by default later messages of
//! the lane overtake it.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_core::{
    BatchHandler, BatchItem, Consumer, Error, Handler, HandlerError, Message, MessageId, Order,
};
use inbox_testkit::{fast_retry, MemoryBroker, MemoryStore, MemoryTx};

/// The IDs applied, per lane, in the order applied.
type Ledger = BTreeMap<String, Vec<String>>;

/// Fails each message as often as its payload says (`u32::MAX`: always), then applies it.
#[derive(Clone, Default)]
struct Flaky {
    tries: Arc<Mutex<HashMap<String, u32>>>,
    /// As a set-based handler that does not say which message failed.
    unplaced: bool,
}

impl Flaky {
    fn fails(&self, id: &MessageId, message: &Message) -> bool {
        let failures: u32 = message.json().unwrap();
        let mut tries = self.tries.lock().unwrap();
        let tried = tries.entry(id.to_string()).or_default();
        *tried += 1;
        *tried <= failures
    }
}

fn record(tx: &mut MemoryTx<Ledger>, id: &MessageId, message: &Message) {
    let lane = message.meta.lane.clone().unwrap();
    tx.state_mut().entry(lane).or_default().push(id.to_string());
}

impl Handler<MemoryTx<Ledger>> for Flaky {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Ledger>,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        if self.fails(id, message) {
            return Err(HandlerError::transient(format!("{id} is not ready")));
        }
        record(tx, id, message);
        Ok(())
    }
}

impl BatchHandler<MemoryTx<Ledger>> for Flaky {
    type Item = ();

    fn decode(&self, _id: &MessageId, _message: &Message) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn handle_batch(
        &self,
        tx: &mut MemoryTx<Ledger>,
        batch: &[BatchItem<'_, ()>],
    ) -> Result<(), HandlerError> {
        for (i, entry) in batch.iter().enumerate() {
            if self.fails(entry.id, entry.message) {
                let e = HandlerError::transient(format!("{} is not ready", entry.id));
                return Err(if self.unplaced { e } else { e.at(i) });
            }
            record(tx, entry.id, entry.message);
        }
        Ok(())
    }
}

/// Lanes `a` and `b`, six messages each: `a-2` fails twice then applies, `b-3` always fails
/// (dead-lettered after three tries). Returns what the broker received, in order, per lane.
fn publish(broker: &MemoryBroker) -> Ledger {
    let mut published = Ledger::new();
    for i in 0..6 {
        for lane in ["a", "b"] {
            let id = format!("{lane}-{i}");
            let failures = match id.as_str() {
                "a-2" => 2,
                "b-3" => u32::MAX,
                _ => 0,
            };
            let mut message = Message::new(
                Ok(MessageId::new(&id).unwrap()),
                serde_json::to_vec(&failures).unwrap(),
            );
            message.meta.lane = Some(lane.to_owned());
            broker.publish_message(message);
            published.entry(lane.to_owned()).or_default().push(id);
        }
    }
    published
}

fn without(ledger: &Ledger, dead: &str) -> Ledger {
    ledger
        .iter()
        .map(|(lane, ids)| {
            (
                lane.clone(),
                ids.iter().filter(|id| *id != dead).cloned().collect(),
            )
        })
        .collect()
}

async fn run(order: Order, batched: Option<bool>) -> (Ledger, Ledger, Vec<String>) {
    let broker = MemoryBroker::with_lanes();
    let published = publish(&broker);
    let store = MemoryStore::<Ledger>::new();
    let handler = Flaky::default();
    let stats = match batched {
        None => {
            Consumer::new("strict", broker.source(), store.clone(), handler)
                .batch_size(6)
                .parallel_lanes(2)
                .retry(fast_retry(3))
                .order(order)
                .run_until_idle()
                .await
        }
        Some(unplaced) => {
            Consumer::batched(
                "strict",
                broker.source(),
                store.clone(),
                Flaky {
                    unplaced,
                    ..handler
                },
            )
            .batch_size(6)
            .parallel_lanes(2)
            .retry(fast_retry(3))
            .order(order)
            .run_until_idle()
            .await
        }
    };
    stats.unwrap();
    assert_eq!(broker.pending(), 0);
    let dead = broker
        .dead_letters()
        .iter()
        .map(|(m, _)| m.id.as_ref().unwrap().to_string())
        .collect();
    (published, store.state().await, dead)
}

#[tokio::test]
async fn strict_order_applies_each_lane_in_published_order() {
    let (published, applied, dead) = run(Order::Strict, None).await;
    assert_eq!(dead, ["b-3"]);
    assert_eq!(applied, without(&published, "b-3"));
}

#[tokio::test]
async fn strict_order_finds_the_first_failure_of_a_batch_handler() {
    for unplaced in [false, true] {
        let (published, applied, dead) = run(Order::Strict, Some(unplaced)).await;
        assert_eq!(dead, ["b-3"], "unplaced {unplaced}");
        assert_eq!(applied, without(&published, "b-3"), "unplaced {unplaced}");
    }
}

/// Today's default: the rest of the chunk is committed first, and the failed message after it.
#[tokio::test]
async fn by_default_later_messages_overtake_a_failing_one() {
    let (_, applied, dead) = run(Order::FailuresLast, None).await;
    assert_eq!(dead, ["b-3"]);
    assert_eq!(applied["a"], ["a-0", "a-1", "a-3", "a-4", "a-5", "a-2"]);
    assert_eq!(applied["b"], ["b-0", "b-1", "b-2", "b-4", "b-5"]);
}

/// Shutdown while a lane is blocked hands back the failed message and everything after it; the
/// next consumer applies them in order.
#[tokio::test]
async fn shutdown_while_blocked_hands_back_the_rest_of_the_lane_in_order() {
    let broker = MemoryBroker::with_lanes();
    let published = publish(&broker);
    let store = MemoryStore::<Ledger>::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handler = Flaky::default();
    // a-2 fails twice: the slow retry blocks lane `a` when shutdown comes.
    let slow = inbox_core::RetryPolicy::default()
        .max_attempts(3)
        .backoff(Duration::from_secs(60), Duration::from_secs(60));
    let running = tokio::spawn(
        Consumer::new("strict", broker.source(), store.clone(), handler.clone())
            .batch_size(6)
            .parallel_lanes(2)
            .retry(slow)
            .order(Order::Strict)
            .error_backoff(Duration::from_millis(1))
            .run_until(async {
                stopped.await.ok();
            }),
    );
    let blocked = inbox_testkit::eventually(Duration::from_secs(5), || async {
        store.state().await.get("a").is_some_and(|a| a.len() == 2)
    })
    .await;
    assert!(blocked);
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(store.state().await["a"], ["a-0", "a-1"]);
    Consumer::new("strict", broker.source(), store.clone(), handler)
        .batch_size(6)
        .parallel_lanes(2)
        .retry(fast_retry(3))
        .order(Order::Strict)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(store.state().await, without(&published, "b-3"));
}

#[tokio::test]
async fn strict_order_on_a_source_without_lanes_takes_one_chunk_at_a_time() {
    let broker = MemoryBroker::new();
    let refused = Consumer::new(
        "strict",
        broker.source(),
        MemoryStore::<Ledger>::new(),
        Flaky::default(),
    )
    .parallel_lanes(2)
    .order(Order::Strict)
    .run_until_idle()
    .await;
    assert!(matches!(refused, Err(Error::Config(_))), "{refused:?}");
}

/// A dead letter that fails sends the failed message back to the broker: what its lane received
/// after it, waiting in the consumer, goes back too, and is applied after it.
#[tokio::test]
async fn a_failed_dead_letter_sends_the_rest_of_the_lane_back_behind_it() {
    let broker = MemoryBroker::with_lanes();
    let published = publish(&broker);
    // One try each (and one more where a chunk is split): `a-2` and `b-3` are dead-lettered,
    // both dead letters fail, and both come back: `a-2` is applied at its third try, `b-3`
    // dead-lettered again.
    broker.fail_dead_letters(2);
    let store = MemoryStore::<Ledger>::new();
    // Chunks of two: `a-4` and `a-5` wait in the consumer while `a-2` is retried.
    Consumer::new("strict", broker.source(), store.clone(), Flaky::default())
        .batch_size(2)
        .parallel_lanes(2)
        .retry(fast_retry(1))
        .error_backoff(Duration::from_millis(1))
        .order(Order::Strict)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(broker.pending(), 0);
    assert_eq!(broker.dead_letters().len(), 1);
    assert_eq!(store.state().await, without(&published, "b-3"));
}

/// Records each ID applied, and whether the message without an ID ahead of it in its lane was
/// parked by then.
struct AfterTheLetter {
    broker: MemoryBroker,
}

impl Handler<MemoryTx<Ledger>> for AfterTheLetter {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Ledger>,
        id: &MessageId,
        _message: &Message,
    ) -> Result<(), HandlerError> {
        let parked = self.broker.dead_letters().len();
        tx.state_mut()
            .entry(id.to_string())
            .or_default()
            .push(format!("{parked} parked before it"));
        Ok(())
    }
}

/// A message parked before its claim (here: it has no ID) whose dead letter fails is not yet
/// dead-lettered: under strict order its lane waits until it is, and the message after it is
/// applied only then.
#[tokio::test]
async fn strict_order_waits_for_a_dead_letter_that_failed() {
    let broker = MemoryBroker::with_lanes();
    let mut no_id = Message::new(
        Err(inbox_core::IdError::Missing { field: "id".into() }),
        "{}",
    );
    no_id.meta.lane = Some("a".into());
    broker.publish_message(no_id);
    let mut after = Message::new(Ok(MessageId::new("a-1").unwrap()), "{}");
    after.meta.lane = Some("a".into());
    broker.publish_message(after);
    broker.fail_dead_letters(1);
    let store = MemoryStore::<Ledger>::new();
    let handler = AfterTheLetter {
        broker: broker.clone(),
    };
    Consumer::new("strict", broker.source(), store.clone(), handler)
        .batch_size(6)
        .error_backoff(Duration::from_millis(1))
        .order(Order::Strict)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(broker.dead_letters().len(), 1);
    assert_eq!(
        store.state().await.get("a-1"),
        Some(&vec!["1 parked before it".to_owned()]),
        "a-1 was applied before the message ahead of it in its lane was parked"
    );
}

/// Applies each ID in order; `slow` waits for `release` first.
struct InOrder {
    release: Arc<tokio::sync::Notify>,
}

impl Handler<MemoryTx<Ledger>> for InOrder {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Ledger>,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        if id.as_str() == "slow" {
            self.release.notified().await;
        }
        record(tx, id, message);
        Ok(())
    }
}

/// Strict order when the broker takes a delivery back while it waits in its lane (an SQS
/// visibility timeout the heartbeat noticed): the stale copy is dropped, and what follows it
/// in its lane waits for its new copy, instead of being applied before it.
#[tokio::test]
async fn strict_order_waits_for_the_new_copy_of_a_delivery_taken_back() {
    let broker = MemoryBroker::with_lanes();
    let publish = |id: &str| {
        let mut message = Message::new(Ok(MessageId::new(id).unwrap()), "0");
        message.meta.lane = Some("a".into());
        broker.publish_message(message);
    };
    let store = MemoryStore::<Ledger>::new();
    let release = Arc::new(tokio::sync::Notify::new());
    publish("slow");
    let consumer = Consumer::new(
        "strict",
        broker.source(),
        store.clone(),
        InOrder {
            release: Arc::clone(&release),
        },
    )
    .batch_size(10)
    // A free lane reads ahead, so the new copy comes in while `slow` holds the lane.
    .parallel_lanes(2)
    .error_backoff(Duration::from_millis(1))
    .order(Order::Strict);
    let drained = broker.clone();
    let running = tokio::spawn(consumer.run_until(async move {
        while drained.pending() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }));
    let until = |n: usize| {
        let broker = broker.clone();
        async move {
            for _ in 0..1000 {
                if broker.in_flight() == n && broker.pending() == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("never {n} in flight");
        }
    };
    until(1).await;
    publish("first");
    publish("second");
    until(3).await;
    // `first` is taken back while it waits behind `slow`, and handed out again.
    assert_eq!(
        broker.redeliver("first", inbox_testkit::Redelivery::StaleHandle),
        1
    );
    until(3).await;
    release.notify_one();
    running.await.unwrap().unwrap();
    assert_eq!(
        store.state().await.get("a").unwrap(),
        &["slow", "first", "second"],
        "the lane was applied out of order"
    );
}
