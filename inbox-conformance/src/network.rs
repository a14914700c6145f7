//! The network between the consumer and the broker fails while it consumes: its connections are
//! black-holed, cut again and again, or refused, through a [`FaultProxy`]
//! ([`TestQueue::proxied_source`]). Credits are sent at a steady pace straight to the broker
//! meanwhile; each fault must end, once the network is back, with every credit in the ledger
//! exactly once, nothing left on the broker and nothing dead-lettered, without restarting the
//! consumer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::wallet::{self, Credit, CreditEvent};
use crate::TestDb;
use crate::{wait_for_a_third, FaultProxy, FaultRun, ProxyMode, Restored};
use inbox_core::{Consumer, MessageId, StatsSnapshot};

use crate::checked::Checked;
use crate::scenarios::{finish, left, setup};
use crate::{Proxied, TestBroker, TestQueue};
use inbox_testkit::eventually;

const EVENTS: i64 = 300;
const ACCOUNTS: i64 = 7;
/// One credit every this long: 300 take about 4.5 s, so the consumer keeps up and waits on the
/// broker much of the time, and the fault meets receives and acks alike.
const PACE: Duration = Duration::from_millis(15);

/// What the broker had left at the end.
#[derive(Debug)]
struct Left {
    /// Messages still on the broker.
    left: u64,
    /// Messages dead-lettered.
    dead_letters: usize,
}

type Run = FaultRun<Left>;

/// Every credit applied once, adding up to `total`, nothing left on the broker and nothing
/// dead-lettered.
fn assert_exactly_once(run: &Run, total: i64) {
    run.assert_exactly_once(EVENTS, total);
    assert_eq!(run.broker.left, 0, "left on the broker: {run:?}");
    assert_eq!(
        run.broker.dead_letters, 0,
        "healthy messages dead-lettered: {run:?}"
    );
}

/// A fault between the consumer and the broker.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Connections stay open and carry nothing, for the adapter's [`Proxied::blackhole`].
    Blackhole,
    /// Every open connection is cut, 15 times, 300 ms apart.
    Cuts,
    /// New connections are closed at once and open ones cut, for 5 s: a broker that went away.
    Refused,
}

impl Fault {
    /// Applies the fault; returns when the network is back.
    async fn run(self, proxy: &FaultProxy, blackhole: Duration) {
        match self {
            Fault::Blackhole => {
                proxy.set_mode(ProxyMode::Blackhole);
                tokio::time::sleep(blackhole).await;
                proxy.set_mode(ProxyMode::Pass);
            }
            Fault::Cuts => {
                for _ in 0..15 {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    proxy.cut();
                }
            }
            Fault::Refused => {
                proxy.set_mode(ProxyMode::Refuse);
                tokio::time::sleep(Duration::from_secs(5)).await;
                proxy.set_mode(ProxyMode::Pass);
            }
        }
    }
}

/// Sends the credits at [`PACE`], straight to the broker; returns the sum of the amounts.
async fn publish<Q: TestQueue>(queue: &Q) -> i64 {
    let mut total = 0;
    for n in 0..EVENTS {
        let event = CreditEvent::new(1 + n % ACCOUNTS, n + 1);
        total += event.amount;
        queue
            .send(Some(MessageId::generate().as_str()), &event.to_json())
            .await;
        tokio::time::sleep(PACE).await;
    }
    total
}

/// Consumes the credits through the proxy while they are sent, runs `fault` once a third is
/// applied, and waits for the consumer to finish by itself once the fault is over; returns the
/// run and the sum of the credits sent. `None` where the adapter has no proxied source.
async fn consume_through<Q: TestQueue>(
    name: &str,
    db: &TestDb,
    queue: &Q,
    fault: Fault,
) -> Option<(Run, i64)> {
    let Some(Proxied {
        source,
        proxy,
        blackhole,
    }) = queue.proxied_source("c1").await
    else {
        println!(
            "{name}: skipped: no proxy can stand between this broker and its consumer (the \
             adapter's own tests cover its network faults)"
        );
        return None;
    };
    let consumer = Consumer::new(
        "wallet",
        Checked::new(source),
        db.inbox(),
        Credit::new(db.pool.clone()).work(Duration::from_millis(2)),
    )
    .batch_size(10)
    .error_backoff(Duration::from_millis(200));
    let stats = consumer.stats();
    let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
    let running = consumer.run_until(async {
        let _ = stopping.await;
    });
    let over = AtomicBool::new(false);

    let observing = async {
        let applied_at_fault = wait_for_a_third(&db.pool, EVENTS, Duration::from_secs(30)).await;
        let seen = |s: StatsSnapshot| s.errors + s.ack_failures;
        let before = seen(stats.snapshot());
        let fault_started = Instant::now();
        let watching = async {
            while !over.load(Ordering::Relaxed) {
                if seen(stats.snapshot()) > before {
                    return Some(fault_started.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            None
        };
        let faulting = async {
            fault.run(&proxy, blackhole).await;
            let Restored {
                at: restored,
                applied: applied_at_restore,
                progressed,
                first_progress,
            } = Restored::measure(&db.pool, EVENTS, Duration::from_secs(60)).await;
            let finished = progressed
                && eventually(Duration::from_secs(90), || async {
                    wallet::applied(&db.pool).await >= EVENTS
                })
                .await;
            over.store(true, Ordering::Relaxed);
            (restored, applied_at_restore, first_progress, finished)
        };
        let (detected, (restored, applied_at_restore, first_progress, finished)) =
            tokio::join!(watching, faulting);
        let _ = stop.send(());
        (
            applied_at_fault,
            applied_at_restore,
            detected,
            restored - fault_started,
            first_progress,
            restored.elapsed(),
            finished,
        )
    };
    let stopped = async { tokio::time::timeout(Duration::from_secs(150), running).await };
    let (stopped, total, observed) = tokio::join!(stopped, publish(queue), observing);
    let (
        applied_at_fault,
        applied_at_restore,
        detected,
        fault_lasted,
        first_progress,
        all_done,
        finished,
    ) = observed;
    let stats = stopped
        .unwrap_or_else(|_| panic!("{name}: the consumer was still running 150 s after its start"))
        .unwrap_or_else(|e| panic!("{name}: the consumer stopped with an error: {e}"));
    let broker = Left {
        left: left(queue).await,
        dead_letters: queue.dead_letters().await.len(),
    };
    let run = Run {
        ledger: wallet::summary(&db.pool).await.expect("summary"),
        stats,
        applied_at_fault,
        applied_at_restore,
        detected,
        fault_lasted,
        first_progress,
        all_done,
        broker,
    };
    run.report(name, EVENTS);
    assert!(
        finished,
        "{name}: not finished within 90 s of the network's return: {run:?}"
    );
    Some((run, total))
}

/// The consumer's connections carry nothing for a while (longer than the source waits on a
/// silent connection): it notices, gives them up and reconnects once the network is back.
pub async fn a_black_holed_connection_is_given_up_and_replaced<B: TestBroker>(broker: &B) {
    let (db, queue) = setup(broker, "blackhole").await;
    if let Some((run, total)) = consume_through("black hole", &db, &queue, Fault::Blackhole).await {
        assert_exactly_once(&run, total);
        // Noticed by the source's own timeout or heartbeat, not only once the network is back.
        assert!(
            run.detected.is_some_and(|after| after < run.fault_lasted),
            "the black hole went unnoticed while it lasted: {run:?}"
        );
    }
    finish(db, queue).await;
}

/// The consumer's connections are cut every 300 ms, 15 times: each cut loses nothing and
/// applies nothing twice.
pub async fn connections_cut_again_and_again_lose_and_repeat_nothing<B: TestBroker>(broker: &B) {
    let (db, queue) = setup(broker, "cuts").await;
    if let Some((run, total)) = consume_through("cuts", &db, &queue, Fault::Cuts).await {
        assert_exactly_once(&run, total);
    }
    finish(db, queue).await;
}

/// The broker refuses the consumer's connections for 5 s: it fails, backs off and carries on
/// once the broker is back, with nothing dead-lettered for the outage.
pub async fn a_refused_broker_is_retried_until_it_is_back<B: TestBroker>(broker: &B) {
    let (db, queue) = setup(broker, "refused").await;
    if let Some((run, total)) = consume_through("refused", &db, &queue, Fault::Refused).await {
        assert_exactly_once(&run, total);
        assert!(
            run.stats.errors + run.stats.ack_failures > 0,
            "the refusal was not felt: {run:?}"
        );
    }
    finish(db, queue).await;
}
