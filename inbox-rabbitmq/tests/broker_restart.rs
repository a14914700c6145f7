//! The broker application is stopped and started again mid-stream (`rabbitmqctl stop_app`,
//! `start_app`): the quorum queue survives, the consumer reconnects by itself, and every credit
//! lands in the ledger exactly once.
//!
//! A binary of its own: the restart takes the whole broker away for a few seconds, and cargo runs
//! test binaries one after another.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::stream::Stream;
use common::*;
use tokio::time::Instant;

const EVENTS: i64 = 300;
/// How long the broker application stays down.
const DOWN: Duration = Duration::from_secs(3);
/// Bounds the test, so a hang fails instead of blocking the run.
const TEST_LIMIT: Duration = Duration::from_secs(180);

async fn rabbitmqctl(command: &str) -> Duration {
    let start = Instant::now();
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("rabbitmqctl")
            .arg(command)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("rabbitmqctl {command} returns within 60 s"))
    .unwrap_or_else(|e| panic!("run rabbitmqctl {command}: {e}"));
    assert!(
        output.status.success(),
        "rabbitmqctl {command} failed: {output:?}"
    );
    start.elapsed()
}

/// Starts the broker application again when dropped, so a failing test does not leave the broker
/// down for every test after it.
struct StartAppOnDrop {
    armed: bool,
}

impl StartAppOnDrop {
    async fn stop_app() -> (Self, Duration) {
        // Armed before the stop: a stop that fails half-way is undone too.
        let guard = Self { armed: true };
        let took = rabbitmqctl("stop_app").await;
        (guard, took)
    }

    async fn start_app(mut self) -> Duration {
        let took = rabbitmqctl("start_app").await;
        self.armed = false;
        took
    }
}

impl Drop for StartAppOnDrop {
    fn drop(&mut self) {
        if self.armed {
            // Blocking is fine here: the test is failing, and the broker must come back whatever
            // state the runtime is in.
            let status = std::process::Command::new("rabbitmqctl")
                .arg("start_app")
                .status();
            eprintln!("broker restart test: start_app after a failure: {status:?}");
        }
    }
}

#[tokio::test]
async fn a_broker_restart_mid_stream_loses_and_duplicates_nothing() {
    tokio::time::timeout(TEST_LIMIT, broker_restart())
        .await
        .expect("the broker restart test finished in time (a hang in the consumer or its reconnect fails here)");
}

async fn broker_restart() {
    let direct = fresh_config("restart").prefetch(20);
    let consumer = direct
        .clone()
        .heartbeat(Duration::from_secs(5))
        .operation_timeout(Duration::from_secs(5));
    let stream = Stream::start(direct, consumer, EVENTS).await;
    stream
        .wait_applied(EVENTS / 5, Duration::from_secs(30))
        .await;

    let before = stream.stats();
    let at_stop = stream.applied().await;
    let (broker, stopping) = StartAppOnDrop::stop_app().await;
    let at_stopped = stream.applied().await;
    let noticed = stream
        .wait_stats("the consumer notices the broker going away", DOWN, |s| {
            s.errors + s.ack_failures > before.errors + before.ack_failures
        })
        .await;
    tokio::time::sleep(DOWN).await;
    let during = stream.applied().await;
    let starting = broker.start_app().await;
    let resumed = stream
        .wait_applied(during + 1, Duration::from_secs(90))
        .await;
    println!(
        "broker restart: stop_app called at {at_stop} applied, returned after {stopping:?} at \
         {at_stopped}; consumer noticed {noticed:?} after it returned; down {DOWN:?} more; \
         start_app took {starting:?}; consuming again {resumed:?} after it returned \
         ({during} applied before)"
    );

    let outcome = stream.finish(Duration::from_secs(90)).await;
    println!(
        "broker restart: {} events, {} duplicates, {} lost, balances exact {}, recovery after \
         start_app {resumed:?}; {:?}",
        outcome.events,
        outcome.duplicates(),
        outcome.lost(),
        outcome.summary.balances_exact,
        outcome.stats
    );
    outcome.assert_exactly_once();
}
