//! What the source itself does over a real Redis, without a database: delivery counts, the
//! recovery paths, deleted entries, the ack-on-receipt anti-pattern, and the producer's headers
//! as fields.

use crate::common;

use std::time::Duration;

use common::*;
use inbox_core::Publish;
use inbox_core::{Ack, Consumer, MessageSource, OutgoingMessage, Stage};
use inbox_redis_streams::redis::Value;
use inbox_testkit::{receive, AckOnReceive, Crash, MemoryStore, Sum};

#[tokio::test]
async fn delivery_counts_rise_on_reread_and_on_claim() {
    let stream = stream_key("counts");
    let producer = producer().await;
    let mut first = source(&stream, "c1").await;
    producer.send(&stream, b"1").await.expect("send");

    let batch = first.receive(10).await.expect("receive");
    assert_eq!(batch.len(), 1);
    let m = &batch[0].message;
    assert_eq!(
        (m.meta.delivery_count, m.meta.redelivered),
        (Some(1), false)
    );
    assert_eq!(m.meta.source, stream);
    drop(batch); // the process "died": never acked
    drop(first);

    // Same name again: its own pending entry comes first, counted a second time.
    let mut again = source(&stream, "c1").await;
    let batch = again.receive(10).await.expect("receive");
    let m = &batch[0].message;
    println!(
        "reread: delivery_count={:?} redelivered={}",
        m.meta.delivery_count, m.meta.redelivered
    );
    assert_eq!((m.meta.delivery_count, m.meta.redelivered), (Some(2), true));
    drop(batch);

    // Another name takes it over once idle.
    let mut other = builder(&stream, "c2")
        .claim_idle(Duration::from_millis(300))
        .connect()
        .await
        .expect("connect");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut batch = other.receive(10).await.expect("receive");
    let d = batch.pop().expect("claimed entry");
    println!(
        "claimed: delivery_count={:?}",
        d.message.meta.delivery_count
    );
    assert_eq!(d.message.meta.delivery_count, Some(3));
    d.ack.ack().await.expect("ack");
    assert_eq!(pending(&stream).await, 0);
    cleanup(&stream).await;
}

/// Entries claimed from a dead consumer keep their delivery counts when more than a thousand of
/// the claimer's own entries are in flight between them: the counts come from one `XPENDING`
/// over the claimed entries' range, which holds the claimer's other pending entries too.
#[tokio::test]
async fn claimed_entries_keep_their_counts_past_a_thousand_of_the_claimers_own_in_flight() {
    const IN_FLIGHT: usize = 1_100;
    let stream = stream_key("counts-wide");
    let producer = producer().await;
    let mut claimer = builder(&stream, "claimer")
        .claim_idle(Duration::from_millis(500))
        .connect()
        .await
        .expect("connect");
    let mut conn = raw().await;
    let mut dead_reads = inbox_redis_streams::redis::cmd("XREADGROUP");
    dead_reads.arg(("GROUP", GROUP, "dead", "COUNT", 1, "STREAMS", &stream, ">"));
    // The dead consumer's first entry, the claimer's own, the dead consumer's last.
    producer.send(&stream, b"first").await.expect("send");
    let _: Value = dead_reads.query_async(&mut conn).await.expect("XREADGROUP");
    let own: Vec<OutgoingMessage> = (0..IN_FLIGHT)
        .map(|i| OutgoingMessage::generate(i.to_string()))
        .collect();
    producer.send_batch(&stream, &own).await.expect("send");
    let mut in_flight = Vec::new();
    while in_flight.len() < IN_FLIGHT {
        let more = claimer.receive(IN_FLIGHT - in_flight.len()).await;
        in_flight.extend(more.expect("receive"));
    }
    producer.send(&stream, b"last").await.expect("send");
    let _: Value = dead_reads.query_async(&mut conn).await.expect("XREADGROUP");
    tokio::time::sleep(Duration::from_millis(600)).await;
    // The claimer's own entries are still being worked on: not idle, so not claimed.
    let own_ids: Vec<&str> = in_flight
        .iter()
        .map(|d| d.message.meta.position.as_str())
        .collect();
    let _: Value = inbox_redis_streams::redis::cmd("XCLAIM")
        .arg((&stream, GROUP, "claimer", 0))
        .arg(&own_ids)
        .arg("JUSTID")
        .query_async(&mut conn)
        .await
        .expect("XCLAIM");
    // One `XAUTOCLAIM` step scans up to ten times the count asked for: both ends of the range.
    let claimed = claimer.receive(200).await.expect("receive");
    let counts: Vec<_> = claimed
        .iter()
        .map(|d| (d.message.payload.clone(), d.message.meta.delivery_count))
        .collect();
    assert_eq!(
        counts,
        [(b"first".to_vec(), Some(2)), (b"last".to_vec(), Some(2))],
        "each claimed entry with its delivery count"
    );
    cleanup(&stream).await;
}

#[tokio::test]
async fn an_entry_deleted_while_pending_is_acked_away() {
    let stream = stream_key("deleted");
    let producer = producer().await;
    let mut first = source(&stream, "c1").await;
    let entry = producer
        .add(&stream, &OutgoingMessage::generate("1"))
        .await
        .expect("send");
    let batch = first.receive(10).await.expect("receive");
    assert_eq!(batch.len(), 1);
    drop((batch, first));
    let _: i64 = inbox_redis_streams::redis::cmd("XDEL")
        .arg(&stream)
        .arg(&entry)
        .query_async(&mut raw().await)
        .await
        .expect("XDEL");

    let mut again = source(&stream, "c1").await;
    let batch = again.receive(10).await.expect("receive");
    let left = pending(&stream).await;
    println!(
        "deleted pending entry: delivered {} times more, {left} left pending",
        batch.len()
    );
    assert!(batch.is_empty());
    assert_eq!(left, 0);
    cleanup(&stream).await;
}

#[tokio::test]
async fn an_entry_acked_on_receipt_is_lost_when_its_consumer_dies() {
    let stream = stream_key("noack");
    let producer = producer().await;
    for amount in [10, 20, 30] {
        producer
            .send(&stream, amount.to_string().as_bytes())
            .await
            .expect("send");
    }
    let store = MemoryStore::<i64>::new();
    let src = builder(&stream, "c1").connect().await.expect("connect");
    let crash = Crash::at(Stage::Claimed);
    let consumer = Consumer::new(
        "sum",
        AckOnReceive::new(src),
        crash.store(store.clone()),
        Sum,
    );
    let crashed = crash.run(consumer.run_until_idle()).await;
    assert!(crashed.is_err(), "the first message crashes the consumer");
    let src = builder(&stream, "c1")
        .claim_idle(Duration::from_millis(1))
        .connect()
        .await
        .expect("connect");
    Consumer::new("sum", AckOnReceive::new(src), store.clone(), Sum)
        .run_until_idle()
        .await
        .expect("run");
    let total = store.state().await;
    println!(
        "acked on receipt: total {total} of 60, pending {}",
        pending(&stream).await
    );
    assert_eq!(total, 50, "the entry in flight at the crash is gone");
    cleanup(&stream).await;
}

#[tokio::test]
async fn after_commit_mode_keeps_it() {
    let stream = stream_key("aftercommit");
    let producer = producer().await;
    for amount in [10, 20, 30] {
        producer
            .send(&stream, amount.to_string().as_bytes())
            .await
            .expect("send");
    }
    let store = MemoryStore::<i64>::new();
    let crash = Crash::at(Stage::Claimed);
    let consumer = Consumer::new(
        "sum",
        source(&stream, "c1").await,
        crash.store(store.clone()),
        Sum,
    );
    let crashed = crash.run(consumer.run_until_idle()).await;
    assert!(crashed.is_err(), "{crashed:?}");
    Consumer::new("sum", source(&stream, "c1").await, store.clone(), Sum)
        .run_until_idle()
        .await
        .expect("run");
    let total = store.state().await;
    println!(
        "after commit: total {total} of 60, pending {}",
        pending(&stream).await
    );
    assert_eq!(total, 60);
    assert_eq!(pending(&stream).await, 0);
    cleanup(&stream).await;
}

/// A blocking read longer than the Redis client's own default reply timeout (500 ms) waits its
/// whole `poll_timeout`: an entry added a second into the wait arrives on it, with no error and no
/// new connection.
#[tokio::test]
async fn a_blocking_read_longer_than_half_a_second_waits_for_its_entry() {
    let stream = stream_key("long-block");
    let producer = producer().await;
    let mut source = builder(&stream, "c1")
        .poll_timeout(Duration::from_secs(3))
        .connect()
        .await
        .expect("source connects");
    let to = stream.clone();
    let send = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        producer.send(&to, b"7").await.expect("send");
    });
    let batch = source.receive(10).await.expect("the blocked read answers");
    send.await.expect("the sender finished");
    assert_eq!(batch.len(), 1);
    assert_eq!(batch[0].message.payload, b"7");
    cleanup(&stream).await;
}

/// The dead letter carries the entry's own fields and the reason, and the entry is acked by the
/// same call: nothing is left pending.
#[tokio::test]
async fn a_dead_letter_is_parked_and_acked_in_one_step() {
    let stream = stream_key("park");
    xadd_raw(&stream, &[("trace", "t1"), ("payload", "not a number")]).await;
    let mut source = source(&stream, "c1").await;
    let d = source
        .receive(10)
        .await
        .expect("receive")
        .pop()
        .expect("entry");
    let position = d.message.meta.position.clone();
    d.ack
        .dead_letter(&d.message, "test: no ID")
        .await
        .expect("dead letter");
    assert_eq!(pending(&stream).await, 0, "acked by the dead letter");
    let dead = dead_letters(&stream).await;
    let field = |name: &str| {
        dead[0]
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(dead.len(), 1);
    assert_eq!(field("trace").as_deref(), Some("t1"));
    assert_eq!(field("payload").as_deref(), Some("not a number"));
    assert_eq!(field("reason").as_deref(), Some("test: no ID"));
    assert_eq!(field("original_source"), Some(stream.clone()));
    assert_eq!(field("original_position"), Some(position));
    cleanup(&stream).await;
}

/// The dead-letter stream's key holds another type, so its `XADD` fails when it runs: the entry
/// must stay pending (inside a `MULTI` the `XACK` would still run, and the entry would be gone
/// with no copy anywhere).
#[tokio::test]
async fn a_dead_letter_that_cannot_be_written_leaves_the_entry_pending() {
    let stream = stream_key("park-fails");
    xadd_raw(&stream, &[("payload", "x")]).await;
    let _: () = inbox_redis_streams::redis::cmd("SET")
        .arg(format!("{stream}:dlq"))
        .arg("not a stream")
        .query_async(&mut raw().await)
        .await
        .expect("SET");
    let mut source = source(&stream, "c1").await;
    let d = source
        .receive(10)
        .await
        .expect("receive")
        .pop()
        .expect("entry");
    let e = d
        .ack
        .dead_letter(&d.message, "test: no ID")
        .await
        .expect_err("XADD onto a string key fails");
    println!("failed dead letter: {e}");
    assert!(e.to_string().contains("WRONGTYPE"), "{e}");
    assert_eq!(pending(&stream).await, 1, "the entry is still pending");
    cleanup(&stream).await;
}

#[tokio::test]
async fn headers_go_out_as_fields_alone_and_in_a_batch_and_may_not_shadow_the_id_or_payload() {
    let stream = stream_key("headers");
    let producer = producer().await;
    let one = OutgoingMessage::generate("1").header("tenant", "acme");
    producer.add(&stream, &one).await.expect("XADD");
    let batch = [
        OutgoingMessage::generate("2")
            .header("tenant", "umbrella")
            .header("region", "eu"),
        OutgoingMessage::generate("3"),
    ];
    producer.send_batch(&stream, &batch).await.expect("EVAL");
    for field in ["event_id", "payload"] {
        let shadow = OutgoingMessage::generate("4").header(field, "x");
        let e = producer.add(&stream, &shadow).await.unwrap_err();
        assert!(e.to_string().contains("would shadow"), "{e}");
    }

    let mut source = source(&stream, "c1").await;
    let got = receive(&mut source, 3, Duration::from_secs(10)).await;
    let headers: Vec<_> = got.iter().map(|d| d.message.headers.clone()).collect();
    let header = |name: &str, value: &str| (name.to_owned(), value.as_bytes().to_vec());
    assert_eq!(
        headers,
        [
            vec![header("tenant", "acme")],
            vec![header("tenant", "umbrella"), header("region", "eu")],
            vec![],
        ]
    );
    for delivery in got {
        delivery.ack.ack().await.expect("ack");
    }
    cleanup(&stream).await;
}
