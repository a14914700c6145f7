//! Dead letters replayed into an SQS FIFO queue at once, within SQS's five-minute
//! deduplication window: each replay arrives and is applied, or stays parked; never dropped.
//!
//! moto drops a resend with a seen deduplication ID only while the first copy is still queued,
//! where AWS drops it for five minutes: what a replay sends as its deduplication ID is pinned by
//! the unit test in `src/dead_letter.rs`, and this test runs the round trip for real.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{client, counts, credit, fifo_queue, producer};
use inbox_conformance::wallet::{summary, Credit};
use inbox_conformance::TestDb;
use inbox_core::replay::{replay, Selection};
use inbox_core::{Ack, Consumer, MessageId, MessageSource, OutgoingMessage, Publish};
use inbox_sqs::SqsConnection;

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test]
async fn a_dead_letter_replayed_at_once_into_a_fifo_queue_is_applied() {
    let sqs = client().await;
    let url = fifo_queue(&sqs, "replay", 30).await;
    let dlq = fifo_queue(&sqs, "replay-dlq", 30).await;
    let db = TestDb::new().await;
    let producer = producer(&sqs).await;
    let connect = || {
        SqsConnection::new(sqs.clone())
            .source(&url)
            .poll_timeout(SECOND)
            .dead_letter_queue(&dlq)
            .connect()
    };
    let id = MessageId::generate();
    let message = OutgoingMessage::new(id.clone(), credit(1, 25)).key("account-1");
    producer.send_batch(&url, &[message]).await.unwrap();

    // Parked, replayed at once, parked again (it failed once more) and replayed again: all
    // within five minutes of the first send.
    let mut source = connect().await.unwrap();
    for round in 0..2 {
        let mut batch = Vec::new();
        while batch.is_empty() {
            batch = source.receive(1).await.unwrap();
        }
        let delivery = batch.pop().unwrap();
        assert_eq!(delivery.message.id, Ok(id.clone()), "round {round}");
        delivery
            .ack
            .dead_letter(&delivery.message, "the downstream is down")
            .await
            .unwrap();
        let mut letters = SqsConnection::new(sqs.clone())
            .dead_letters(&dlq)
            .connect()
            .await
            .unwrap();
        let report = replay(
            &mut letters,
            &producer,
            &Selection::all(),
            false,
            &mut |_| {},
        )
        .await
        .unwrap();
        assert_eq!(report.moved, 1, "round {round}: {report:?}");
    }

    let stats = Consumer::new(
        "wallet",
        connect().await.unwrap(),
        db.inbox(),
        Credit::new(db.clone()),
    )
    .run_until_idle()
    .await
    .unwrap();
    let ledger = summary(&db).await.unwrap();
    let parked = common::drain(&sqs, &dlq, SECOND).await;
    println!(
        "replayed twice at once: {stats:?}, {ledger:?}, still parked {}",
        parked.len()
    );
    assert_eq!(
        (ledger.ledger_rows, ledger.distinct_events, parked.len()),
        (1, 1, 0),
        "the replayed credit is applied once, or still parked; never neither"
    );
    assert_eq!(counts(&sqs, &url).await, (0, 0));
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
    db.drop().await;
}
