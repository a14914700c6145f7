//! The consumer's broker connection goes through a [`FaultProxy`] that black-holes or cuts it
//! mid-stream: the consumer notices by itself, reconnects, and every credit lands in the ledger
//! exactly once.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::stream::{broker_addr, url_via, Stream};
use common::*;
use inbox_rabbitmq::{RabbitSource, RabbitSourceBuilder};
use inbox_testkit::{FaultProxy, ProxyMode};
use tokio::time::Instant;

const EVENTS: i64 = 300;
/// The AMQP heartbeat of the proxied connection: a silent peer is declared dead after two
/// intervals without a frame.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// Bounds every test, so a hang fails instead of blocking the run.
const TEST_LIMIT: Duration = Duration::from_secs(150);

/// The test's own config (straight to the broker) and the consumer's (through `proxy`).
fn configs(label: &str, proxy: &FaultProxy) -> (RabbitSourceBuilder, RabbitSourceBuilder) {
    let direct = fresh_config(label).prefetch(20);
    let consumer = RabbitSource::builder(direct.queue())
        .url(url_via(direct.broker_url(), proxy.addr()))
        .prefetch(20)
        .poll_timeout(Duration::from_millis(500))
        .heartbeat(HEARTBEAT)
        // A reconnect that lands in the hole gives up after this and tries again.
        .operation_timeout(Duration::from_secs(5))
        .connection_name(direct.effective_connection_name());
    (direct, consumer)
}

#[tokio::test]
async fn a_black_holed_connection_is_detected_by_the_heartbeat_and_replaced() {
    tokio::time::timeout(TEST_LIMIT, black_hole()).await.expect(
        "the black-hole test finished in time (a hang in the consumer or its reconnect fails here)",
    );
}

async fn black_hole() {
    let proxy = FaultProxy::start(broker_addr().await).await.unwrap();
    let (direct, consumer) = configs("blackhole", &proxy);
    let stream = Stream::start(direct, consumer, EVENTS).await;
    stream
        .wait_applied(EVENTS / 5, Duration::from_secs(30))
        .await;

    let before = stream.stats();
    let at_hole = stream.applied().await;
    proxy.set_mode(ProxyMode::Blackhole);
    // Held well past the point the consumer gives up on the connection, so its first reconnect
    // attempts land in the hole too.
    let hole = HEARTBEAT * 5;
    let holed_at = Instant::now();
    // Without the heartbeat setting the broker's 60 s applies, and this wait fails.
    let detected = stream
        .wait_stats("the consumer notices the dead connection", hole, |s| {
            s.errors + s.ack_failures > before.errors + before.ack_failures
        })
        .await;
    println!(
        "black hole: {at_hole} events applied when the connection went silent; the consumer \
         noticed after {detected:?} (heartbeat {HEARTBEAT:?})"
    );
    tokio::time::sleep(hole.saturating_sub(holed_at.elapsed())).await;
    let during = stream.applied().await;
    proxy.set_mode(ProxyMode::Pass);
    let resumed = stream
        .wait_applied(during + 1, Duration::from_secs(60))
        .await;
    println!(
        "black hole: lifted after {hole:?} ({during} applied); consuming again {resumed:?} later"
    );

    let outcome = stream.finish(Duration::from_secs(90)).await;
    println!(
        "black hole: {} events, {} duplicates, {} lost, balances exact {}, detection {detected:?}, \
         recovery {resumed:?}; {:?}",
        outcome.events,
        outcome.duplicates(),
        outcome.lost(),
        outcome.summary.balances_exact,
        outcome.stats
    );
    outcome.assert_exactly_once();
}

#[tokio::test]
async fn connections_cut_every_300_ms_lose_and_duplicate_nothing() {
    tokio::time::timeout(TEST_LIMIT, cuts()).await.expect(
        "the cut test finished in time (a hang in the consumer or its reconnect fails here)",
    );
}

async fn cuts() {
    let proxy = FaultProxy::start(broker_addr().await).await.unwrap();
    let (direct, consumer) = configs("cuts", &proxy);
    let stream = Stream::start(direct, consumer, EVENTS).await;
    stream
        .wait_applied(EVENTS / 10, Duration::from_secs(30))
        .await;

    let at_first = stream.applied().await;
    let mut cuts = 0;
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        proxy.cut();
        cuts += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let at_last = stream.applied().await;
    let resumed = stream
        .wait_applied(at_last + 1, Duration::from_secs(60))
        .await;
    println!(
        "cuts: {cuts} cuts while {at_first}..{at_last} events were applied; consuming again \
         {resumed:?} after the last"
    );

    let outcome = stream.finish(Duration::from_secs(90)).await;
    println!(
        "cuts: {} events, {} duplicates, {} lost, balances exact {}, {cuts} cuts, recovery after \
         the last {resumed:?}; {:?}",
        outcome.events,
        outcome.duplicates(),
        outcome.lost(),
        outcome.summary.balances_exact,
        outcome.stats
    );
    outcome.assert_exactly_once();
    assert!(
        outcome.stats.errors + outcome.stats.ack_failures > 0,
        "the cuts reached the consumer"
    );
}
