//! Partitions in parallel, order within each: one source, `Consumer::parallel_lanes`, a real
//! Kafka-protocol broker and PostgreSQL.

// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, OutgoingMessage};
use inbox_postgres::PgTx;

/// The wallet's credit, watched: how many run at once, and the order of each partition.
#[derive(Clone)]
struct Watched {
    credit: Arc<Credit>,
    running: Arc<AtomicUsize>,
    most_at_once: Arc<AtomicUsize>,
    applied: Arc<Mutex<HashMap<String, Vec<i64>>>>,
}

impl Handler<PgTx> for Watched {
    async fn handle(
        &self,
        tx: &mut PgTx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_at_once.fetch_max(now, Ordering::SeqCst);
        let result = self.credit.handle(tx, id, message).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        let offset: i64 = message
            .meta
            .position
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let lane = message.meta.lane.clone().unwrap();
        self.applied
            .lock()
            .unwrap()
            .entry(lane)
            .or_default()
            .push(offset);
        result
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_applied_side_by_side_each_in_offset_order() {
    let partitions = 6;
    let topic = topic(partitions).await;
    let group = random("group");
    let db = TestDb::new().await;
    // Keyed as a real producer would: one account's credits on one partition, so the lanes'
    // transactions never wait on each other's row locks.
    let producer = producer().await;
    let mut total = 0;
    for i in 0..90 {
        let partition = i % partitions;
        let event = CreditEvent::new(i64::from(partition) + 1, i64::from(i % 50) + 1);
        total += event.amount;
        let credit = OutgoingMessage::generate(event.to_json());
        producer
            .send_to(&topic, Some(partition), &credit)
            .await
            .unwrap();
    }
    let watched = Watched {
        // Long enough for the partitions' transactions to overlap.
        credit: Arc::new(Credit::new(db.clone()).work(Duration::from_millis(30))),
        running: Arc::default(),
        most_at_once: Arc::default(),
        applied: Arc::default(),
    };
    let consumer = Consumer::new(
        "wallet",
        source(&topic, &group).await,
        db.inbox(),
        watched.clone(),
    )
    .batch_size(90)
    .parallel_lanes(partitions as usize);
    let stats = consumer.stats();
    let run = tokio::spawn(consumer.run_until(async move {
        let deadline = tokio::time::Instant::now() + WAIT;
        while stats.snapshot().applied < 90 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }));
    let stats = run.await.unwrap().unwrap();
    let summary = summary(&db).await;
    let lag = wait_for_no_lag(&topic, &group, partitions).await;
    let most = watched.most_at_once.load(Ordering::SeqCst);
    println!("parallel lanes: {stats:?} {summary:?} lag={lag} most at once={most}");
    assert_eq!(summary.distinct_events, 90);
    assert_eq!(summary.duplicates(), 0);
    assert_eq!(summary.total_balance, total);
    assert_eq!(lag, 0, "every partition committed");
    assert!(most > 1, "the partitions never ran side by side");
    let applied = watched.applied.lock().unwrap().clone();
    assert_eq!(applied.len(), partitions as usize);
    for (lane, offsets) in &applied {
        assert!(
            offsets.windows(2).all(|w| w[0] < w[1]),
            "{lane} applied out of offset order: {offsets:?}"
        );
    }
    assert!(wallet::summary(&db).await.unwrap().balances_exact);
    db.drop().await;
}
