//! The redelivery schedule on SQS: only the consumer's own delayed redeliveries move a message
//! along it, not hand-backs (a nack behind a blocked message, a crash, a visibility timeout).
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{client, counts, credit, queue};
use inbox_conformance::wallet::{summary, Credit};
use inbox_conformance::TestDb;
use inbox_core::{
    Ack, Consumer, Handler, HandlerError, Message, MessageId, MessageSource, Publish, RetryPolicy,
};
use inbox_postgres::PgTx;
use inbox_sqs::SqsConnection;

const SECOND: Duration = Duration::from_secs(1);

/// The wallet's credit behind a downstream that fails the first attempt; records the
/// redelivery count of each attempt.
#[derive(Clone)]
struct FailsOnce {
    credit: Arc<Credit>,
    attempts: Arc<Mutex<Vec<u32>>>,
}

impl Handler<PgTx> for FailsOnce {
    async fn handle(&self, tx: &mut PgTx, id: &MessageId, m: &Message) -> Result<(), HandlerError> {
        let first = {
            let mut attempts = self.attempts.lock().unwrap();
            attempts.push(m.meta.redeliveries);
            attempts.len() == 1
        };
        if first {
            return Err(HandlerError::transient("the downstream is down"));
        }
        self.credit.handle(tx, id, m).await
    }
}

/// A message handed back three times before it is first tried (as behind a blocked
/// strict-order message, or after crashes) still has its whole schedule: its first failure is
/// redelivered, not dead-lettered, and the copy that comes back counts one redelivery.
#[tokio::test]
async fn hand_backs_do_not_use_up_the_redelivery_schedule() {
    hand_backs_then_one_failure(false).await;
}

/// The same on a FIFO queue, which takes no per-message delay: the copy is hidden until due.
#[tokio::test]
async fn hand_backs_do_not_use_up_the_redelivery_schedule_on_a_fifo_queue() {
    hand_backs_then_one_failure(true).await;
}

async fn hand_backs_then_one_failure(fifo: bool) {
    let sqs = client().await;
    let url = if fifo {
        common::fifo_queue(&sqs, "handback", 30).await
    } else {
        queue(&sqs, "handback", 30).await
    };
    let dlq = queue(&sqs, "handback-dlq", 30).await;
    let db = TestDb::new().await;
    let sender = SqsConnection::new(sqs.clone())
        .producer()
        .message_group_id("account-1")
        .connect()
        .await
        .unwrap();
    sender.send(&url, credit(1, 40).as_bytes()).await.unwrap();
    // Receives wait 3 s, longer than a redelivery's delay: the consumer is idle only once
    // nothing is on its way back.
    let connect = || {
        SqsConnection::new(sqs.clone())
            .source(&url)
            .poll_timeout(3 * SECOND)
            .dead_letter_queue(&dlq)
            .connect()
    };
    let mut source = connect().await.unwrap();
    let mut handed_back = 0;
    while handed_back < 3 {
        for delivery in source.receive(1).await.unwrap() {
            delivery.ack.nack(Duration::ZERO).await.unwrap();
            handed_back += 1;
        }
    }

    let handler = FailsOnce {
        credit: Arc::new(Credit::new(db.clone())),
        attempts: Arc::default(),
    };
    let stats = Consumer::new(
        "wallet",
        connect().await.unwrap(),
        db.inbox(),
        handler.clone(),
    )
    .retry(
        RetryPolicy::default()
            .max_attempts(1)
            .redeliver_after([SECOND, SECOND]),
    )
    .run_until_idle()
    .await
    .unwrap();
    let ledger = summary(&db).await.unwrap();
    let dead = common::drain(&sqs, &dlq, SECOND).await;
    let attempts = handler.attempts.lock().unwrap().clone();
    println!("after 3 hand-backs (FIFO {fifo}): {stats:?}, {ledger:?}, attempts under redeliveries {attempts:?}");
    assert!(
        dead.is_empty(),
        "dead-lettered at its first failure: {dead:?}"
    );
    assert_eq!(
        (ledger.ledger_rows, ledger.distinct_events),
        (1, 1),
        "applied once"
    );
    assert_eq!(attempts, [0, 1], "tried first, then once redelivered");
    assert_eq!(
        counts(&sqs, &url).await,
        (0, 0),
        "nothing left on the queue"
    );
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
    db.drop().await;
}
