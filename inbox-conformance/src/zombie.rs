//! Ownership loss: a consumer's handler stalls on a message long enough for the broker to hand
//! the message to another member; the stalled consumer (the "zombie") then resumes, commits and
//! acks. With the inbox the side effect is applied once and nothing is lost.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::wallet::{self, CreditEvent, Ledger};
use crate::TestStore;
use inbox_core::{Capabilities, Consumer, Delivery, MessageId, MessageSource, SourceError};

use crate::checked::Checked;
use crate::scenarios::{drain, finish, ledger_has, left, setup, Totals};
use crate::{LosingSource, TestBroker, TestQueue};

/// Messages sent after the stalling one, which the second member applies meanwhile.
const OTHERS: i64 = 5;

/// A source that notes the ID of every message it delivers.
struct Noting<S> {
    inner: S,
    seen: Arc<Mutex<HashSet<MessageId>>>,
}

impl<S: MessageSource> MessageSource for Noting<S> {
    type Ack = S::Ack;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<S::Ack>>, SourceError> {
        let batch = self.inner.receive(max).await?;
        let mut seen = self.seen.lock().expect("seen IDs");
        seen.extend(batch.iter().filter_map(|d| d.message.id.clone().ok()));
        Ok(batch)
    }

    fn system(&self) -> &'static str {
        self.inner.system()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// Member `zombie` takes a message whose first handling stalls ([`Credit::stall`](crate::wallet::Credit::stall)) and sits in
/// its handler, its transaction open, while the broker takes the message away from it
/// ([`TestQueue::losing_source`], [`TestQueue::take_away`]) and member `b` receives it and the
/// messages after it. `b`'s claim of the stalled message waits on the zombie's open claim (the
/// inbox row's primary key); the zombie then commits and acks (or fails to ack: its hold is
/// gone), and `b` skips its copy. The stalled credit is in the ledger
/// once, every other message too, and nothing is left on the broker.
pub async fn a_consumer_that_lost_its_message_mid_handler_applies_nothing_twice<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "zombie").await;
    let Some(LosingSource { source, stall }) = queue.losing_source("zombie").await else {
        println!(
            "zombie: skipped: this broker cannot take a message away from a stalled consumer \
             reliably"
        );
        finish(db, queue).await;
        return;
    };
    let stalled = MessageId::generate();
    let event = CreditEvent {
        stall: true,
        ..CreditEvent::new(1, 1000)
    };
    queue.send(Some(stalled.as_str()), &event.to_json()).await;
    for i in 0..OTHERS {
        let id = MessageId::generate();
        queue
            .send(Some(id.as_str()), &CreditEvent::new(2, i + 1).to_json())
            .await;
    }

    let handler = db.credit().stall(stall);
    let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
    let zombie = Consumer::new("wallet", Checked::new(source), db.inbox(), handler.clone())
        .batch_size(1)
        .run_until(async {
            let _ = stopping.await;
        });
    let mut totals = Totals::default();
    // What the second member received.
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let start = Instant::now();
    let (mut taken_away, mut handed_over) = (Duration::ZERO, Duration::ZERO);
    let others = async {
        while db.ledger().stalls().await.expect("wallet_stalls") == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the zombie never started the stalled message"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        queue.take_away("zombie").await;
        taken_away = start.elapsed();
        // The second member: it gets the stalled message once the zombie lost it.
        drain(
            &queue,
            "b",
            &mut totals,
            |source| {
                let source = Noting {
                    inner: source,
                    seen: Arc::clone(&seen),
                };
                Consumer::new("wallet", source, db.inbox(), handler.clone()).run_until_idle()
            },
            |_| {
                let (db, seen, stalled) = (&db, &seen, &stalled);
                async move {
                    seen.lock().expect("seen IDs").contains(stalled)
                        && ledger_has(db, OTHERS + 1).await
                }
            },
        )
        .await;
        handed_over = start.elapsed();
        let _ = stop.send(());
    };
    // The zombie's own end (its connection closed under it, its ack refused) is the broker's
    // business: what counts is the ledger and what is left.
    let (zombie, ()) = tokio::join!(zombie, others);

    let summary = wallet::summary(db.ledger()).await.expect("summary");
    let stalled_rows = db.ledger().rows_of(&stalled).await.expect("ledger");
    let left = left(&queue).await;
    println!(
        "zombie: stalled {stall:?}, taken away at {taken_away:?}, handed over and drained by \
         {handed_over:?}; b: {totals:?}; the zombie: {zombie:?}; {summary:?}; left {left}"
    );
    assert_eq!(stalled_rows, 1, "the stalled credit applied once");
    assert!(
        seen.lock().expect("seen IDs").contains(&stalled),
        "the broker handed the stalled message to the second member"
    );
    assert!(totals.skipped >= 1, "and the second member skipped it");
    assert_eq!(
        (summary.ledger_rows, summary.distinct_events),
        (OTHERS + 1, OTHERS + 1)
    );
    assert!(summary.balances_exact);
    assert_eq!(wallet::balance(db.ledger(), 1).await, 1000);
    assert_eq!(left, 0);
    finish(db, queue).await;
}
