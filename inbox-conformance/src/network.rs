//! The network between the consumer and the broker fails while it consumes: its connections are
//! black-holed, cut again and again, or refused, through a [`FaultProxy`]
//! ([`TestQueue::proxied_source`]); or the broker itself restarts ([`TestQueue::restartable`]).
//! Credits are sent at a steady pace straight to the broker meanwhile (paused while it
//! restarts); each fault must end, once the broker is back, with every credit in the ledger
//! exactly once, nothing left on the broker and nothing dead-lettered, without restarting the
//! consumer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::RwLock;

use crate::wallet::{self, CreditEvent};
use crate::TestStore;
use crate::{wait_for_a_third, FaultProxy, FaultRun, ProxyMode, Restored};
use inbox_core::{Consumer, MessageId};

use crate::checked::Checked;
use crate::scenarios::{finish, left, setup};
use crate::{Proxied, TestBroker, TestQueue};
use inbox_testkit::{eventually, watch_errors};

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

/// A server a scenario may restart: what [`Restartable::server`] holds (boxed, so the method
/// returns a boxed future).
pub trait Restart: Send + Sync + std::fmt::Debug {
    /// Stops the server, which keeps what it stored, and starts it again a few seconds later;
    /// returns once it answers.
    fn restart(&mut self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// A queue on a server the scenario may restart: what [`TestQueue::restartable`] returns.
#[derive(Debug)]
pub struct Restartable<Q> {
    /// A queue like the one asked for, on that server: the scenario sends to it, consumes and
    /// inspects it, and cleans it up.
    pub queue: Q,
    /// The server; dropped, it is stopped (a private one) or started again (a shared one that a
    /// failed restart left down).
    pub server: Box<dyn Restart>,
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
        let outage = match self {
            Fault::Blackhole => (ProxyMode::Blackhole, blackhole),
            Fault::Refused => (ProxyMode::Refuse, Duration::from_secs(5)),
            Fault::Cuts => {
                for _ in 0..15 {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    proxy.cut();
                }
                return;
            }
        };
        proxy.set_mode(outage.0);
        tokio::time::sleep(outage.1).await;
        proxy.set_mode(ProxyMode::Pass);
    }
}

/// Sends the credits at [`PACE`], straight to the broker, each while `paused` is not held for
/// writing; returns the sum of the amounts.
async fn publish<Q: TestQueue>(queue: &Q, paused: &RwLock<()>) -> i64 {
    let mut total = 0;
    for n in 0..EVENTS {
        let event = CreditEvent::new(1 + n % ACCOUNTS, n + 1);
        total += event.amount;
        let sending = paused.read().await;
        queue
            .send(Some(MessageId::generate().as_str()), &event.to_json())
            .await;
        drop(sending);
        tokio::time::sleep(PACE).await;
    }
    total
}

/// Runs `fault` through the proxy of `queue`'s proxied source (on its twin, where it has one);
/// returns the run, the sum of the credits sent and whether the consumer counts faults as
/// errors. `None` where the adapter has no proxied source.
async fn through_proxy<Q: TestQueue, D: TestStore>(
    name: &str,
    db: &D,
    queue: &Q,
    fault: Fault,
) -> Option<(Run, i64, bool)> {
    let twin = queue.proxied_twin().await;
    let queue = twin.as_ref().unwrap_or(queue);
    let Some(Proxied {
        source,
        proxy,
        blackhole,
        counts_faults,
    }) = queue.proxied_source("c1").await
    else {
        println!(
            "{name}: skipped: no proxy can stand between this broker and its consumer (the \
             adapter's own tests cover its network faults)"
        );
        return None;
    };
    let no_pause = RwLock::new(());
    let fault = fault.run(&proxy, blackhole);
    let (run, total) = consume_through(name, db, queue, source, fault, &no_pause).await;
    if let Some(twin) = &twin {
        twin.cleanup().await;
    }
    Some((run, total, counts_faults))
}

/// Consumes the credits with `source` while they are sent, runs `fault` once a third is
/// applied, and waits for the consumer to finish by itself once the fault is over; returns the
/// run and the sum of the credits sent.
async fn consume_through<Q: TestQueue, D: TestStore>(
    name: &str,
    db: &D,
    queue: &Q,
    source: Q::Source,
    fault: impl std::future::Future<Output = ()>,
    paused: &RwLock<()>,
) -> (Run, i64) {
    let consumer = Consumer::new(
        "wallet",
        Checked::new(source),
        db.inbox(),
        db.credit().work(Duration::from_millis(2)),
    )
    .batch_size(10)
    .error_backoff(Duration::from_millis(200));
    let stats = consumer.stats();
    let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
    let running = consumer.run_until(async {
        let _ = stopping.await;
    });

    let observing = async {
        let applied_at_fault = wait_for_a_third(db, EVENTS, Duration::from_secs(30)).await;
        let (fault_started, detecting) = watch_errors(Arc::clone(&stats));
        fault.await;
        let restored = Restored::measure(db, EVENTS, Duration::from_secs(60)).await;
        let finished = restored.progressed
            && eventually(Duration::from_secs(90), || async {
                wallet::applied(db).await >= EVENTS
            })
            .await;
        detecting.abort();
        let detected = detecting.await.ok().flatten();
        let _ = stop.send(());
        let fault_lasted = restored.at - fault_started;
        (applied_at_fault, restored, detected, fault_lasted, finished)
    };
    let stopped = async { tokio::time::timeout(Duration::from_secs(150), running).await };
    let (stopped, total, observed) = tokio::join!(stopped, publish(queue, paused), observing);
    let (applied_at_fault, restored, detected, fault_lasted, finished) = observed;
    let all_done = restored.at.elapsed();
    let stats = stopped
        .unwrap_or_else(|_| panic!("{name}: the consumer was still running 150 s after its start"))
        .unwrap_or_else(|e| panic!("{name}: the consumer stopped with an error: {e}"));
    let broker = Left {
        left: left(queue).await,
        dead_letters: queue.dead_letters().await.len(),
    };
    let run = Run {
        ledger: wallet::summary(db).await.expect("summary"),
        stats,
        applied_at_fault,
        applied_at_restore: restored.applied,
        detected,
        fault_lasted,
        first_progress: restored.first_progress,
        all_done,
        broker,
    };
    run.report(name, EVENTS);
    assert!(
        finished,
        "{name}: not finished within 90 s of the broker's return: {run:?}"
    );
    (run, total)
}

/// The consumer felt the fault: it counted an error, or (`counts_faults` false: a client that
/// rides faults out by itself and only logs them) it applied again within 30 s of the end.
fn assert_felt(run: &Run, counts_faults: bool, felt: bool, what: &str) {
    if counts_faults {
        assert!(felt, "{what}: {run:?}");
    } else {
        assert!(
            run.first_progress < Duration::from_secs(30),
            "stuck long after the network came back: {run:?}"
        );
    }
}

/// The consumer's connections carry nothing for a while (longer than the source waits on a
/// silent connection): it notices, gives them up and reconnects once the network is back.
pub async fn a_black_holed_connection_is_given_up_and_replaced<B: TestBroker, D: TestStore>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "blackhole").await;
    if let Some((run, total, counts)) =
        through_proxy("black hole", &db, &queue, Fault::Blackhole).await
    {
        assert_exactly_once(&run, total);
        // Noticed by the source's own timeout or heartbeat, not only once the network is back.
        let noticed = run.detected.is_some_and(|after| after < run.fault_lasted);
        assert_felt(
            &run,
            counts,
            noticed,
            "the black hole went unnoticed while it lasted",
        );
    }
    finish(db, queue).await;
}

/// The consumer's connections are cut every 300 ms, 15 times: each cut loses nothing and
/// applies nothing twice.
pub async fn connections_cut_again_and_again_lose_and_repeat_nothing<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "cuts").await;
    if let Some((run, total, _)) = through_proxy("cuts", &db, &queue, Fault::Cuts).await {
        assert_exactly_once(&run, total);
    }
    finish(db, queue).await;
}

/// The broker refuses the consumer's connections for 5 s: it fails, backs off and carries on
/// once the broker is back, with nothing dead-lettered for the outage.
pub async fn a_refused_broker_is_retried_until_it_is_back<B: TestBroker, D: TestStore>(broker: &B) {
    let (db, queue) = setup::<B, D>(broker, "refused").await;
    if let Some((run, total, counts)) = through_proxy("refused", &db, &queue, Fault::Refused).await
    {
        assert_exactly_once(&run, total);
        let felt = run.stats.errors + run.stats.ack_failures > 0;
        assert_felt(&run, counts, felt, "the refusal was not felt");
    }
    finish(db, queue).await;
}

/// The broker itself stops and starts again mid-stream, keeping what it stored: the consumer
/// notices, reconnects by itself and carries on. Sending pauses while it is down.
pub async fn a_broker_restarted_mid_stream_loses_and_repeats_nothing<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "restart").await;
    match queue.restartable().await {
        Err(why) => println!("broker restart: skipped: {why}"),
        Ok(Restartable {
            queue: on_server,
            mut server,
        }) => {
            let paused = RwLock::new(());
            let fault = async {
                let _paused = paused.write().await;
                server.restart().await;
            };
            let source = on_server.source("c1").await;
            let (run, total) =
                consume_through("broker restart", &db, &on_server, source, fault, &paused).await;
            assert_exactly_once(&run, total);
            assert!(
                run.detected.is_some(),
                "the restart went unnoticed: {run:?}"
            );
            on_server.cleanup().await;
        }
    }
    finish(db, queue).await;
}
