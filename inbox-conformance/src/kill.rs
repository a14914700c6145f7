//! The article's headline scenario: the consumer process is SIGKILLed mid-stream, again and
//! again, and restarted. SIGKILL runs no destructor: no close, no last ack, no last commit. What
//! a dead consumer held comes back the way the broker gives a dead member's messages to another
//! (a rebalance, a requeue, a visibility timeout, `XAUTOCLAIM`), and a last consumer drains.
//!
//! The scenario is written once, in [`run`]: the suite asserts on its [`KillReport`], and
//! `evidence kill-test` runs it over variants, stores and runs and writes its tables. Each side
//! says through a [`KillHarness`] how its consumer process starts (the suite runs its test binary
//! again, evidence its `consume` command) and how it reads the ledger and the broker.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::future::{BoxFuture, LocalBoxFuture};
use inbox_core::{BoxError, Consumer, MessageId, StatsSnapshot};
use tokio::process::Child;
use tokio::time::Instant;

use crate::scenarios::{left, setup};
use crate::wallet::{CreditEvent, Summary};
use crate::{child, TestBroker, TestQueue, TestStore};

/// When one kill falls.
#[derive(Debug, Clone, Copy)]
pub enum KillAt {
    /// Once the ledger holds this many events, and a random 0–39 ms more, so that kills also
    /// land between a commit and its ack.
    Applied(i64),
    /// This long after the consumer's first write to the ledger (or after it died, the broker
    /// has nothing more for it, or 30 s): on Kafka a restarted member waits for the group to
    /// notice the killed one (the session timeout) before it gets partitions.
    AfterFirstWrite(Duration),
}

/// What a kill run does, on events already published.
#[derive(Debug, Clone, Default)]
pub struct KillPlan {
    /// Events published to the queue.
    pub events: i64,
    /// Each account's balance once every event is applied once.
    pub expected: HashMap<i64, i64>,
    /// One consumer process each, killed when its entry says.
    pub kills: Vec<KillAt>,
}

/// What a kill run counted.
#[derive(Debug, Clone, Copy, Default)]
pub struct KillReport {
    /// Consumer processes killed.
    pub kills: u32,
    /// Consumer processes that ended by themselves and were started again.
    pub self_crashes: u32,
    /// Ledger rows beyond one per event.
    pub duplicates: i64,
    /// Events never applied.
    pub lost: i64,
    /// Balances match the ledger and the balances expected.
    pub balances_exact: bool,
    /// Messages the broker still held once the drain was over ([`KillHarness::waiting`]).
    pub left: u64,
    /// From the drain's start to its last write to the ledger.
    pub drained_in: Duration,
}

/// What a run tells its caller as it goes.
#[derive(Debug, Clone, Copy)]
pub enum KillTick<'a> {
    /// The ledger holds this many events.
    Applied(i64),
    /// This kill (from 1) of so many is under way.
    Killing(usize, usize),
    /// The last consumer drains.
    Draining,
    /// Something worth a line of its own (a draining consumer replaced).
    Note(&'a str),
}

/// A boxed future of the harness's closures.
type Fut<'a, T> = BoxFuture<'a, Result<T, BoxError>>;

/// How a kill run reaches its consumer processes, the ledger and the broker: closures, so that
/// the suite (its test binary, its queue, its store) and evidence (its `consume` command, any
/// broker and store picked at run time) run the same [`run`].
#[allow(clippy::type_complexity)]
pub struct KillHarness<'a> {
    /// Starts the consumer process of kill `k` (from 0) again or for the first time, once it is
    /// ready to consume.
    pub spawn: Box<dyn FnMut(usize) -> Fut<'a, Child> + Send + 'a>,
    /// What the ledger says now.
    pub summary: Box<dyn Fn() -> Fut<'a, Summary> + Send + Sync + 'a>,
    /// Every account's balance, by id.
    pub balances: Box<dyn Fn() -> Fut<'a, Vec<(i64, i64)>> + Send + Sync + 'a>,
    /// Messages not acked yet, as the broker tells while consumers run
    /// ([`TestQueue::waiting`]).
    pub waiting: Box<dyn Fn() -> Fut<'a, u64> + Send + Sync + 'a>,
    /// Runs one draining consumer in this process until the future it is given resolves. Its
    /// future need not be `Send`: a source's acks need not be `Sync`.
    pub consume: Box<
        dyn Fn(BoxFuture<'static, ()>) -> LocalBoxFuture<'a, Result<StatsSnapshot, BoxError>>
            + Send
            + Sync
            + 'a,
    >,
    /// How long a dead consumer's unacked messages take to come back
    /// ([`TestQueue::redelivery_delay`]).
    pub redelivery_delay: Duration,
    /// How often a stalled draining consumer is replaced; 0: a stall fails the run.
    pub drain_restarts: u32,
    /// Told how the run goes.
    pub tick: Box<dyn Fn(KillTick<'_>) + Send + Sync + 'a>,
}

impl std::fmt::Debug for KillHarness<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KillHarness")
            .field("redelivery_delay", &self.redelivery_delay)
            .field("drain_restarts", &self.drain_restarts)
            .finish_non_exhaustive()
    }
}

/// Starts a consumer process per kill of `plan` and SIGKILLs it when the kill says, starting
/// again one that ends by itself (counted as a self-crash); then [`drain`]s and counts.
pub async fn run(h: &mut KillHarness<'_>, plan: &KillPlan) -> Result<KillReport, BoxError> {
    let mut report = KillReport::default();
    for (k, &at) in plan.kills.iter().enumerate() {
        let mut child = (h.spawn)(k).await?;
        (h.tick)(KillTick::Killing(k + 1, plan.kills.len()));
        match at {
            KillAt::AfterFirstWrite(work) => {
                let kill_at = first_write(h, &mut child).await? + work;
                while Instant::now() < kill_at {
                    restart_if_ended(h, k, &mut child, &mut report).await?;
                    (h.tick)(KillTick::Applied((h.summary)().await?.distinct_events));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            KillAt::Applied(target) => {
                let deadline = Instant::now() + Duration::from_secs(120);
                loop {
                    let applied = (h.summary)().await?.distinct_events;
                    (h.tick)(KillTick::Applied(applied));
                    if applied >= target {
                        break;
                    }
                    if Instant::now() > deadline {
                        return Err(format!("no progress: {applied} of {target} applied").into());
                    }
                    restart_if_ended(h, k, &mut child, &mut report).await?;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let jitter = rand::random_range(0..40);
                tokio::time::sleep(Duration::from_millis(jitter)).await;
            }
        }
        child.start_kill()?; // SIGKILL: no destructor, no close, no last commit
        child.wait().await?;
        report.kills += 1;
    }
    report.drained_in = drain(h, plan.events).await?;
    tally(h, plan, report).await
}

/// Starts kill `k`'s process again where the one running ended by itself.
async fn restart_if_ended(
    h: &mut KillHarness<'_>,
    k: usize,
    child: &mut Child,
    report: &mut KillReport,
) -> Result<(), BoxError> {
    if child.try_wait()?.is_some() {
        report.self_crashes += 1;
        *child = (h.spawn)(k).await?;
    }
    Ok(())
}

/// When the child first writes to the ledger; now, if it dies first or the broker holds nothing
/// more for it (after an ack on receipt lost the rest, say), or after 30 s at most.
async fn first_write(h: &KillHarness<'_>, child: &mut Child) -> Result<Instant, BoxError> {
    let rows = (h.summary)().await?.ledger_rows;
    let start = Instant::now();
    let mut next_look = start;
    while start.elapsed() < Duration::from_secs(30) && child.try_wait()?.is_none() {
        if (h.summary)().await?.ledger_rows != rows {
            break;
        }
        if Instant::now() >= next_look {
            if (h.waiting)().await? == 0 {
                break;
            }
            next_look = Instant::now() + Duration::from_secs(1);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Instant::now())
}

/// `report` with what the ledger and the broker say now of `plan`'s events.
pub async fn tally(
    h: &KillHarness<'_>,
    plan: &KillPlan,
    report: KillReport,
) -> Result<KillReport, BoxError> {
    let summary = (h.summary)().await?;
    let balances = (h.balances)().await?;
    let matches = balances.len() == plan.expected.len()
        && balances
            .iter()
            .all(|(id, balance)| plan.expected.get(id) == Some(balance));
    Ok(KillReport {
        duplicates: summary.duplicates(),
        lost: summary.lost(plan.events),
        balances_exact: summary.balances_exact && matches,
        left: (h.waiting)().await?,
        ..report
    })
}

/// Runs a draining consumer until the ledger holds `published` events, is quiet and the broker
/// holds nothing more; returns the time from its start to its last write.
///
/// A consumer that applies nothing for the redelivery delay and 10 s more while the broker still
/// holds messages is stopped and replaced, at most [`KillHarness::drain_restarts`] times, each
/// said as a [`KillTick::Note`]: Tansu 0.6 can leave a group whose leader died during a
/// rebalance with an empty assignment for its last member, which then waits forever; a new
/// member makes the group rebalance. Where no restarts are allowed, such a stall fails the run.
/// The drain gives up (and the events left count as lost) after the delay and 60 s idle.
pub async fn drain(h: &KillHarness<'_>, published: i64) -> Result<Duration, BoxError> {
    (h.tick)(KillTick::Draining);
    let start = Instant::now();
    let (mut rows, mut last_change) = (-1, start);
    let delay = h.redelivery_delay;
    let mut restarts = 0;
    loop {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = (h.consume)(Box::pin(async {
            let _ = stopped.await;
        }));
        tokio::pin!(consumer);
        let member_start = Instant::now();
        // Why this member is replaced, or `None`: the drain is over.
        let stalled = loop {
            tokio::select! {
                finished = &mut consumer => {
                    finished?;
                    return Err("the draining consumer stopped by itself".into());
                }
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
            let summary = (h.summary)().await?;
            if summary.ledger_rows != rows {
                rows = summary.ledger_rows;
                last_change = Instant::now();
            }
            (h.tick)(KillTick::Applied(summary.distinct_events));
            let quiet = last_change.elapsed();
            let applied = summary.distinct_events >= published;
            if !(applied && quiet >= Duration::from_secs(1)) && quiet < delay {
                continue;
            }
            let left = (h.waiting)().await;
            if matches!(left, Ok(0)) {
                break None;
            }
            // Every event applied or not, the broker still holds messages (or cannot say): the
            // member may be stalled.
            if quiet < delay {
                continue;
            }
            // Idle since the later of the last write and this member's start.
            let idle = quiet.min(member_start.elapsed());
            if idle >= delay + Duration::from_secs(60) {
                break None;
            }
            if idle >= delay + Duration::from_secs(10)
                && (h.drain_restarts == 0 || restarts < h.drain_restarts)
            {
                break Some(format!(
                    "the draining consumer applied nothing for {} s while the broker holds {} \
                     messages ({}/{published} events applied)",
                    idle.as_secs(),
                    left.unwrap_or_default(),
                    summary.distinct_events
                ));
            }
        };
        let _ = stop.send(());
        match tokio::time::timeout(Duration::from_secs(30), consumer).await {
            Ok(result) => {
                result?;
            }
            Err(_) => (h.tick)(KillTick::Note("the draining consumer did not stop in 30 s")),
        }
        match stalled {
            None => return Ok(last_change - start),
            Some(stall) if h.drain_restarts == 0 => return Err(stall.into()),
            Some(stall) => (h.tick)(KillTick::Note(&format!("{stall}; replaced it"))),
        }
        restarts += 1;
    }
}

const EVENTS: i64 = 300;
const KILLS: i64 = 4;
const ACCOUNTS: i64 = 7;
/// A stalled draining consumer is replaced (see [`drain`]) as often as evidence replaces its
/// own: the suite's Kafka is Tansu.
const DRAIN_RESTARTS: u32 = 5;
/// Each message's handler sleeps this long, so that kills land mid-stream.
const WORK: Duration = Duration::from_millis(5);
/// The name [`crate::suite!`] gives the child's test.
const CHILD_TEST: &str = "conformance_child";

/// Starts the consumer as a child process (the test binary again, running only
/// [`consumer_process`]), kills it with SIGKILL once it applied a share of the events, and
/// again, each a new group member; then a last consumer drains what is left. Every event ends up
/// in the ledger exactly once.
pub async fn a_consumer_process_killed_mid_stream_loses_nothing_and_applies_nothing_twice<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    if child::is_child() {
        return;
    }
    if !broker.reaches_other_processes() {
        println!("hard kill: skipped: the broker lives in the test process, which the kill ends");
        return;
    }
    let (db, queue) = setup::<B, D>(broker, "hard-kill").await;
    let mut plan = KillPlan {
        events: EVENTS,
        // Killed once each made progress of its own, so that each kill lands mid-stream.
        kills: (1..=KILLS)
            .map(|kill| KillAt::Applied(kill * EVENTS / (KILLS + 2)))
            .collect(),
        ..KillPlan::default()
    };
    for i in 0..EVENTS {
        let event = CreditEvent::new(1 + i % ACCOUNTS, i + 1);
        *plan.expected.entry(event.account_id).or_default() += event.amount;
        queue
            .send(Some(MessageId::generate().as_str()), &event.to_json())
            .await;
    }
    let (db_ref, queue_ref) = (&db, &queue);
    let handler = db.credit().work(WORK);
    let mut harness = KillHarness {
        spawn: Box::new(move |k| {
            let envs = [
                ("INBOX_DATABASE", db_ref.name().to_owned()),
                ("INBOX_QUEUE", queue_ref.name()),
                ("INBOX_MEMBER", format!("killed-{}", k + 1)),
            ];
            let command = child::command(CHILD_TEST, &envs);
            Box::pin(async move { Ok(tokio::process::Command::from(command).spawn()?) })
        }),
        summary: Box::new(move || Box::pin(async move { Ok(db_ref.summary().await?) })),
        balances: Box::new(move || Box::pin(async move { Ok(db_ref.balances().await?) })),
        waiting: Box::new(move || Box::pin(async move { Ok(queue_ref.waiting().await) })),
        consume: Box::new(move |shutdown| {
            let handler = handler.clone();
            Box::pin(async move {
                let source = crate::scenarios::source(queue_ref, "survivor").await;
                Ok(Consumer::new("wallet", source, db_ref.inbox(), handler)
                    .batch_size(5)
                    .run_until(shutdown)
                    .await?)
            })
        }),
        redelivery_delay: queue.redelivery_delay(),
        drain_restarts: DRAIN_RESTARTS,
        tick: Box::new(|_| {}),
    };
    let r = run(&mut harness, &plan).await.expect("the kill run");
    drop(harness);
    let left = left(&queue).await;
    println!("hard kill: {EVENTS} events: {r:?}; left {left}");
    assert_eq!(i64::from(r.kills), KILLS);
    assert_eq!(r.self_crashes, 0, "a consumer process exited by itself");
    assert_eq!((r.duplicates, r.lost), (0, 0), "every event applied once");
    assert!(r.balances_exact);
    assert_eq!(left, 0);
    crate::scenarios::finish(db, queue).await;
}

/// The consumer process of the kill scenario: runs until it is killed, and only in a process
/// the scenario started (elsewhere it returns at once).
pub async fn consumer_process<B: TestBroker, D: TestStore>(broker: &B) {
    if !child::is_child() {
        return;
    }
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let db = D::attach(&var("INBOX_DATABASE")).await;
    let queue = broker.attach(&var("INBOX_QUEUE")).await;
    let handler = db.credit().work(WORK);
    let member = var("INBOX_MEMBER");
    Consumer::new(
        "wallet",
        crate::scenarios::source(&queue, &member).await,
        db.inbox(),
        handler,
    )
    .batch_size(5)
    .run()
    .await
    .expect("consumer");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event is in the ledger, yet the broker goes on reporting messages waiting (a group
    /// member left without partitions, say): the drain must end, not wait for good.
    #[tokio::test(start_paused = true)]
    async fn a_drain_ends_when_every_event_is_applied_though_the_broker_still_reports_messages() {
        for drain_restarts in [0, 5] {
            let h = KillHarness {
                spawn: Box::new(|_| Box::pin(async { Err("no process in this test".into()) })),
                summary: Box::new(|| {
                    Box::pin(async {
                        Ok(Summary {
                            ledger_rows: 10,
                            distinct_events: 10,
                            balances_exact: true,
                            total_balance: 100,
                        })
                    })
                }),
                balances: Box::new(|| Box::pin(async { Ok(Vec::new()) })),
                waiting: Box::new(|| Box::pin(async { Ok(3) })),
                consume: Box::new(|stop| {
                    Box::pin(async move {
                        stop.await;
                        Ok(StatsSnapshot::default())
                    })
                }),
                redelivery_delay: Duration::from_secs(5),
                drain_restarts,
                tick: Box::new(|_| {}),
            };
            let drained = tokio::time::timeout(Duration::from_secs(3600), drain(&h, 10)).await;
            assert!(
                drained.is_ok(),
                "with {drain_restarts} restarts the drain still ran after an hour"
            );
        }
    }
}
