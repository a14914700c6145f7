//! The algorithm on the in-memory broker and store: fast, deterministic, every crash point.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::collections::BTreeMap;
use std::time::Duration;

use inbox_core::effect::{Acquired, Attempt, Effect, EffectHandler, Lease, OnUnknown};
use inbox_core::{Consumer, Error, Handler, HandlerError, Message, MessageId, RetryPolicy, Stage};
use inbox_testkit::{Crash, MemoryBroker, MemoryStore, MemoryTx, ScriptedLeases, WithoutInbox};

/// Balances per account and the IDs applied, in order.
#[derive(Debug, Clone, Default)]
struct Wallet {
    balances: BTreeMap<u8, i64>,
    ledger: Vec<String>,
}

struct Credit;

impl Handler<MemoryTx<Wallet>> for Credit {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Wallet>,
        id: &MessageId,
        m: &Message,
    ) -> Result<(), HandlerError> {
        let (account, amount): (u8, i64) = m.json()?;
        if amount < 0 {
            return Err(HandlerError::transient("negative credit"));
        }
        let wallet = tx.state_mut();
        *wallet.balances.entry(account).or_default() += amount;
        wallet.ledger.push(id.to_string());
        Ok(())
    }
}

fn publish(broker: &MemoryBroker, id: &str, account: u8, amount: i64) {
    broker.publish(Some(id), serde_json::to_vec(&(account, amount)).unwrap());
}

/// Publishes a message in ordering lane `lane` (a partition, say).
fn publish_in_lane(broker: &MemoryBroker, lane: &str, id: Option<&str>, amount: i64) {
    let id = id.map_or(
        Err(inbox_core::IdError::Missing { field: "id".into() }),
        |id| Ok(MessageId::new(id).unwrap()),
    );
    let mut message = Message::new(id, serde_json::to_vec(&(1u8, amount)).unwrap());
    message.meta.lane = Some(lane.to_owned());
    broker.publish_message(message);
}

fn fast(max_attempts: u32) -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(max_attempts)
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
}

/// Runs consumers (restarting after each crash) until the queue is empty; returns the crashes.
async fn drain<S: inbox_core::InboxStore<Tx = MemoryTx<Wallet>> + Clone>(
    broker: &MemoryBroker,
    store: &S,
    stage: Stage,
    batch: usize,
    lanes: usize,
) -> u32 {
    let crash = Crash::at(stage);
    let mut crashes = 0;
    while broker.pending() > 0 {
        let consumer = Consumer::new(
            "wallet",
            crash.source(broker.source()),
            crash.store(store.clone()),
            crash.handler(Credit),
        )
        .batch_size(batch)
        .parallel_lanes(lanes);
        match crash.run(consumer.run_until_idle()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => crashes += 1,
        }
    }
    crashes
}

#[tokio::test]
async fn every_crash_point_still_applies_each_message_once() {
    for (batch, lanes) in [(1, 1), (4, 1), (6, 3)] {
        for stage in [
            Stage::Claimed,
            Stage::Applied,
            Stage::Committed,
            Stage::Acked,
        ] {
            let broker = MemoryBroker::with_lanes();
            for i in 0..6 {
                let id = format!("evt-{i}");
                publish_in_lane(&broker, &format!("p{}", i % 3), Some(&id), 10);
            }
            let store = MemoryStore::<Wallet>::new();
            let crashes = drain(&broker, &store, stage, batch, lanes).await;
            let wallet = store.state().await;
            assert_eq!(crashes, 1, "{stage:?}");
            assert_eq!(
                wallet.ledger.len(),
                6,
                "{stage:?} batch {batch}: {:?}",
                wallet.ledger
            );
            assert_eq!(wallet.balances[&1], 60, "{stage:?} batch {batch}");
        }
    }
}

#[tokio::test]
async fn without_the_inbox_a_crash_after_commit_applies_twice() {
    let broker = MemoryBroker::new();
    publish(&broker, "evt-1", 1, 10);
    let store = MemoryStore::<Wallet>::new();
    drain(
        &broker,
        &WithoutInbox(store.clone()),
        Stage::Committed,
        1,
        1,
    )
    .await;
    assert_eq!(store.state().await.ledger, ["evt-1", "evt-1"]);
}

#[tokio::test]
async fn duplicates_inside_one_batch_are_applied_once() {
    let broker = MemoryBroker::new();
    for _ in 0..3 {
        publish(&broker, "evt-1", 1, 10);
    }
    publish(&broker, "evt-2", 1, 5);
    let store = MemoryStore::<Wallet>::new();
    let stats = Consumer::new("wallet", broker.source(), store.clone(), Credit)
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(
        (stats.applied, stats.skipped_duplicates, stats.commits),
        (2, 2, 1)
    );
    assert_eq!(store.state().await.balances[&1], 15);
    assert_eq!(broker.pending(), 0);
}

#[tokio::test]
async fn lanes_keep_their_order_commit_apart_and_dead_letter_side_by_side() {
    let broker = MemoryBroker::with_lanes();
    for i in 0..12 {
        let lane = format!("p{}", i % 3);
        publish_in_lane(&broker, &lane, Some(&format!("{lane}-{i:02}")), 10);
    }
    publish_in_lane(&broker, "p1", None, 10);
    publish_in_lane(&broker, "p2", Some("p2-bad"), -1);
    let store = MemoryStore::<Wallet>::new();
    let stats = Consumer::new("wallet", broker.source(), store.clone(), Credit)
        .batch_size(20)
        .parallel_lanes(3)
        .retry(fast(2))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(
        (stats.applied, stats.dead_lettered, stats.commits),
        (12, 2, 3),
        "one transaction per lane: {stats:?}"
    );
    let ledger = store.state().await.ledger;
    for lane in ["p0", "p1", "p2"] {
        let of_lane: Vec<&String> = ledger.iter().filter(|id| id.starts_with(lane)).collect();
        let mut sorted = of_lane.clone();
        sorted.sort();
        assert_eq!(of_lane, sorted, "lane {lane} applied out of order");
        assert_eq!(of_lane.len(), 4);
    }
    assert_eq!(broker.pending(), 0);
    let mut reasons: Vec<String> = broker.dead_letters().into_iter().map(|(_, r)| r).collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            "handler failed 2 time(s), last error: negative credit",
            "message has no ID: id is missing"
        ]
    );
}

#[tokio::test]
async fn a_transient_failure_is_retried_then_dead_lettered_without_blocking_the_rest() {
    let broker = MemoryBroker::new();
    publish(&broker, "evt-1", 1, 10);
    publish(&broker, "evt-bad", 1, -1);
    publish(&broker, "evt-3", 1, 10);
    let store = MemoryStore::<Wallet>::new();
    let stats = Consumer::new("wallet", broker.source(), store.clone(), Credit)
        .batch_size(3)
        .retry(fast(3))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(
        (stats.applied, stats.retried, stats.dead_lettered),
        (2, 2, 1)
    );
    let dead = broker.dead_letters();
    assert_eq!(
        dead[0].1,
        "handler failed 3 time(s), last error: negative credit"
    );
    assert_eq!(store.state().await.ledger, ["evt-1", "evt-3"]);
    assert_eq!(store.claims().await, 2, "the failed message keeps no claim");
}

#[tokio::test]
async fn a_message_redelivered_too_often_is_dead_lettered_before_its_handler() {
    let broker = MemoryBroker::new();
    publish(&broker, "evt-1", 1, 10);
    // Two consumers die holding it, so its third delivery is past a limit of 2.
    for _ in 0..2 {
        let crash = Crash::at(Stage::Claimed);
        let crashed = Consumer::new(
            "wallet",
            broker.source(),
            crash.store(MemoryStore::<Wallet>::new()),
            Credit,
        );
        let crashed = crash.run(crashed.run_until_idle()).await;
        assert!(crashed.is_err(), "{crashed:?}");
    }
    let store = MemoryStore::<Wallet>::new();
    let stats = Consumer::new("wallet", broker.source(), store.clone(), Credit)
        .max_deliveries(2)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(
        broker.dead_letters()[0].1,
        "delivered 3 times, more than the limit of 2"
    );
    assert!(store.state().await.ledger.is_empty());
}

#[tokio::test]
async fn a_dead_letter_that_fails_leaves_the_message_to_come_back_and_park_later() {
    let broker = MemoryBroker::new();
    broker.publish(None, serde_json::to_vec(&(1u8, 10i64)).unwrap());
    publish(&broker, "evt-1", 1, 10);
    // The dead-letter destination refuses the first two tries.
    broker.fail_dead_letters(2);
    let store = MemoryStore::<Wallet>::new();
    let stats = Consumer::new("wallet", broker.source(), store.clone(), Credit)
        .batch_size(1)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(
        (stats.applied, stats.dead_lettered, stats.errors),
        (1, 1, 2),
        "{stats:?}"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "parked once, when the destination took it");
    assert_eq!(dead[0].1, "message has no ID: id is missing");
    assert_eq!(
        dead[0].0.meta.delivery_count,
        Some(3),
        "each failed dead letter handed the message back"
    );
    assert_eq!(broker.pending(), 0, "nothing left unacked");
    assert_eq!(broker.acked(), 2);
    assert_eq!(store.state().await.ledger, ["evt-1"]);
}

#[tokio::test]
async fn bad_configuration_is_refused_with_a_reason() {
    let broker = MemoryBroker::new();
    let err = Consumer::new("", broker.source(), MemoryStore::<Wallet>::new(), Credit)
        .run_until_idle()
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid consumer configuration: the consumer name is empty"
    );
    let err = Consumer::new("c", broker.source(), MemoryStore::<Wallet>::new(), Credit)
        .batch_size(0)
        .run_until_idle()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("batch size is 0"));
    let err = Consumer::new("c", broker.source(), MemoryStore::<Wallet>::new(), Credit)
        .parallel_lanes(0)
        .run_until_idle()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("parallel_lanes is 0"));
}

#[tokio::test]
async fn a_consumer_name_with_a_control_character_is_refused_at_start() {
    let broker = MemoryBroker::new();
    publish(&broker, "evt-1", 1, 10);
    for name in ["wallet\0", "wallet\n"] {
        let err = Consumer::new(name, broker.source(), MemoryStore::<Wallet>::new(), Credit)
            .run_until_idle()
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("control character"),
            "{name:?}: {err}"
        );
    }
    let err = Consumer::effects(
        "mailer\0",
        broker.source(),
        ScriptedLeases::default(),
        NoCall,
    )
    .run_until_idle()
    .await
    .unwrap_err();
    assert!(err.to_string().contains("control character"), "{err}");
    assert!(
        broker.dead_letters().is_empty(),
        "nothing was dead-lettered"
    );
    assert_eq!(
        broker.pending(),
        1,
        "the message waits for a consumer that can start"
    );
}

/// An effect handler that never gets to call.
struct NoCall;

impl EffectHandler<()> for NoCall {
    fn on_unknown(&self) -> OnUnknown {
        OnUnknown::Skip
    }
    async fn call(&self, _: &Effect, _: &Message) -> Result<(), HandlerError> {
        unreachable!("the consumer never starts")
    }
}

#[test]
fn public_types_and_futures_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<Message>();
    send_sync::<MessageId>();
    send_sync::<Error>();
    send_sync::<HandlerError>();
    send_sync::<MemoryStore<Wallet>>();
    send_sync::<inbox_core::Stats>();
    let broker = MemoryBroker::new();
    let consumer = Consumer::new("c", broker.source(), MemoryStore::<Wallet>::new(), Credit);
    let run = consumer.run_until_idle();
    send(&run); // the run future can be spawned on a multi-threaded runtime
}

/// The same with any source, store and handlers, as a library generic over them sees it: the
/// traits' futures are declared `Send`, so the consumer's run futures are too (given an ack
/// handle that is `Sync`, as the consumer shares its deliveries between its lanes' futures).
/// Compiling is the test.
#[allow(dead_code)]
fn run_futures_are_send_for_any_source_store_and_handler<S, St, H, B, L, E>(
    source: impl Fn() -> S,
    store: St,
    handler: H,
    batch_handler: B,
    leases: L,
    effect_handler: E,
) where
    S: inbox_core::MessageSource + 'static,
    S::Ack: Sync,
    St: inbox_core::InboxStore + Clone,
    H: inbox_core::Handler<St::Tx> + 'static,
    B: inbox_core::BatchHandler<St::Tx> + 'static,
    L: inbox_core::effect::LeaseStore,
    E: EffectHandler<L::Tx> + 'static,
{
    fn send<T: Send>(_: T) {}
    send(Consumer::new("c", source(), store.clone(), handler).run());
    send(Consumer::batched("c", source(), store, batch_handler).run_until_idle());
    send(Consumer::effects("c", source(), leases, effect_handler).run());
}

#[test]
fn a_retention_shorter_than_the_broker_window_is_reported() {
    use inbox_core::retention_shortfall;
    let day = Duration::from_secs(86_400);
    assert_eq!(retention_shortfall(14 * day, Some(7 * day)), None);
    assert_eq!(retention_shortfall(3 * day, Some(4 * day)), Some(day));
    assert_eq!(
        retention_shortfall(3 * day, None),
        None,
        "unknown window: nothing to say"
    );
}

#[tokio::test]
async fn the_consumer_reads_the_broker_window_at_start() {
    let broker = MemoryBroker::new();
    broker.set_retention(Duration::from_secs(4 * 86_400));
    let source = broker.source();
    assert_eq!(
        inbox_core::MessageSource::redelivery_window(&source),
        Some(Duration::from_secs(4 * 86_400))
    );
    publish(&broker, "evt-1", 1, 1);
    // A short retention only warns: the consumer still runs.
    let stats = Consumer::new("wallet", source, MemoryStore::<Wallet>::new(), Credit)
        .inbox_retention(Duration::from_secs(86_400))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.applied, 1);
}

/// An effect handler whose calls each wait for another call to be in flight beside them.
struct Pair(tokio::sync::Barrier);

impl EffectHandler<()> for Pair {
    fn on_unknown(&self) -> OnUnknown {
        OnUnknown::Retry
    }
    async fn call(&self, _: &Effect, _: &Message) -> Result<(), HandlerError> {
        tokio::time::timeout(Duration::from_secs(5), self.0.wait())
            .await
            .map(drop)
            .map_err(|_| HandlerError::permanent("no call ran beside this one"))
    }
}

#[tokio::test]
async fn the_effect_step_calls_its_lanes_side_by_side() {
    let broker = MemoryBroker::with_lanes();
    let leases = ScriptedLeases::default();
    leases.then_acquire([leased(); 4]);
    for (lane, id) in [("p0", "a"), ("p1", "b"), ("p0", "c"), ("p1", "d")] {
        publish_in_lane(&broker, lane, Some(id), 1);
    }
    let stats = Consumer::effects(
        "mailer",
        broker.source(),
        leases,
        Pair(tokio::sync::Barrier::new(2)),
    )
    .parallel_lanes(2)
    .run_until_idle()
    .await
    .unwrap();
    assert_eq!(
        (stats.applied, stats.dead_lettered),
        (4, 0),
        "each call found one beside it: {stats:?}"
    );
}

fn leased() -> Acquired {
    Acquired::Leased(Lease {
        token: 1,
        attempt: Attempt::First,
        attempts: 1,
        since_first: Duration::ZERO,
    })
}

/// An effect handler whose call never returns.
struct Hang;

impl EffectHandler<()> for Hang {
    fn on_unknown(&self) -> OnUnknown {
        OnUnknown::Retry
    }
    async fn call(&self, _: &Effect, _: &Message) -> Result<(), HandlerError> {
        std::future::pending().await
    }
}

#[tokio::test]
async fn a_hung_effect_call_is_cut_short_at_the_shutdown_timeout_and_its_message_kept() {
    let broker = MemoryBroker::new();
    publish(&broker, "evt-1", 1, 10);
    let leases = ScriptedLeases::default();
    leases.then_acquire([leased()]);
    let consumer = Consumer::effects("mailer", broker.source(), leases, Hang)
        .lease(Duration::from_secs(600))
        .shutdown_timeout(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let stats = consumer
        .run_until(tokio::time::sleep(Duration::from_millis(100)))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped after {:?}, not at the shutdown timeout",
        started.elapsed()
    );
    assert_eq!((stats.applied, broker.acked()), (0, 0), "{stats:?}");
    assert_eq!(broker.pending(), 1, "the message goes back to the broker");
}
