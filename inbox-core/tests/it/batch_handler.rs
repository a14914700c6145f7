//! The batch handler on the in-memory broker and store: a failure it cannot place is found by
//! halving, one it places (`HandlerError::at`) is found at once, and the outcome equals applying
//! the messages one by one.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{
    BatchHandler, BatchItem, Consumer, HandlerError, Message, MessageId, RetryPolicy,
};
use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};

/// Appends each amount to a list; an amount of 13 fails the whole batch, placed or not.
struct Append {
    place_failures: bool,
    panic_on_13: bool,
    calls: Arc<AtomicU32>,
}

impl BatchHandler<MemoryTx<Vec<i64>>> for Append {
    type Item = i64;

    fn decode(&self, _id: &MessageId, message: &Message) -> Result<i64, HandlerError> {
        message.json()
    }

    async fn handle_batch(
        &self,
        tx: &mut MemoryTx<Vec<i64>>,
        batch: &[BatchItem<'_, i64>],
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        for (i, entry) in batch.iter().enumerate() {
            if *entry.item == 13 {
                assert!(!self.panic_on_13, "unlucky number");
                let e = HandlerError::transient("13 is refused");
                return Err(if self.place_failures { e.at(i) } else { e });
            }
            tx.state_mut().push(*entry.item);
        }
        Ok(())
    }
}

async fn run(place_failures: bool, panic_on_13: bool) -> (Vec<i64>, Vec<String>, u32) {
    let broker = MemoryBroker::new();
    for i in 0..32i64 {
        let amount = if i == 21 { 13 } else { 100 + i };
        broker.publish(Some(&format!("evt-{i}")), amount.to_string());
    }
    let store = MemoryStore::<Vec<i64>>::new();
    let calls = Arc::new(AtomicU32::new(0));
    let handler = Append {
        place_failures,
        panic_on_13,
        calls: Arc::clone(&calls),
    };
    let stats = Consumer::batched("sums", broker.source(), store.clone(), handler)
        .batch_size(32)
        .retry(
            RetryPolicy::default()
                .max_attempts(2)
                .backoff(Duration::from_millis(1), Duration::from_millis(2)),
        )
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!((stats.applied, stats.dead_lettered), (31, 1), "{stats:?}");
    let dead = broker
        .dead_letters()
        .into_iter()
        .map(|(m, reason)| format!("{}: {reason}", m.id.unwrap()))
        .collect();
    (store.state().await, dead, calls.load(Ordering::Relaxed))
}

fn expected() -> Vec<i64> {
    (0..32).filter(|i| *i != 21).map(|i| 100 + i).collect()
}

#[tokio::test]
async fn a_failure_the_handler_cannot_place_is_found_by_halving() {
    let (applied, dead, calls) = run(false, false).await;
    assert_eq!(applied, expected(), "every other message once, in order");
    assert_eq!(
        dead,
        ["evt-21: handler failed 2 time(s), last error: 13 is refused"]
    );
    // 32 → 16 → 8 → 4 → 2 → 1: a failing and a passing half per level, then one retry.
    assert!(calls <= 13, "{calls} handler calls");
}

#[tokio::test]
async fn a_failure_placed_with_at_is_found_at_once() {
    let (applied, dead, calls) = run(true, false).await;
    assert_eq!(applied, expected());
    assert_eq!(dead.len(), 1);
    // The batch, then the messages before 21, 21 alone, those after it, and one retry.
    assert_eq!(calls, 5);
}

#[tokio::test]
async fn a_panicking_batch_handler_fails_only_the_message_that_panics() {
    let (applied, dead, _) = run(false, true).await;
    assert_eq!(applied, expected());
    assert_eq!(
        dead,
        ["evt-21: handler failed 2 time(s), last error: handler panicked: unlucky number"]
    );
}
