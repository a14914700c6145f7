//! What the effect consumer writes to the log about a message whose ID holds a newline: the ID
//! is escaped on every path (applied, fenced, busy, skipped, dead-lettered), so a producer
//! cannot forge log lines through it.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use inbox_core::effect::{Acquired, Attempt, Effect, EffectHandler, Lease, OnUnknown};
use inbox_core::{Consumer, HandlerError, Message};
use inbox_testkit::log::CapturedLog;
use inbox_testkit::{MemoryBroker, ScriptedLeases};

/// The ID's second half: a line of its own in the log if the newline before it is written raw.
const FORGED: &str = "FORGED  WARN inbox: all payments refunded";

/// Every call succeeds; an unknown outcome is marked done without a call.
struct Call;

impl EffectHandler<()> for Call {
    fn on_unknown(&self) -> OnUnknown {
        OnUnknown::Skip
    }
    async fn call(&self, _: &Effect, _: &Message) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn leased(token: u64, attempt: Attempt, attempts: u32) -> Acquired {
    Acquired::Leased(Lease {
        token,
        attempt,
        attempts,
        since_first: Duration::ZERO,
    })
}

// One thread: the subscriber is the thread's default while the consumer runs.
#[tokio::test(flavor = "current_thread")]
async fn the_effect_consumer_escapes_a_newline_in_a_message_id() {
    let log = CapturedLog::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);

    let id = format!("evt-1\n{FORGED}");
    let broker = MemoryBroker::new();
    for _ in 0..4 {
        broker.publish(Some(&id), "{}");
    }
    let leases = ScriptedLeases::default();
    leases.then_acquire([
        leased(1, Attempt::First, 1), // called, then fenced out: handed back
        Acquired::Busy {
            retry_after: Duration::from_millis(1),
        }, // handed back
        leased(2, Attempt::First, 2), // called and done
        Acquired::Done,               // skipped
        leased(3, Attempt::AfterExpiry, 3), // unknown outcome, marked done without a call
        leased(4, Attempt::AfterNotApplied, 9), // over the budget: dead-lettered
    ]);
    leases.then_complete([false]);

    let consumer = Consumer::effects("mailer", broker.source(), leases, Call)
        .error_backoff(Duration::from_millis(1));
    let drained = {
        let broker = broker.clone();
        async move {
            while broker.pending() > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let stats = tokio::time::timeout(Duration::from_secs(10), consumer.run_until(drained))
        .await
        .expect("every copy settled")
        .unwrap();
    drop(guard);

    let log = log.text();
    println!("{log}");
    println!("{stats:?}");
    assert_eq!(broker.dead_letters().len(), 1);
    for logged in [
        "a newer lease took over",
        "is leased by another attempt",
        "applied",
        "skipped duplicate",
        "marked done without a call",
        "dead-lettered",
    ] {
        assert!(log.contains(logged), "nothing logged {logged:?}");
    }
    let forged: Vec<&str> = log.lines().filter(|l| l.starts_with("FORGED")).collect();
    assert!(
        forged.is_empty(),
        "the ID's newline was written raw, forging {} log line(s): {forged:#?}",
        forged.len()
    );
    assert!(log.contains(r"evt-1\nFORGED"), "the ID is logged, escaped");
}
