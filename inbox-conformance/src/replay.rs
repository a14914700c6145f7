//! The dead-letter replay scenario: a batch parked while a downstream was down, the cause
//! fixed, the batch replayed with [`inbox_core::replay`] through the adapter's producer and
//! consumed again.

use std::sync::Arc;

use inbox_core::replay::{self, Selection};
use inbox_core::{Consumer, HandlerError, Message, MessageId, Recovery};
use inbox_testkit::fast_retry;

use crate::outbox::FailsFirst;
use crate::scenarios::{drain, finish, left, setup, Guarded, Totals};
use crate::wallet::{self, CreditEvent};
use crate::{TestBroker, TestQueue, TestStore};

/// What the handler fails with while the downstream is down: the dead letters' reason.
const DOWN: &str = "downstream down";

/// Ten credits are dead-lettered while the downstream is down; the listing counts them under
/// one reason, and a dry run moves nothing. The downstream is fixed; a first replay stops after
/// one message reached the source (applied by the consumer, but still parked), a second replays
/// all ten. In the end every credit is applied exactly once (the one replayed twice skipped as
/// a duplicate), the source and the dead-letter destination are empty.
pub async fn dead_letters_replayed_after_the_fix_are_applied_once_and_none_stay_parked<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "replay").await;
    if queue.dead_letter_reader().await.is_none() {
        println!("replay: skipped: the adapter has no dead-letter reader");
        finish(db, queue).await;
        return;
    }
    const N: i64 = 10;
    let expected = park_credits_while_down(&db, &queue, N).await;

    let summary = replay::summarize(&mut *reader(&queue).await)
        .await
        .expect("listing");
    println!("replay: parked {summary:?}");
    assert_eq!(summary.total.count, N as u64);
    assert_eq!(summary.by_reason.len(), 1, "{summary:?}");
    let (reason, tally) = summary.by_reason.iter().next().expect("one reason");
    assert!(
        reason.as_deref().is_some_and(|r| r.contains(DOWN)),
        "{reason:?}"
    );
    assert_eq!(tally.count, N as u64);
    assert!(summary.total.oldest <= summary.total.newest);

    let producer = queue.producer().await;
    let dry = replay::replay(
        &mut *reader(&queue).await,
        &*producer,
        &Selection::all(),
        true,
        &mut |_| {},
    )
    .await
    .expect("dry run");
    assert_eq!((dry.selected, dry.moved), (N as u64, N as u64));
    assert_eq!(left(&queue).await, 0, "a dry run published something");
    let after_dry = replay::summarize(&mut *reader(&queue).await)
        .await
        .expect("listing");
    assert_eq!(
        after_dry.total.count, N as u64,
        "a dry run removed something"
    );

    // Fixed. A replay that loses its connection after one copy reached the source removes
    // nothing; that copy is applied.
    let interrupted = FailsFirst::new(Arc::clone(&producer), Some(1), Recovery::Retry);
    let reason = reason.clone().unwrap_or_default();
    let e = replay::replay(
        &mut *reader(&queue).await,
        &interrupted,
        &Selection::all().reason(reason.clone()),
        false,
        &mut |_| {},
    )
    .await
    .expect_err("the first replay is interrupted");
    assert_eq!(e.recovery(), Recovery::Retry);
    let (applied, skipped) = consume_with_the_downstream_up(&db, &queue, 1).await;
    assert_eq!(wallet::applied(&db).await, 1);

    // Replayed again, all of it: the copy applied before is skipped.
    let mut batches = 0;
    let report = replay::replay(
        &mut *reader(&queue).await,
        &*producer,
        &Selection::all().reason(reason),
        false,
        &mut |_| batches += 1,
    )
    .await
    .expect("replay");
    assert_eq!(report.moved, N as u64, "{report:?}");
    assert!(batches >= 1);
    let (applied_again, skipped_again) =
        consume_with_the_downstream_up(&db, &queue, N as u64).await;
    let totals = (applied + applied_again, skipped + skipped_again);

    let ledger = wallet::summary(&db).await.expect("summary");
    let parked = replay::summarize(&mut *reader(&queue).await)
        .await
        .expect("listing");
    let left = left(&queue).await;
    println!(
        "replay: {totals:?}, {report:?}, {ledger:?}, parked {}, left {left}",
        parked.total.count
    );
    assert_eq!((ledger.ledger_rows, ledger.distinct_events), (N, N));
    assert_eq!(ledger.total_balance, expected);
    assert!(ledger.balances_exact);
    assert_eq!(totals, (N as u64, 1), "applied, skipped: {totals:?}");
    assert_eq!(parked.total.count, 0, "dead letters left: {parked:?}");
    assert_eq!(left, 0);
    finish(db, queue).await;
}

/// Consumes until the consumers together have applied, skipped or dead-lettered `until`, with
/// the wallet's credit behind a downstream that is `down` or not: while it is down, each credit
/// fails for good and is dead-lettered at once.
async fn consume<Q: TestQueue, D: TestStore>(db: &D, queue: &Q, down: bool, until: u64) -> Totals {
    let handler = Guarded(db.credit(), move |_: &MessageId, _: &Message| match down {
        true => Err(HandlerError::permanent(DOWN)),
        false => Ok(()),
    });
    drain(
        queue,
        "c1",
        Totals::default(),
        |source| {
            Consumer::new("wallet", source, db.inbox(), handler.clone())
                .retry(fast_retry(3))
                .run_until_idle()
        },
        |t| async move { t.applied + t.skipped + t.dead_lettered >= until },
    )
    .await
}

/// Sends `n` credits under fresh IDs and consumes them while the downstream is down: all `n`
/// are dead-lettered with a reason containing "downstream down". Returns the sum of the credits,
/// what the balances add up to once they are replayed and applied.
pub async fn park_credits_while_down<Q: TestQueue, D: TestStore>(db: &D, queue: &Q, n: i64) -> i64 {
    for i in 1..=n {
        let id = MessageId::generate();
        queue
            .send(Some(id.as_str()), &CreditEvent::new(1 + i % 3, i).to_json())
            .await;
    }
    let totals = consume(db, queue, true, n as u64).await;
    assert_eq!(totals.dead_lettered, n as u64, "{totals:?}");
    (1..=n).sum()
}

/// Consumes with the downstream up until `n` messages were applied or skipped; returns how
/// many were applied and how many skipped as duplicates.
pub async fn consume_with_the_downstream_up<Q: TestQueue, D: TestStore>(
    db: &D,
    queue: &Q,
    n: u64,
) -> (u64, u64) {
    let totals = consume(db, queue, false, n).await;
    (totals.applied, totals.skipped)
}

async fn reader<Q: TestQueue>(queue: &Q) -> Box<dyn replay::DynDeadLetters> {
    queue
        .dead_letter_reader()
        .await
        .expect("the adapter has a dead-letter reader")
}
