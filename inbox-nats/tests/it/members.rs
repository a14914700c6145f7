//! Members of one durable consumer: the redelivery counts they share through a bucket, a
//! hand-back by a member that stops at once, and what a durable name taken by a consumer of
//! another kind does.

use std::time::{Duration, Instant};

use inbox_conformance::nats::{builder_on, Nats, CONSUMER};
use inbox_conformance::{TestBroker, TestQueue};
use inbox_core::{Ack, Delivery, MessageSource};
use inbox_nats::{Error, NatsAck, NatsConnection, NatsSource};

fn nats() -> NatsConnection {
    NatsConnection::new(inbox_conformance::nats::nats_url())
}

async fn receive_one(source: &mut NatsSource) -> Delivery<NatsAck> {
    let start = Instant::now();
    loop {
        if let Some(delivery) = source.receive(1).await.expect("receives").pop() {
            return delivery;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "nothing came");
    }
}

/// A member keeps the counts it handed back in memory too; one another member moved on since
/// (in the bucket) is the one that counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_in_the_bucket_goes_on_from_member_to_member_and_back() {
    let queue = Nats.queue("bucket-members").await;
    let bucket = inbox_conformance::unique_name("inbox-test-redeliveries");
    let member = || {
        builder_on(&nats(), &queue.name(), &queue.name())
            .redelivery_bucket(bucket.clone())
            .connect()
    };
    let mut a = member().await.unwrap();
    let mut b = member().await.unwrap();
    queue.send(Some("evt-1"), b"1").await;
    let delay = Duration::from_millis(300);

    let first = receive_one(&mut a).await;
    assert_eq!(first.message.meta.redeliveries, 0);
    first.ack.redeliver(&first.message, delay, 0).await.unwrap();
    let second = receive_one(&mut b).await;
    assert_eq!(second.message.meta.redeliveries, 1);
    second
        .ack
        .redeliver(&second.message, delay, 1)
        .await
        .unwrap();
    let third = receive_one(&mut a).await;
    assert_eq!(
        third.message.meta.redeliveries, 2,
        "the first member's own older count won over the bucket's"
    );
    third.ack.ack().await.unwrap();
    assert_eq!(queue.left().await, 0);
    queue.cleanup().await;
    queue.context().delete_key_value(&bucket).await.unwrap();
}

/// A member that hands a message back and stops at once (a consumer shutting down hands back
/// what it holds): the `-NAK` reaches the server, and the message comes to the next member
/// after the delay, not after `ack_wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_handed_back_by_a_member_that_stops_comes_to_the_next_after_the_delay() {
    let queue = Nats.queue("nak-then-stop").await;
    let member = || {
        builder_on(&nats(), &queue.name(), &queue.name())
            .ack_wait(Duration::from_secs(30))
            .connect()
    };
    queue.send(Some("evt-1"), b"1").await;
    // Three members in turn get it, hand it back for 100 ms and stop; within ack_wait, only
    // the -NAK brings it to the next (receive_one waits 10 s).
    for _ in 0..3 {
        let mut stopping = member().await.unwrap();
        let held = receive_one(&mut stopping).await;
        held.ack.nack(Duration::from_millis(100)).await.unwrap();
        drop(stopping);
    }
    let mut last = member().await.unwrap();
    let back = receive_one(&mut last).await;
    assert_eq!(back.message.meta.delivery_count, Some(4));
    back.ack.ack().await.unwrap();
    assert_eq!(queue.left().await, 0);
    queue.cleanup().await;
}

/// A push consumer under the durable name cannot be pulled from: retrying never helps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_consumer_under_the_durable_name_fails_connect_as_a_setting_to_fix() {
    use inbox_nats::async_nats::jetstream::consumer::{push, AckPolicy};
    let queue = Nats.queue("push-durable").await;
    let stream = queue.context().get_stream(queue.name()).await.unwrap();
    stream
        .create_consumer(push::Config {
            durable_name: Some(CONSUMER.to_owned()),
            deliver_subject: format!("{}.pushed", queue.name()),
            ack_policy: AckPolicy::Explicit,
            filter_subject: queue.name(),
            ..Default::default()
        })
        .await
        .unwrap();
    let e = builder_on(&nats(), &queue.name(), &queue.name())
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("push consumer"), "{e}");
    assert_eq!(e.recovery(), inbox_core::Recovery::Fatal);
    queue.cleanup().await;
}

/// A stream name may hold what a key in a bucket may not (`:`, `@`): the count still goes from
/// member to member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_in_the_bucket_is_kept_for_a_stream_whose_name_is_no_key() {
    let name = format!("{}:v2", inbox_conformance::unique_name("inbox-test-odd"));
    let js = inbox_conformance::nats::context().await;
    js.create_stream(inbox_nats::async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec!["odd-name-credits.*".replace('*', &name.replace(':', "-"))],
        ..Default::default()
    })
    .await
    .unwrap();
    let subject = format!("odd-name-credits.{}", name.replace(':', "-"));
    let bucket = inbox_conformance::unique_name("inbox-test-redeliveries");
    let dlq = inbox_conformance::unique_name("inbox-test-odd-dlq");
    js.create_stream(inbox_nats::async_nats::jetstream::stream::Config {
        name: dlq.clone(),
        subjects: vec![format!("{dlq}.dlq")],
        ..Default::default()
    })
    .await
    .unwrap();
    let member = || {
        nats()
            .source(name.clone(), "wallet")
            .dead_letter_subject(format!("{dlq}.dlq"))
            .poll_timeout(Duration::from_millis(200))
            .redelivery_bucket(bucket.clone())
            .connect()
    };
    let producer = nats().producer().connect().await.unwrap();
    inbox_core::Publish::send(&producer, &subject, b"1")
        .await
        .unwrap();
    let mut a = member().await.unwrap();
    let first = receive_one(&mut a).await;
    first
        .ack
        .redeliver(&first.message, Duration::from_millis(300), 0)
        .await
        .unwrap();
    drop(a);
    let mut b = member().await.unwrap();
    let back = receive_one(&mut b).await;
    assert_eq!(
        back.message.meta.redeliveries, 1,
        "the count reached the next member"
    );
    back.ack.ack().await.unwrap();
    js.delete_stream(&name).await.unwrap();
    js.delete_stream(&dlq).await.unwrap();
    js.delete_key_value(&bucket).await.unwrap();
}
