//! The scenarios, each generic over the broker. Each prints what it measured, then asserts it.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::wallet::{self, CreditEvent};
use crate::TestStore;
use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, Stage, StatsSnapshot};
use inbox_testkit::fast_retry;
use inbox_testkit::Crash;

use crate::checked::Checked;
use crate::{TestBroker, TestQueue};

pub use crate::kill::{
    a_consumer_process_killed_mid_stream_loses_nothing_and_applies_nothing_twice, consumer_process,
};
pub use crate::network::{
    a_black_holed_connection_is_given_up_and_replaced,
    a_broker_restarted_mid_stream_loses_and_repeats_nothing,
    a_refused_broker_is_retried_until_it_is_back,
    connections_cut_again_and_again_lose_and_repeat_nothing,
};
pub use crate::outbox::{
    a_handler_writes_the_outbox_the_relay_publishes_and_the_downstream_inbox_applies_each_once,
    a_lost_confirm_publishes_again_under_the_same_ids_and_the_inbox_skips_the_copies,
    headers_written_with_an_outbox_row_reach_the_consumer,
    two_relays_at_once_publish_every_row_once,
};
pub use crate::redelivery::a_downstream_outage_is_ridden_out_by_delayed_redeliveries;
pub use crate::replay::dead_letters_replayed_after_the_fix_are_applied_once_and_none_stay_parked;
pub use crate::zombie::{
    a_consumer_that_lost_its_message_mid_handler_applies_nothing_twice, run as zombie, ZombiePlan,
    ZombieReport,
};

/// How long a scenario waits for the queue to drain.
pub(crate) const LIMIT: Duration = Duration::from_secs(60);

fn credit(account: i64, amount: i64) -> Vec<u8> {
    CreditEvent::new(account, amount).to_json()
}

/// Sends a credit under a new ID and returns the ID.
async fn send_credit<Q: TestQueue>(queue: &Q, account: i64, amount: i64) -> MessageId {
    let id = MessageId::generate();
    queue
        .send(Some(id.as_str()), &credit(account, amount))
        .await;
    id
}

/// A source of `member` on `queue`, held to what it claims (see [`Checked`]).
pub(crate) async fn source<Q: TestQueue>(queue: &Q, member: &str) -> Checked<Q::Source> {
    Checked::new(queue.source(member).await)
}

/// The counters of all the runs of a scenario.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Totals {
    pub(crate) runs: u64,
    pub(crate) received: u64,
    pub(crate) applied: u64,
    pub(crate) skipped: u64,
    pub(crate) retried: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) commits: u64,
}

impl Totals {
    pub(crate) fn add(&mut self, s: &StatsSnapshot) {
        self.runs += 1;
        self.received += s.received;
        self.applied += s.applied;
        self.skipped += s.skipped_duplicates;
        self.retried += s.retried;
        self.dead_lettered += s.dead_lettered;
        self.commits += s.commits;
    }
}

/// Runs consumers (`run`, given a new source of `member`) until idle, one after another, until
/// `done` holds of their counters added to `totals` or [`LIMIT`] passes; returns the counters. A
/// message a consumer died holding comes back after the broker's own delay (a visibility
/// timeout, a claim interval).
pub(crate) async fn drain<Q, R, F, D, G>(
    queue: &Q,
    member: &str,
    mut totals: Totals,
    mut run: R,
    done: D,
) -> Totals
where
    Q: TestQueue,
    R: FnMut(Checked<Q::Source>) -> F,
    F: Future<Output = inbox_core::Result<StatsSnapshot>>,
    D: Fn(Totals) -> G,
    G: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        let stats = run(source(queue, member).await)
            .await
            .unwrap_or_else(|e| panic!("consumer {member}: {e}"));
        totals.add(&stats);
        if done(totals).await {
            return totals;
        }
        assert!(
            start.elapsed() < LIMIT,
            "not drained within {LIMIT:?}: {totals:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// [`drain`]s `queue` as `c1` with plain consumers of the wallet's credit on `db`, until `done`.
async fn drain_wallet<Q, D, F, G>(queue: &Q, db: &D, done: F) -> Totals
where
    Q: TestQueue,
    D: TestStore,
    F: Fn(Totals) -> G,
    G: Future<Output = bool>,
{
    let handler = db.credit();
    let run =
        |source| Consumer::new("wallet", source, db.inbox(), handler.clone()).run_until_idle();
    drain(queue, "c1", Totals::default(), run, done).await
}

/// What is left on the broker once it had a few seconds to settle (an offset commit, a
/// delete, a requeue in flight).
pub(crate) async fn left<Q: TestQueue>(queue: &Q) -> u64 {
    let start = Instant::now();
    loop {
        let left = queue.left().await;
        if left == 0 || start.elapsed() > Duration::from_secs(10) {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A fresh database on the store `D` and a fresh queue of `broker`.
pub(crate) async fn setup<B: TestBroker, D: TestStore>(
    broker: &B,
    scenario: &str,
) -> (D, B::Queue) {
    (D::create().await, broker.queue(scenario).await)
}

pub(crate) async fn finish<Q: TestQueue, D: TestStore>(db: D, queue: Q) {
    queue.cleanup().await;
    db.remove().await;
}

/// Whether the ledger holds `n` distinct events.
pub(crate) async fn ledger_has<D: TestStore>(db: &D, n: i64) -> bool {
    wallet::applied(db).await >= n
}

/// The article's first scenario: a producer retries a send, so one ID arrives twice; the
/// second copy is skipped and acked.
pub async fn the_same_id_twice_is_applied_once<B: TestBroker, D: TestStore>(broker: &B) {
    let (db, queue) = setup::<B, D>(broker, "same-id").await;
    let twice = MessageId::generate();
    queue.send(Some(twice.as_str()), &credit(1, 100)).await;
    send_credit(&queue, 1, 5).await;
    queue.send(Some(twice.as_str()), &credit(1, 100)).await; // the producer retried

    let totals = drain_wallet(&queue, &db, |t| async move { t.applied + t.skipped >= 3 }).await;

    let summary = wallet::summary(&db).await.expect("summary");
    let balance = wallet::balance(&db, 1).await;
    let left = left(&queue).await;
    println!("the same ID twice: {totals:?}, {summary:?}, balance {balance}, left {left}");
    assert_eq!(balance, 105, "credited once");
    assert_eq!((summary.ledger_rows, summary.distinct_events), (2, 2));
    assert_eq!(totals.skipped, 1);
    assert_eq!(left, 0, "the duplicate was acked too");
    finish(db, queue).await;
}

/// The consumer dies at each step of the algorithm in turn: after the claim, after the handler,
/// after the commit (the article's crash between commit and ack) and after the ack. Its
/// restarts lose nothing and apply nothing twice.
pub async fn a_crash_at_each_stage_loses_nothing_and_applies_nothing_twice<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    for stage in [
        Stage::Claimed,
        Stage::Applied,
        Stage::Committed,
        Stage::Acked,
    ] {
        let name = format!("crash-{stage:?}").to_lowercase();
        let (db, queue) = setup::<B, D>(broker, &name).await;
        for amount in [10, 20, 30, 40, 50] {
            send_credit(&queue, 1, amount).await;
        }
        let crash = Crash::at(stage);
        let consumer = Consumer::new(
            "wallet",
            crash.source(source(&queue, "c1").await),
            crash.store(db.inbox()),
            crash.handler(db.credit()),
        );
        let crashed = crash.run(consumer.run_until_idle()).await;
        assert!(
            matches!(&crashed, Err(c) if c.stage == stage),
            "{stage:?}: {crashed:?}"
        );

        // After a crash between commit and ack, the unacked message comes back (after a
        // visibility timeout, a claim interval) and must be skipped. Drained until nothing is
        // left: a message handed to a consumer that stopped (a pull it no longer reads) is
        // held until its ack wait ends, then comes back.
        let totals = drain_wallet(&queue, &db, |t| {
            let (db, queue) = (&db, &queue);
            async move {
                ledger_has(db, 5).await
                    && (stage != Stage::Committed || t.skipped >= 1)
                    && queue.left().await == 0
            }
        })
        .await;
        let summary = wallet::summary(&db).await.expect("summary");
        let left = left(&queue).await;
        println!("crash at {stage:?}, then restarts: {totals:?}, {summary:?}, left {left}");
        assert_eq!(
            (summary.ledger_rows, summary.distinct_events),
            (5, 5),
            "{stage:?}: nothing lost, nothing twice"
        );
        assert_eq!(wallet::balance(&db, 1).await, 150, "{stage:?}");
        assert!(summary.balances_exact, "{stage:?}");
        if stage == Stage::Committed {
            assert!(
                totals.skipped >= 1,
                "the committed, unacked message came back and was skipped"
            );
        }
        assert_eq!(left, 0, "{stage:?}");
        finish(db, queue).await;
    }
}

/// Two members of one group; every ID is sent twice, so copies reach both and race for the
/// claim: the primary key lets one apply it.
pub async fn racing_consumers_apply_each_id_once<B: TestBroker, D: TestStore>(broker: &B) {
    let (db, queue) = setup::<B, D>(broker, "race").await;
    let events = 30;
    for i in 0..events {
        let id = MessageId::generate();
        let payload = credit(1 + i % 3, 1);
        queue.send(Some(id.as_str()), &payload).await;
        queue.send(Some(id.as_str()), &payload).await;
    }
    let handler = db.credit().work(Duration::from_millis(2));
    let (c1, c2) = (source(&queue, "c1").await, source(&queue, "c2").await);
    let (a, b) = tokio::join!(
        Consumer::new("wallet", c1, db.inbox(), handler.clone()).run_until_idle(),
        Consumer::new("wallet", c2, db.inbox(), handler.clone()).run_until_idle(),
    );
    let (a, b) = (a.expect("c1 runs"), b.expect("c2 runs"));
    let mut totals = Totals::default();
    totals.add(&a);
    totals.add(&b);
    // What either member left behind (a rebalance, a late join) is drained by one.
    let totals = drain(
        &queue,
        "c1",
        totals,
        |source| Consumer::new("wallet", source, db.inbox(), handler.clone()).run_until_idle(),
        |t| async move { t.applied + t.skipped >= 2 * events as u64 },
    )
    .await;

    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&queue).await;
    println!(
        "racing consumers: c1 received {} applied {}; c2 received {} applied {}; {totals:?}; \
         {summary:?}; left {left}",
        a.received, a.applied, b.received, b.applied
    );
    assert_eq!(
        (summary.ledger_rows, summary.distinct_events),
        (events, events)
    );
    assert_eq!(totals.applied, events as u64);
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, events);
    assert_eq!(left, 0);
    finish(db, queue).await;
}

/// A message without an ID and one whose payload no handler can read are parked in the
/// dead-letter destination with their payload and a reason; nothing is applied or claimed.
pub async fn messages_without_an_id_or_with_a_bad_payload_are_dead_lettered<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "bad-input").await;
    let payload = credit(1, 7);
    queue.send(None, &payload).await;
    let bad_id = MessageId::generate();
    queue.send(Some(bad_id.as_str()), b"not json").await;

    let totals = drain_wallet(&queue, &db, |t| async move { t.dead_lettered >= 2 }).await;

    let dead = queue.dead_letters().await;
    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&queue).await;
    println!("bad input: {totals:?}, dead letters {dead:?}, {summary:?}, left {left}");
    assert_eq!(dead.len(), 2);
    let reason_of = |p: &[u8]| {
        dead.iter()
            .find(|d| d.payload == p)
            .map(|d| d.reason.clone())
            .unwrap_or_else(|| panic!("no dead letter with payload {p:?}: {dead:?}"))
    };
    let no_id = reason_of(&payload);
    assert!(no_id.contains("no ID"), "{no_id}");
    let not_json = reason_of(b"not json");
    assert!(not_json.contains("not valid JSON"), "{not_json}");
    assert_eq!(summary.ledger_rows, 0);
    assert_eq!(db.inbox_rows().await, 0, "no ID was recorded");
    assert_eq!(left, 0, "dead-lettered messages are acked");
    finish(db, queue).await;
}

/// The handler `H` behind a check `F` that may fail a message first: an account that is
/// locked, a downstream that is down.
#[derive(Clone)]
pub(crate) struct Guarded<H, F>(pub(crate) H, pub(crate) F);

impl<T, H, F> Handler<T> for Guarded<H, F>
where
    T: Send,
    H: Handler<T>,
    F: Fn(&MessageId, &Message) -> Result<(), HandlerError> + Send + Sync,
{
    async fn handle(&self, tx: &mut T, id: &MessageId, m: &Message) -> Result<(), HandlerError> {
        (self.1)(id, m)?;
        self.0.handle(tx, id, m).await
    }
}

/// The account that is always locked: a transient failure.
const LOCKED: i64 = 666;

/// A message whose handler keeps failing is retried up to the budget, then dead-lettered; the
/// messages around it are applied.
pub async fn a_failing_handler_is_retried_then_dead_lettered<B: TestBroker, D: TestStore>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "retry").await;
    let mut expected = 0;
    for i in 0..10 {
        if i == 4 {
            send_credit(&queue, LOCKED, 1).await;
        }
        send_credit(&queue, 1 + i % 4, i + 1).await;
        expected += i + 1;
    }
    let handler = Guarded(db.credit(), |_: &MessageId, m: &Message| {
        match m.json::<CreditEvent>()?.account_id {
            LOCKED => Err(HandlerError::transient("account 666 is locked")),
            _ => Ok(()),
        }
    });
    let totals = drain(
        &queue,
        "c1",
        Totals::default(),
        |source| {
            Consumer::new("wallet", source, db.inbox(), handler.clone())
                .retry(fast_retry(3))
                .run_until_idle()
        },
        |t| async move { t.applied + t.dead_lettered >= 11 },
    )
    .await;

    let dead = queue.dead_letters().await;
    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&queue).await;
    println!("retry budget: {totals:?}, dead letters {dead:?}, {summary:?}, left {left}");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].payload, credit(LOCKED, 1));
    assert!(dead[0].reason.contains("failed 3 time(s)"), "{dead:?}");
    assert_eq!((totals.retried, totals.dead_lettered), (2, 1));
    assert_eq!((summary.ledger_rows, summary.distinct_events), (10, 10));
    assert_eq!(summary.total_balance, expected);
    assert!(summary.balances_exact);
    assert_eq!(left, 0);
    finish(db, queue).await;
}

/// A message that kills its consumer every time (the process dies before the commit, so the
/// retry path never sees it) comes back with a rising delivery count until
/// `max_deliveries` parks it; a message sent after it is applied. Only where the broker counts
/// deliveries. (The message after it is sent once it is parked: a broker that hands consumers
/// messages ahead, as RabbitMQ's prefetch does, counts a delivery to each message in that window
/// at every crash, and would park those too.)
pub async fn a_message_that_kills_its_consumer_is_dead_lettered_by_its_delivery_count<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "poison").await;
    let claims = source(&queue, "c1").await.claims();
    if !claims.delivery_count() {
        println!(
            "poison: skipped: the source does not claim delivery counts ({claims:?}), so \
             max_deliveries does not apply"
        );
        finish(db, queue).await;
        return;
    }
    send_credit(&queue, 1, 1).await;
    let poison = send_credit(&queue, 1, 1000).await;
    let mut after_sent = false;

    let limit = 3;
    let handler = db.credit();
    let mut totals = Totals::default();
    let mut crashes = 0;
    let start = Instant::now();
    // The crashed runs' counters are lost with them: the ledger tells what was applied.
    while totals.dead_lettered == 0 || !ledger_has(&db, 2).await {
        assert!(
            start.elapsed() < LIMIT,
            "not settled within {LIMIT:?}: {crashes} crashes, {totals:?}"
        );
        // Each run is a restart of the same consumer.
        let crash = Crash::at_ids(Stage::Applied, [poison.clone()]);
        let consumer = Consumer::new(
            "wallet",
            source(&queue, "c1").await,
            db.inbox(),
            crash.handler(handler.clone()),
        )
        .max_deliveries(limit);
        match crash.run(consumer.run_until_idle()).await {
            Err(_) => crashes += 1,
            Ok(run) => totals.add(&run.expect("run")),
        }
        if totals.dead_lettered > 0 && !after_sent {
            send_credit(&queue, 1, 2).await;
            after_sent = true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let dead = queue.dead_letters().await;
    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&queue).await;
    println!(
        "poison: {crashes} crashes, {totals:?}, dead letters {dead:?}, {summary:?}, left {left}"
    );
    assert_eq!(crashes, limit);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].payload, credit(1, 1000));
    assert_eq!(
        dead[0].reason,
        "delivered 4 times, more than the limit of 3"
    );
    assert_eq!((summary.ledger_rows, summary.distinct_events), (2, 2));
    assert_eq!(
        wallet::balance(&db, 1).await,
        3,
        "the poison credit was never applied"
    );
    assert_eq!(left, 0);
    finish(db, queue).await;
}

/// 250 messages in batches of 50 over 4 lanes: each applied once, in far fewer transactions
/// than messages, and nothing left on the broker.
pub async fn batches_over_lanes_apply_everything_once<B: TestBroker, D: TestStore>(broker: &B) {
    let (db, queue) = setup::<B, D>(broker, "batches").await;
    let events = 250;
    for i in 0..events {
        send_credit(&queue, 1 + i % 5, 1).await;
    }
    let handler = db.credit();
    let totals = drain(
        &queue,
        "c1",
        Totals::default(),
        |source| {
            Consumer::new("wallet", source, db.inbox(), handler.clone())
                .batch_size(50)
                .parallel_lanes(4)
                .run_until_idle()
        },
        |t| async move { t.applied >= events as u64 },
    )
    .await;

    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&queue).await;
    println!("batches: {totals:?}, {summary:?}, left {left}");
    assert_eq!(
        (summary.ledger_rows, summary.distinct_events),
        (events, events)
    );
    assert_eq!(summary.total_balance, events);
    assert!(summary.balances_exact);
    assert!(
        totals.commits * 2 < totals.applied,
        "batched: {} commits for {} messages",
        totals.commits,
        totals.applied
    );
    assert_eq!(left, 0);
    finish(db, queue).await;
}
