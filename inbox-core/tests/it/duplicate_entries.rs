//! One broker entry handed out twice while the consumer still holds the first copy: a Kafka
//! partition revoked and assigned back (the old copies' handles go stale), a seek back within
//! one generation (both copies share a handle), an SQS visibility timeout running out while the
//! message waits in a lane, a Redis `XAUTOCLAIM`. With lanes ≥ 2 both copies can land in one
//! chunk; the second must follow the first's outcome, never be acked on its own.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, RetryPolicy};
use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx, Redelivery};
use tokio::sync::{oneshot, Notify};

/// The IDs applied, in commit order.
type Ledger = Vec<String>;

/// Records each ID; `slow` waits for `release` first, `bad` fails while `failing` is set (and
/// says so once through `failed`).
struct Record {
    release: Arc<Notify>,
    failing: Arc<AtomicBool>,
    failed: Mutex<Option<oneshot::Sender<()>>>,
}

impl Handler<MemoryTx<Ledger>> for Record {
    async fn handle(
        &self,
        tx: &mut MemoryTx<Ledger>,
        id: &MessageId,
        _m: &Message,
    ) -> Result<(), HandlerError> {
        match id.as_str() {
            "slow" => self.release.notified().await,
            "bad" if self.failing.load(Ordering::SeqCst) => {
                if let Some(said) = self.failed.lock().unwrap().take() {
                    let _ = said.send(());
                }
                return Err(HandlerError::transient("the downstream is down"));
            }
            _ => {}
        }
        tx.state_mut().push(id.to_string());
        Ok(())
    }
}

/// Waits until `check` holds, failing the test after 10 s.
async fn until(what: &str, check: impl Fn() -> bool) {
    for _ in 0..1000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: not within 10 s");
}

fn in_lane(id: &str) -> Message {
    let mut message = Message::new(Ok(MessageId::new(id).unwrap()), "{}");
    message.meta.lane = Some("partition 0".into());
    message
}

/// `bad` is received while its lane is busy, handed out a second time as `how` says, and both
/// copies are applied in one chunk; `bad` fails, and the consumer stops while it waits to retry.
/// Then a consumer whose handler works drains the broker: `bad` must be there to apply.
async fn second_copy_in_one_chunk(how: Redelivery) {
    let broker = MemoryBroker::with_lanes();
    let store = MemoryStore::<Ledger>::new();
    let release = Arc::new(Notify::new());
    let failing = Arc::new(AtomicBool::new(true));
    let (failed_tx, failed) = oneshot::channel();
    let handler = Record {
        release: Arc::clone(&release),
        failing: Arc::clone(&failing),
        failed: Mutex::new(Some(failed_tx)),
    };
    broker.publish_message(in_lane("slow"));
    let consumer = Consumer::new("ledger", broker.source(), store.clone(), handler)
        .batch_size(10)
        .parallel_lanes(2)
        // The hand-back's delay: `bad` is ready again at once.
        .error_backoff(Duration::from_millis(1))
        .retry(
            RetryPolicy::default()
                .max_attempts(3)
                .backoff(Duration::from_secs(30), Duration::from_secs(30)),
        );
    let running = tokio::spawn(consumer.run_until(async {
        let _ = failed.await;
    }));

    // `slow` holds the lane; `bad` waits behind it, then is handed out again.
    until("`slow` is being applied", || broker.in_flight() == 1).await;
    broker.publish_message(in_lane("bad"));
    until("`bad` is received", || broker.in_flight() == 2).await;
    assert_eq!(broker.redeliver("bad", how), 1);
    until("the second copy of `bad` is received", || {
        broker.pending() == broker.in_flight()
    })
    .await;
    release.notify_one();

    running.await.unwrap().unwrap();
    assert!(
        broker.dead_letters().is_empty(),
        "stopped before the retry budget ran out"
    );
    assert_eq!(
        broker.pending(),
        1,
        "`bad` was lost: its second copy was acked while the first was handed back"
    );
    failing.store(false, Ordering::SeqCst);
    let handler = Record {
        release,
        failing,
        failed: Mutex::new(None),
    };
    Consumer::new("ledger", broker.source(), store.clone(), handler)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(store.state().await, ["slow", "bad"], "each applied once");
    assert_eq!(broker.pending(), 0);
}

/// The adapter cannot tell that the first copy's handle went stale: both copies reach the chunk,
/// and the second (whose handle is the live one) must be handed back with the first, not acked.
/// (Where the adapter can tell, `is_stale` drops the first copy before its claim: see the last
/// test.)
#[tokio::test]
async fn a_second_copy_with_a_fresh_handle_is_handed_back_with_the_first() {
    second_copy_in_one_chunk(Redelivery::SilentStaleHandle).await;
}

#[tokio::test]
async fn a_second_copy_with_the_same_handle_is_handed_back_with_the_first() {
    second_copy_in_one_chunk(Redelivery::SameHandle).await;
}

/// A copy whose handle went stale while it waited in its lane is dropped before its claim: the
/// new copy is the one applied and acked, and nothing counts as a duplicate.
#[tokio::test]
async fn a_copy_taken_back_while_it_waited_is_dropped_for_its_new_copy() {
    let broker = MemoryBroker::with_lanes();
    let store = MemoryStore::<Ledger>::new();
    let release = Arc::new(Notify::new());
    let handler = Record {
        release: Arc::clone(&release),
        failing: Arc::new(AtomicBool::new(false)),
        failed: Mutex::new(None),
    };
    broker.publish_message(in_lane("slow"));
    let consumer = Consumer::new("ledger", broker.source(), store.clone(), handler)
        .batch_size(10)
        .parallel_lanes(2);
    let drained = broker.clone();
    let running = tokio::spawn(consumer.run_until(async move {
        until("the broker is drained", || drained.pending() == 0).await;
    }));

    until("`slow` is being applied", || broker.in_flight() == 1).await;
    broker.publish_message(in_lane("taken-back"));
    until("`taken-back` is received", || broker.in_flight() == 2).await;
    assert_eq!(broker.redeliver("taken-back", Redelivery::StaleHandle), 1);
    until("the new copy is received", || {
        broker.pending() == broker.in_flight()
    })
    .await;
    release.notify_one();

    let stats = running.await.unwrap().unwrap();
    assert_eq!(store.state().await, ["slow", "taken-back"]);
    assert_eq!(
        (stats.applied, stats.skipped_duplicates),
        (2, 0),
        "the stale copy was applied, its new copy skipped: {stats:?}"
    );
    assert_eq!(broker.acked(), 2);
}
