//! Strict order on a real Kafka-protocol broker: a failing record blocks its partition until it
//! is applied or dead-lettered, across a shutdown that hands it back (a seek back) and a second
//! consumer that reads on from the committed offset.

// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use inbox_conformance::wallet::{Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{
    Consumer, Handler, HandlerError, Message, MessageId, Order, OutgoingMessage, RetryPolicy,
    Stage, StageHook,
};
use inbox_postgres::PgTx;

/// The wallet's credit, recording each partition's offsets in the order committed (see
/// [`Ordered::hook`]); the record at `(partition, offset)` in `failing` fails, and the one in
/// `held` fails while `hold` is set.
#[derive(Clone)]
struct Ordered {
    credit: Arc<Credit>,
    places: Arc<Mutex<HashMap<String, (i32, i64)>>>,
    applied: Arc<Mutex<BTreeMap<i32, Vec<i64>>>>,
    failing: (i32, i64),
    held: (i32, i64),
    hold: Arc<AtomicBool>,
}

fn place(message: &Message) -> (i32, i64) {
    // "partition {partition} offset {offset}"
    let words: Vec<&str> = message.meta.position.split(' ').collect();
    (words[1].parse().unwrap(), words[3].parse().unwrap())
}

impl Handler<PgTx> for Ordered {
    async fn handle(
        &self,
        tx: &mut PgTx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let at = place(message);
        if at == self.failing || (at == self.held && self.hold.load(Ordering::SeqCst)) {
            return Err(HandlerError::transient(format!("{at:?} is not ready")));
        }
        self.places.lock().unwrap().insert(id.to_string(), at);
        self.credit.handle(tx, id, message).await
    }
}

impl Ordered {
    /// Records each message once its transaction committed, in the order applied.
    fn hook(&self) -> StageHook {
        let (places, applied) = (Arc::clone(&self.places), Arc::clone(&self.applied));
        StageHook::new(move |stage, id| {
            if stage == Stage::Committed {
                let (partition, offset) = places.lock().unwrap()[id.as_str()];
                applied
                    .lock()
                    .unwrap()
                    .entry(partition)
                    .or_default()
                    .push(offset);
            }
        })
    }

    fn count(&self) -> usize {
        self.applied.lock().unwrap().values().map(Vec::len).sum()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_order_holds_each_partition_behind_its_failing_record() {
    let (partitions, per_partition) = (3, 8i64);
    let topic = topic(partitions).await;
    let group = random("group");
    let db = TestDb::new().await;
    let producer = producer().await;
    for i in 0..per_partition {
        for partition in 0..partitions {
            let event = CreditEvent::new(i64::from(partition) + 1, i + 1);
            let credit = OutgoingMessage::generate(event.to_json());
            producer
                .send_to(&topic, Some(partition), &credit)
                .await
                .unwrap();
        }
    }
    let handler = Ordered {
        credit: Arc::new(Credit::new(db.clone())),
        places: Arc::default(),
        applied: Arc::default(),
        // Dead-lettered by the second consumer, after its retries.
        failing: (2, 5),
        // Fails under the first consumer, whose retries wait a minute; applied by the second.
        held: (1, 3),
        hold: Arc::new(AtomicBool::new(true)),
    };
    let slow = RetryPolicy::default()
        .max_attempts(3)
        .backoff(Duration::from_secs(60), Duration::from_secs(60));
    let first = Consumer::new(
        "strict",
        source(&topic, &group).await,
        db.inbox(),
        handler.clone(),
    )
    .batch_size(8)
    .parallel_lanes(3)
    .order(Order::Strict)
    .on_stage(handler.hook())
    .retry(slow);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(first.run_until(async {
        stopped.await.ok();
    }));
    // Partition 0 whole, partition 1 up to its held record, partition 2 up to its failing one.
    let blocked = 8 + 3 + 5;
    assert!(eventually(|| async { handler.count() >= blocked }).await);
    // Time for anything past a blocked record to be applied, were it not held.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        handler.count(),
        blocked,
        "{:?}",
        handler.applied.lock().unwrap()
    );
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();

    handler.hold.store(false, Ordering::SeqCst);
    let second = Consumer::new(
        "strict",
        source(&topic, &group).await,
        db.inbox(),
        handler.clone(),
    )
    .batch_size(8)
    .parallel_lanes(3)
    .order(Order::Strict)
    .on_stage(handler.hook())
    .retry(
        RetryPolicy::default()
            .max_attempts(3)
            .backoff(Duration::from_millis(10), Duration::from_millis(50)),
    );
    let stats = second.stats();
    let all = (3 * per_partition - 1) as usize;
    let counted = handler.clone();
    let run = tokio::spawn(second.run_until(async move {
        let deadline = tokio::time::Instant::now() + WAIT;
        while (counted.count() < all || stats.snapshot().dead_lettered < 1)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }));
    run.await.unwrap().unwrap();
    let lag = wait_for_no_lag(&topic, &group, partitions).await;

    let applied = handler.applied.lock().unwrap().clone();
    let every: Vec<i64> = (0..per_partition).collect();
    assert_eq!(applied[&0], every);
    assert_eq!(applied[&1], every, "partition 1 applied out of order");
    let without_dead: Vec<i64> = every.iter().copied().filter(|o| *o != 5).collect();
    assert_eq!(
        applied[&2], without_dead,
        "partition 2 applied out of order"
    );
    assert_eq!(lag, 0, "every partition committed");
    let dead = read_all(&format!("{topic}.dlq")).await;
    assert_eq!(dead.len(), 1);
    let summary = summary(&db).await;
    assert_eq!(summary.distinct_events, all as i64);
    assert_eq!(summary.duplicates(), 0);
    db.drop().await;
}
