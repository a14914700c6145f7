//! Crash points of the effect consumer against a real PostgreSQL and a real HTTP provider: a
//! consumer dies at each step for one message (after the lease, during the call, after the call,
//! after the done mark) and a fresh one takes over. With idempotency keys or a status lookup
//! there is no duplicate and no loss at any crash point; with neither, the handler's choice
//! shows as a duplicate (retry) or a missing effect (skip).

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common_effects;

use common_effects::*;
use inbox_conformance::provider::Behaviour;
use inbox_core::Stage;
use inbox_testkit::Crash as CrashPoint;
use inbox_testkit::MemoryBroker;

const SETUPS: [Setup; 4] = [
    Setup::Keys,
    Setup::Lookup,
    Setup::BlindRetry,
    Setup::BlindSkip,
];

// --- Crash points: a consumer dies at each step for evt-2 and a fresh one takes over. ---

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crash {
    /// The processing row (the lease) committed; the call not made yet.
    AfterLease,
    /// The provider applied the call but never answered, and the consumer died waiting.
    DuringCall,
    /// The call returned `Ok`; the done mark not committed yet.
    AfterCall,
    /// The done mark committed; the broker not acked yet.
    AfterDone,
}

/// What the provider and the database hold for the crashed message at the end.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    /// Effects applied at the provider: 1 is right, 2 a duplicate, 0 a loss.
    effects: usize,
    /// Calls the provider received.
    calls: usize,
    /// How the done mark was reached.
    settled: &'static str,
}

fn seen(effects: usize, calls: usize, settled: &'static str) -> Seen {
    Seen {
        effects,
        calls,
        settled,
    }
}

/// Runs evt-1..3 through a consumer that dies at `crash` on evt-2, then redelivers to a fresh
/// consumer until the broker is drained; checks what must hold in every setup and returns what
/// differs between them.
async fn crash_then_redeliver(setup: Setup, crash: Crash) -> Seen {
    let env = Env::new(setup.mode()).await;
    let broker = MemoryBroker::new();
    for evt in ["evt-1", "evt-2", "evt-3"] {
        broker.publish(Some(evt), format!("notify {evt}"));
    }
    let handler = setup.handler(&env.provider);
    let target = id("evt-2");
    match crash {
        Crash::DuringCall => {
            env.provider
                .next_call(&key("evt-2"), Behaviour::ApplyThenHang);
            let first = env.consumer(broker.source(), handler.clone());
            let first = tokio::spawn(first.run_until(std::future::pending()));
            assert!(
                env.provider
                    .wait_for_calls(&key("evt-2"), 1, PATIENCE)
                    .await
            );
            // evt-1's ack goes out beside evt-2's call: the crash comes once it has landed, so
            // that what is redelivered is evt-2 alone.
            let acked = inbox_testkit::eventually(PATIENCE, || async { broker.acked() >= 1 }).await;
            assert!(acked, "evt-1 was never acked");
            first.abort(); // the process dies mid-call; its connection to the broker closes
            assert!(first.await.unwrap_err().is_cancelled());
        }
        _ => {
            let stage = match crash {
                Crash::AfterLease => Stage::Claimed,
                Crash::AfterCall => Stage::Applied,
                _ => Stage::Committed,
            };
            let point = CrashPoint::at_ids(stage, [target.clone()]);
            let consumer = env.crashing_consumer(&point, broker.source(), handler.clone());
            let crashed = point.run(consumer.run_until(std::future::pending())).await;
            assert!(
                matches!(&crashed, Err(c) if c.stage == stage),
                "{crashed:?}"
            );
        }
    }
    assert_eq!(broker.pending(), 2, "evt-2 unacked, evt-3 not yet received");

    let stats = patiently(
        env.consumer(broker.source(), handler)
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();
    assert!(env.provider.wait_settled(PATIENCE).await);

    // In every setup: the others applied once, one done mark and one `sent` row per message,
    // nothing dead-lettered, nothing left on the broker.
    for other in ["evt-1", "evt-3"] {
        assert_eq!(env.provider.effects(&key(other)), 1, "{setup:?} {other}");
        assert_eq!(env.sent(other).await.len(), 1, "{setup:?} {other}");
    }
    let sent = env.sent("evt-2").await;
    assert_eq!(sent.len(), 1, "{setup:?}: one done mark, one set of writes");
    assert_eq!(env.sent_total().await, 3);
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending(), 0);
    let (token, _, done) = env.row("evt-2").await;
    assert!(done);
    assert_eq!(sent[0].0, token, "the writes committed with the done mark");
    let calls = env.provider.calls(&key("evt-2"));
    assert!(
        calls.windows(2).all(|w| w[0].token < w[1].token),
        "every new call carries a higher fencing token: {calls:?}"
    );
    if crash == Crash::AfterDone {
        assert_eq!(token, 1);
        assert_eq!(
            stats.skipped_duplicates, 1,
            "the redelivered copy finds done"
        );
    } else {
        assert_eq!(token, 2, "the second lease took over");
        assert!(
            stats.busy <= 1,
            "handed back at most once while the dead consumer's lease was live: {stats:?}"
        );
    }
    let settled = match sent[0].1.as_str() {
        "called" => "called",
        "landed" => "landed",
        "skipped" => "skipped",
        other => panic!("settled {other}"),
    };
    let seen = Seen {
        effects: env.provider.effects(&key("evt-2")),
        calls: calls.len(),
        settled,
    };
    env.db.drop().await;
    seen
}

async fn crash_table(crash: Crash, expected: [Seen; 4]) {
    for (setup, expected) in SETUPS.into_iter().zip(expected) {
        let seen = crash_then_redeliver(setup, crash).await;
        assert_eq!(seen, expected, "{setup:?} after a crash {crash:?}");
    }
}

#[tokio::test]
async fn crash_after_the_processing_row_commits() {
    // The call was never made: whoever calls after the lease ran out makes the only call. A
    // blind skip cannot know that: the effect is missing.
    crash_table(
        Crash::AfterLease,
        [
            seen(1, 1, "called"),  // keys
            seen(1, 1, "called"),  // lookup: "none", so it calls
            seen(1, 1, "called"),  // blind retry
            seen(0, 0, "skipped"), // blind skip: lost
        ],
    )
    .await;
}

#[tokio::test]
async fn crash_during_the_call() {
    // The provider applied the call but never answered.
    crash_table(
        Crash::DuringCall,
        [
            seen(1, 2, "called"), // keys: called again, the provider answered the first result
            seen(1, 1, "landed"), // lookup: "applied", not called again
            seen(2, 2, "called"), // blind retry: a duplicate
            seen(1, 1, "skipped"), // blind skip: kept, by luck of where it died
        ],
    )
    .await;
}

#[tokio::test]
async fn crash_after_the_call_returns_before_done_commits() {
    crash_table(
        Crash::AfterCall,
        [
            seen(1, 2, "called"),
            seen(1, 1, "landed"),
            seen(2, 2, "called"),
            seen(1, 1, "skipped"),
        ],
    )
    .await;
}

#[tokio::test]
async fn crash_after_done_commits_before_the_ack() {
    // Done is done: the redelivered copy is skipped and acked whatever the provider offers.
    crash_table(
        Crash::AfterDone,
        [
            seen(1, 1, "called"),
            seen(1, 1, "called"),
            seen(1, 1, "called"),
            seen(1, 1, "called"),
        ],
    )
    .await;
}
