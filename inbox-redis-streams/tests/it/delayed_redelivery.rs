//! A delayed redelivery over a real Redis: the entry handed back under a schedule comes back
//! once, after its delay, and is then worked on like any other claimed entry: not claimed
//! again every time it has been idle for its delay.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use inbox_core::{
    Ack, Consumer, Handler, HandlerError, Message, MessageId, MessageSource, Publish,
};
use inbox_testkit::{fast_retry, MemoryStore, MemoryTx};

const DELAY: Duration = Duration::from_millis(300);

/// Adds the message's number to the state; fails its first call, and takes five delays over
/// every later one.
#[derive(Debug, Clone, Default)]
struct FailsOnceThenSlow {
    calls: Arc<AtomicU32>,
}

impl Handler<MemoryTx<i64>> for FailsOnceThenSlow {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(HandlerError::transient("the first attempt fails"));
        }
        tokio::time::sleep(DELAY * 5).await;
        *tx.state_mut() += message.json::<i64>()?;
        Ok(())
    }
}

/// A message that failed once comes back after its delay; its second handling outlasts the
/// delay several times over. With `max_deliveries(2)` it must be applied once, and neither
/// dead-lettered nor handed out again while the handler runs (two chunks side by side, so the
/// consumer keeps sweeping meanwhile).
#[tokio::test]
async fn a_redelivered_entry_worked_on_longer_than_its_delay_is_applied_once_not_parked() {
    let stream = stream_key("redeliver-slow");
    producer().await.send(&stream, b"7").await.expect("send");
    let source = builder(&stream, "c1")
        .poll_timeout(Duration::from_millis(50))
        .claim_interval(Duration::from_millis(50))
        .connect()
        .await
        .expect("source connects");
    let store = MemoryStore::<i64>::new();
    let handler = FailsOnceThenSlow::default();
    let consumer = Consumer::new("wallet", source, store.clone(), handler.clone())
        .retry(fast_retry(1).redeliver_after([DELAY]))
        .max_deliveries(2)
        .parallel_lanes(2);
    let stats = consumer.stats();
    // Until it is applied (or 30 s, a failure), then six delays more for any late copy.
    let applied = {
        let store = store.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while store.state().await == 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(DELAY / 4).await;
            }
            tokio::time::sleep(DELAY * 6).await;
        }
    };
    consumer.run_until(applied).await.expect("run");

    let parked = dead_letters(&stream).await;
    let calls = handler.calls.load(Ordering::SeqCst);
    let stats = stats.snapshot();
    println!(
        "sum {}, handler calls {calls}, skipped {}, dead letters {parked:?}, pending {}",
        store.state().await,
        stats.skipped_duplicates,
        pending(&stream).await
    );
    assert!(parked.is_empty(), "dead-lettered: {parked:?}");
    assert_eq!(store.state().await, 7, "applied once");
    assert_eq!(
        calls, 2,
        "one failure, one success: no extra copies handled"
    );
    assert_eq!(stats.skipped_duplicates, 0, "no extra copies delivered");
    assert_eq!(pending(&stream).await, 0);
    cleanup(&stream).await;
}

/// The source alone: once the redelivered copy is out, later sweeps leave it with its holder
/// until `claim_idle`, however long past its delay it is worked on; its delivery count stays.
#[tokio::test]
async fn a_redelivered_copy_is_not_claimed_again_while_it_is_worked_on() {
    let stream = stream_key("redeliver-held");
    producer().await.send(&stream, b"1").await.expect("send");
    let mut source = builder(&stream, "c1")
        .poll_timeout(Duration::from_millis(50))
        .claim_interval(Duration::from_millis(10))
        .connect()
        .await
        .expect("source connects");

    let mut batch = source.receive(10).await.expect("receive");
    let first = batch.pop().expect("the entry");
    let message = first.message.clone();
    first
        .ack
        .redeliver(&message, DELAY, 0)
        .await
        .expect("redeliver");

    let mut copy = None;
    for _ in 0..200 {
        let mut batch = source.receive(10).await.expect("receive");
        if let Some(d) = batch.pop() {
            copy = Some(d);
            break;
        }
    }
    let copy = copy.expect("the copy comes back after its delay");
    assert_eq!(copy.message.meta.redeliveries, 1);
    assert_eq!(copy.message.meta.delivery_count, Some(2));

    // Worked on for several delays; the source keeps sweeping meanwhile.
    let mut again = Vec::new();
    for _ in 0..6 {
        tokio::time::sleep(DELAY / 2).await;
        for d in source.receive(10).await.expect("receive") {
            again.push((
                d.message.meta.position.clone(),
                d.message.meta.delivery_count,
            ));
        }
    }
    assert!(
        again.is_empty(),
        "handed out again while worked on: {again:?}"
    );
    copy.ack.ack().await.expect("ack");
    assert_eq!(pending(&stream).await, 0);
    cleanup(&stream).await;
}

/// A copy handed out again (here: reread by a consumer of the same name, as after a lost
/// connection) while an earlier copy is still worked on: the latest copy's hand-back marks the
/// entry, and the earlier copy's hand-back after it changes nothing. It must neither rewind the
/// mark to its own counts (the entry would then wait for `claim_idle`, not its delay, and its
/// schedule restart) nor take the entry back to its consumer.
#[tokio::test]
async fn an_earlier_copys_hand_back_leaves_the_latest_copys_mark() {
    let stream = stream_key("redeliver-stale");
    producer().await.send(&stream, b"1").await.expect("send");
    let connect = || async {
        builder(&stream, "c1")
            .poll_timeout(Duration::from_millis(50))
            .claim_interval(Duration::from_millis(10))
            .connect()
            .await
            .expect("source connects")
    };
    let mut earlier_source = connect().await;
    let earlier = earlier_source
        .receive(10)
        .await
        .expect("receive")
        .pop()
        .expect("the entry");
    let mut source = connect().await;
    let latest = source
        .receive(10)
        .await
        .expect("receive")
        .pop()
        .expect("the entry, reread");
    assert_eq!(latest.message.meta.delivery_count, Some(2));

    let message = latest.message.clone();
    latest
        .ack
        .redeliver(&message, DELAY, 0)
        .await
        .expect("redeliver");
    earlier
        .ack
        .redeliver(&message, DELAY, 0)
        .await
        .expect("redeliver of the earlier copy");

    let mut copy = None;
    for _ in 0..20 {
        tokio::time::sleep(DELAY / 4).await;
        if let Some(d) = source.receive(10).await.expect("receive").pop() {
            copy = Some(d);
            break;
        }
    }
    let copy = copy.expect("the copy comes back after its delay, not after claim_idle");
    assert_eq!(copy.message.meta.redeliveries, 1);
    assert_eq!(copy.message.meta.delivery_count, Some(3));
    copy.ack.ack().await.expect("ack");
    assert_eq!(pending(&stream).await, 0);
    drop(earlier_source);
    cleanup(&stream).await;
}
