//! What the NATS source does on its own, beside the suite: a delayed nack, "in progress" while a
//! handler runs long, the delivery budget below the consumer's `max_deliver`, where the ID is
//! read, and the errors for a missing stream or dead-letter subject.

use std::time::{Duration, Instant};

use inbox_conformance::nats::{builder_on, Nats, Stream, ACK_WAIT};
use inbox_conformance::{TestBroker, TestQueue};
use inbox_core::{Ack, Consumer, IdFrom, MessageSource, Publish};
use inbox_nats::{Error, NatsConnection};
use inbox_testkit::{MemoryStore, Sum};

fn nats() -> NatsConnection {
    NatsConnection::new(inbox_conformance::nats::nats_url())
}

async fn stream(test: &str) -> Stream {
    Nats.queue(test).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_with_a_delay_keeps_the_message_away_for_the_delay() {
    let queue = stream("nack-delay").await;
    queue.send(Some("evt-1"), b"1").await;
    let mut source = builder_on(&nats(), &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap();
    let first = source.receive(10).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].message.meta.delivery_count, Some(1));
    assert!(!first[0].message.meta.redelivered);
    let nacked_at = Instant::now();
    let delivery = first.into_iter().next().unwrap();
    delivery
        .ack
        .nack(Duration::from_millis(1500))
        .await
        .unwrap();

    let mut again = Vec::new();
    while again.is_empty() {
        again = source.receive(10).await.unwrap();
        assert!(
            nacked_at.elapsed() < Duration::from_secs(10),
            "never came back"
        );
    }
    let waited = nacked_at.elapsed();
    assert!(
        waited >= Duration::from_millis(1400),
        "back after {waited:?}, before the 1.5 s delay"
    );
    let back = &again[0].message;
    assert_eq!(back.id.as_ref().unwrap().as_str(), "evt-1");
    assert_eq!(back.meta.delivery_count, Some(2));
    assert!(back.meta.redelivered);
    again.into_iter().next().unwrap().ack.ack().await.unwrap();
    assert_eq!(queue.left().await, 0);
    queue.cleanup().await;
}

/// "In progress" goes out every third of `ack_wait` for the deliveries a source holds; one that
/// reached the server after a delivery's `-NAK` with a delay would restart its `ack_wait` and
/// bring it back after `ack_wait` rather than the delay. Many deliveries handed back one by one
/// while the ticks run: none comes back before its delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_never_cuts_short_the_delay_of_a_message_handed_back() {
    const MESSAGES: usize = 400;
    const DELAY: Duration = Duration::from_secs(4);
    let queue = stream("progress-after-nak").await;
    for i in 0..MESSAGES {
        queue
            .send(Some(&format!("evt-{i}")), i.to_string().as_bytes())
            .await;
    }
    // ack_wait 300 ms: "in progress" every 100 ms while the deliveries are held.
    let mut source = builder_on(&nats(), &queue.name(), &queue.name())
        .ack_wait(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let held = inbox_testkit::receive(&mut source, MESSAGES, Duration::from_secs(20)).await;
    // Handed back one every 2 ms, 0.8 s in all: eight ticks fall among the hand-backs.
    let handing_back = Instant::now();
    let mut handed_back = tokio::task::JoinSet::new();
    for (i, delivery) in held.into_iter().enumerate() {
        handed_back.spawn(async move {
            tokio::time::sleep(Duration::from_millis(2) * u32::try_from(i).unwrap()).await;
            delivery.ack.nack(DELAY).await.unwrap();
        });
    }
    while let Some(done) = handed_back.join_next().await {
        done.unwrap();
    }
    // A message cut short comes back about ack_wait after its last "in progress", within about
    // 1.2 s of the first hand-back; one kept away, no sooner than the delay, 4 s.
    let mut early = Vec::new();
    let mut back = 0;
    while back < MESSAGES && handing_back.elapsed() < DELAY * 4 {
        for delivery in source.receive(MESSAGES).await.unwrap() {
            if handing_back.elapsed() < DELAY - Duration::from_secs(1) {
                early.push(delivery.message.id.clone().unwrap().to_string());
            }
            back += 1;
            delivery.ack.ack().await.unwrap();
        }
    }
    assert!(
        early.is_empty(),
        "{} of {MESSAGES} came back within {:?} of the first hand-back, before their \
         {DELAY:?} delay: {early:?}",
        early.len(),
        DELAY - Duration::from_secs(1)
    );
    assert_eq!(back, MESSAGES, "every message came back");
    assert_eq!(queue.left().await, 0);
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_running_past_ack_wait_keeps_its_message_while_in_progress_is_sent() {
    let queue = stream("in-progress").await;
    queue.send(Some("evt-1"), b"1").await;
    let connection = nats();
    let mut holder = builder_on(&connection, &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap();
    let held = holder.receive(1).await.unwrap();
    assert_eq!(held.len(), 1);

    // Another member polls for three times ack_wait: the server never hands the message over.
    let mut other = builder_on(&connection, &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap();
    let start = Instant::now();
    while start.elapsed() < ACK_WAIT * 3 {
        let stolen = other.receive(1).await.unwrap();
        assert!(
            stolen.is_empty(),
            "the message went to another member while held"
        );
    }
    held.into_iter().next().unwrap().ack.ack().await.unwrap();
    assert_eq!(queue.left().await, 0);

    // Without "in progress", the same hold loses the message to the other member.
    queue.send(Some("evt-2"), b"2").await;
    let mut silent = builder_on(&connection, &queue.name(), &queue.name())
        .progress(false)
        .connect()
        .await
        .unwrap();
    let lost = silent.receive(1).await.unwrap();
    assert_eq!(lost.len(), 1);
    let start = Instant::now();
    let mut taken = Vec::new();
    while taken.is_empty() && start.elapsed() < ACK_WAIT * 3 {
        taken = other.receive(1).await.unwrap();
    }
    assert_eq!(
        taken.len(),
        1,
        "the silent member kept its message past ack_wait"
    );
    assert_eq!(taken[0].message.meta.delivery_count, Some(2));
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_past_its_delivery_budget_is_dead_lettered_before_max_deliver_drops_it() {
    let queue = stream("max-deliver").await;
    queue.send(Some("evt-poison"), b"100").await;
    queue.send(Some("evt-ok"), b"5").await;
    let short = |queue: &Stream| {
        builder_on(&nats(), &queue.name(), &queue.name())
            .ack_wait(Duration::from_millis(500))
            .max_deliver(4)
    };
    // Two members die holding the poison message (received, never settled).
    for _ in 0..2 {
        let mut dying = short(&queue).connect().await.unwrap();
        let deliveries = dying.receive(1).await.unwrap();
        assert_eq!(
            deliveries[0].message.id.as_ref().unwrap().as_str(),
            "evt-poison"
        );
        drop((deliveries, dying));
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    // The third delivery is past a budget of 2, and below the consumer's max_deliver of 4.
    let store = MemoryStore::<i64>::new();
    let stats = Consumer::new(
        "max-deliver",
        short(&queue).connect().await.unwrap(),
        store.clone(),
        Sum,
    )
    .max_deliveries(2)
    .run_until_idle()
    .await
    .unwrap();
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(store.state().await, 5, "only the healthy message applied");
    let parked = queue.dead_letters().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].payload, b"100");
    assert!(parked[0].reason.contains("deliver"), "{}", parked[0].reason);
    assert_eq!(queue.left().await, 0);
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_writes_the_id_and_optionally_nats_msg_id_which_the_stream_deduplicates() {
    let queue = stream("producer").await;
    let plain = nats().producer().connect().await.unwrap();
    let id = plain.send(&queue.name(), b"1").await.unwrap();
    plain.send_with_id(&queue.name(), &id, b"1").await.unwrap();
    let deduplicating = nats().producer().message_id(true).connect().await.unwrap();
    let other = deduplicating.send(&queue.name(), b"2").await.unwrap();
    deduplicating
        .send_with_id(&queue.name(), &other, b"2")
        .await
        .unwrap();
    assert_eq!(
        queue.left().await,
        3,
        "the stream dropped the Nats-Msg-Id resend only"
    );

    // Read by the default header, and by JetStream's own ID header.
    let mut source = builder_on(&nats(), &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap();
    let ids: Vec<String> = source
        .receive(10)
        .await
        .unwrap()
        .iter()
        .map(|d| d.message.id.as_ref().unwrap().to_string())
        .collect();
    assert_eq!(ids, [id.to_string(), id.to_string(), other.to_string()]);
    queue.cleanup().await;

    let queue = stream("nats-msg-id").await;
    deduplicating.send(&queue.name(), b"3").await.unwrap();
    queue.send(Some("evt-no-msg-id"), b"4").await;
    let mut source = builder_on(&nats(), &queue.name(), &queue.name())
        .id_from(IdFrom::MessageIdProperty)
        .connect()
        .await
        .unwrap();
    let read = source.receive(10).await.unwrap();
    assert!(read[0].message.id.is_ok());
    let missing = read[1].message.id.as_ref().unwrap_err().to_string();
    assert_eq!(missing, "message has no ID: header Nats-Msg-Id is missing");
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_dead_letter_subject_or_address_fails_connect_naming_it() {
    let e = nats()
        .source("no-such-stream", "wallet")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::StreamMissing { .. }), "{e}");
    assert!(
        e.to_string().contains("`no-such-stream` does not exist"),
        "{e}"
    );

    let queue = stream("missing-dlq").await;
    let e = builder_on(&nats(), &queue.name(), &queue.name())
        .dead_letter_subject("nowhere.dlq")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::DeadLetterSubjectMissing { .. }), "{e}");
    assert!(e.to_string().contains("`nowhere.dlq`"), "{e}");
    let e = nats()
        .dead_letters("nowhere.dlq")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::DeadLetterSubjectMissing { .. }), "{e}");

    // Unfiltered, the consumer would read its own dead letters from the same stream.
    let e = nats()
        .source(queue.name(), "unfiltered")
        .dead_letter_subject(queue.dead_letter_subject())
        .connect()
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("would read its own dead letters"),
        "{e}"
    );
    queue.cleanup().await;

    let e = NatsConnection::new("nats://127.0.0.1:1")
        .operation_timeout(Duration::from_secs(1))
        .producer()
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Connect { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nats_url_connecting_fails_naming_it() {
    // Each test runs in a process of its own (nextest): the variable is this test's.
    std::env::remove_var("NATS_URL");
    let e = inbox_nats::NatsProducer::builder()
        .connect()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("NATS_URL is not set"), "{e}");
}

/// [`Sum`], 20 ms per message: a consumer stopped after a moment is caught mid-stream.
struct SlowSum;

impl inbox_core::Handler<inbox_testkit::MemoryTx<i64>> for SlowSum {
    async fn handle(
        &self,
        tx: &mut inbox_testkit::MemoryTx<i64>,
        _id: &inbox_core::MessageId,
        message: &inbox_core::Message,
    ) -> Result<(), inbox_core::HandlerError> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        *tx.state_mut() += message.json::<i64>()?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_stopped_mid_stream_leaves_the_rest_to_the_next_which_applies_each_once() {
    let queue = stream("shutdown").await;
    for i in 1..=50 {
        queue
            .send(Some(&format!("evt-{i}")), i.to_string().as_bytes())
            .await;
    }
    let store = MemoryStore::<i64>::new();
    let source = builder_on(&nats(), &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap();
    let first = Consumer::new("shutdown", source, store.clone(), SlowSum)
        .batch_size(5)
        .run_until(tokio::time::sleep(Duration::from_millis(400)))
        .await
        .unwrap();
    assert!(
        first.applied > 0 && first.applied < 50,
        "not stopped mid-stream: {first:?}"
    );

    // What the first held comes back: handed back at once, or after ack_wait where a pull was
    // cut short.
    let mut applied = first.applied;
    let start = Instant::now();
    while store.state().await < 1275 && start.elapsed() < Duration::from_secs(15) {
        let source = builder_on(&nats(), &queue.name(), &queue.name())
            .connect()
            .await
            .unwrap();
        let next = Consumer::new("shutdown", source, store.clone(), SlowSum)
            .batch_size(5)
            .run_until_idle()
            .await
            .unwrap();
        applied += next.applied;
    }
    assert_eq!(
        store.state().await,
        (1..=50).sum::<i64>(),
        "each credit once"
    );
    assert_eq!(applied, 50);
    assert_eq!(queue.left().await, 0);
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_count_kept_in_a_bucket_reaches_the_next_source_and_goes_when_acked() {
    let queue = stream("redelivery-bucket").await;
    let bucket = inbox_conformance::unique_name("inbox-test-redeliveries");
    let with_bucket =
        || builder_on(&nats(), &queue.name(), &queue.name()).redelivery_bucket(bucket.clone());
    queue.send(Some("evt-1"), b"1").await;
    let receive_one = |mut source: inbox_nats::NatsSource| async move {
        let start = Instant::now();
        loop {
            let mut got = source.receive(1).await.unwrap();
            if let Some(delivery) = got.pop() {
                return (source, delivery);
            }
            assert!(start.elapsed() < Duration::from_secs(10), "nothing came");
        }
    };

    // Handed back by one source, which then goes away (a restart, another member).
    let (first, delivery) = receive_one(with_bucket().connect().await.unwrap()).await;
    let message = delivery.message.clone();
    assert_eq!(message.meta.redeliveries, 0);
    delivery
        .ack
        .redeliver(&message, Duration::from_millis(300), 0)
        .await
        .unwrap();
    drop(first);
    let (next, back) = receive_one(with_bucket().connect().await.unwrap()).await;
    assert_eq!(back.message.id, message.id);
    assert_eq!(
        back.message.meta.redeliveries, 1,
        "the count reached the next source"
    );
    back.ack.ack().await.unwrap();
    drop(next);
    let store = queue.context().get_key_value(&bucket).await.unwrap();
    let sequence = message.meta.position.trim_start_matches("sequence ");
    let key = format!(
        "{}.{}.{sequence}",
        queue.name(),
        inbox_conformance::nats::CONSUMER
    );
    assert_eq!(
        store.get(key).await.unwrap(),
        None,
        "the count went with the ack"
    );

    // Without the bucket, the next source starts the schedule again.
    queue.send(Some("evt-2"), b"2").await;
    let (first, delivery) = receive_one(with_bucket().connect().await.unwrap()).await;
    let message = delivery.message.clone();
    delivery
        .ack
        .redeliver(&message, Duration::from_millis(300), 0)
        .await
        .unwrap();
    drop(first);
    let plain = builder_on(&nats(), &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap();
    let (_plain, back) = receive_one(plain).await;
    assert_eq!(back.message.id, message.id);
    assert_eq!(back.message.meta.redeliveries, 0);
    back.ack.ack().await.unwrap();
    queue.cleanup().await;
    queue.context().delete_key_value(&bucket).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_lanes_by_subject_each_subject_is_a_lane_and_parallel_lanes_apply_all_once() {
    let name = inbox_conformance::unique_name("inbox-test-lanes");
    let js = inbox_conformance::nats::context().await;
    js.create_stream(inbox_nats::async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let producer = nats().producer().connect().await.unwrap();
    for i in 1..=30 {
        let subject = format!("{name}.accounts.{}", i % 3);
        producer
            .send(&subject, i.to_string().as_bytes())
            .await
            .unwrap();
    }
    let lanes = |on| {
        nats()
            .source(name.clone(), "wallet")
            .filter_subject(format!("{name}.accounts.*"))
            .dead_letter_subject(format!("{name}.dlq"))
            .poll_timeout(Duration::from_millis(200))
            .lanes_by_subject(on)
    };
    let plain = lanes(false).connect().await.unwrap();
    assert!(!plain.capabilities().lanes());
    let mut source = lanes(true).connect().await.unwrap();
    assert!(source.capabilities().lanes());
    let peek = source.receive(3).await.unwrap();
    let seen: Vec<Option<String>> = peek.iter().map(|d| d.message.meta.lane.clone()).collect();
    assert_eq!(
        seen,
        (1..=3)
            .map(|i| Some(format!("{name}.accounts.{}", i % 3)))
            .collect::<Vec<_>>()
    );
    for delivery in peek {
        delivery.ack.nack(Duration::ZERO).await.unwrap();
    }

    let store = MemoryStore::<i64>::new();
    Consumer::new("lanes", source, store.clone(), Sum)
        .parallel_lanes(3)
        .batch_size(10)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(store.state().await, (1..=30).sum::<i64>());
    js.delete_stream(&name).await.unwrap();
}
