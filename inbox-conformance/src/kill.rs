//! The article's headline scenario: the consumer process is SIGKILLed mid-stream, again and
//! again, and restarted. SIGKILL runs no destructor: no close, no last ack, no last commit. Each
//! restart is a new group member (a new consumer name), so what a dead one held comes back the
//! way the broker gives a dead member's messages to another: a rebalance, a requeue, a
//! visibility timeout, `XAUTOCLAIM`.

use std::time::{Duration, Instant};

use crate::wallet::{self, CreditEvent};
use crate::{child, TestStore};
use inbox_core::{Consumer, MessageId};

use crate::scenarios::{drain, ledger_has, left, setup, Totals};
use crate::{TestBroker, TestQueue};

const EVENTS: i64 = 300;
const KILLS: i64 = 4;
const ACCOUNTS: i64 = 7;
/// Each message's handler sleeps this long, so that kills land mid-stream.
const WORK: Duration = Duration::from_millis(5);
/// The name [`crate::suite!`] gives the child's test.
const CHILD_TEST: &str = "conformance_child";

/// Starts the consumer as a child process (the test binary again, running only
/// [`consumer_process`]), kills it with SIGKILL once it applied a share of the events, and
/// again; then a last consumer drains what is left. Every event ends up in the ledger exactly
/// once.
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
    let mut expected_total = 0;
    for i in 0..EVENTS {
        expected_total += i + 1;
        let event = CreditEvent::new(1 + i % ACCOUNTS, i + 1);
        queue
            .send(Some(MessageId::generate().as_str()), &event.to_json())
            .await;
    }

    let deadline = Instant::now() + Duration::from_secs(120);
    for kill in 1..=KILLS {
        let mut process = child::spawn(
            CHILD_TEST,
            &[
                ("INBOX_DATABASE", db.name().to_owned()),
                ("INBOX_QUEUE", queue.name()),
                ("INBOX_MEMBER", format!("killed-{kill}")),
            ],
        );
        // Killed once it made progress of its own, so that each kill lands mid-stream.
        let target = kill * EVENTS / (KILLS + 2);
        loop {
            let done = wallet::summary(db.ledger())
                .await
                .expect("summary")
                .distinct_events;
            if done >= target {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no progress: {done} of {target} applied"
            );
            if let Ok(Some(status)) = process.try_wait() {
                panic!("the consumer process exited by itself: {status}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A random extra moment, so that kills also land between a commit and its ack.
        let jitter = u64::from(MessageId::generate().as_str().as_bytes()[35] % 40);
        tokio::time::sleep(Duration::from_millis(jitter)).await;
        process.kill().expect("SIGKILL");
        process.wait().expect("reap");
        let summary = wallet::summary(db.ledger()).await.expect("summary");
        println!(
            "kill {kill}: {} of {EVENTS} events applied, {} ledger rows",
            summary.distinct_events, summary.ledger_rows
        );
    }

    // The last restart, in this process.
    let handler = db.credit().work(WORK);
    let mut totals = Totals::default();
    drain(
        &queue,
        "survivor",
        &mut totals,
        |source| {
            Consumer::new("wallet", source, db.inbox(), handler.clone())
                .batch_size(5)
                .run_until_idle()
        },
        // Done once every event is applied and the broker holds nothing: the copies a killed
        // consumer committed but never acked come back only after the broker's own delay (a
        // claim interval, a visibility timeout), and must be skipped and acked too.
        |_| async { ledger_has(&db, EVENTS).await && queue.waiting().await == 0 },
    )
    .await;
    let summary = wallet::summary(db.ledger()).await.expect("summary");
    let left = left(&queue).await;
    println!(
        "hard kill: {EVENTS} events, {KILLS} kills; the last consumer: {totals:?}; {summary:?}; \
         expected total {expected_total}; left {left}"
    );
    assert_eq!(summary.distinct_events, EVENTS, "every event applied");
    assert_eq!(summary.ledger_rows, EVENTS, "none twice");
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, expected_total);
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
