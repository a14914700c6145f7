//! A server that stops answering: the client queues what the source sends while it tries to
//! connect again, and once its queue is full every send waits for the server. Settling a
//! delivery and receiving still return, each within about the operation timeout.

use std::time::Duration;

use inbox_conformance::nats::{builder_on, nats_url, Nats};
use inbox_conformance::{FaultProxy, ProxyMode, TestBroker, TestQueue};
use inbox_core::{Ack, MessageSource};
use inbox_nats::{NatsAck, NatsConnection};

/// Far above what settling takes with a 1 s operation timeout, far below "for good".
const BOUND: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_and_receiving_return_while_the_server_is_silent() {
    const MESSAGES: usize = 100;
    let queue = Nats.queue("silent-settle").await;
    for i in 0..MESSAGES {
        queue.send(Some(&format!("evt-{i}")), b"1").await;
    }
    let (proxy, through) = FaultProxy::in_front_of_url(&nats_url(), 4222)
        .await
        .unwrap();
    let connection = NatsConnection::new(through)
        .operation_timeout(Duration::from_secs(1))
        .ping_interval(Duration::from_millis(500));
    // ack_wait 300 ms: "in progress" for each held delivery every 100 ms, 1,000 a second.
    let mut source = builder_on(&connection, &queue.name(), &queue.name())
        .ack_wait(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let held = inbox_testkit::receive(&mut source, MESSAGES, Duration::from_secs(20)).await;

    proxy.set_mode(ProxyMode::Blackhole);
    // The connection is given up after two missed pings; the client's queue of 2,048 commands
    // fills with "in progress" while it tries to connect again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut held = held.into_iter();

    let nacked =
        tokio::time::timeout(BOUND, held.next().unwrap().ack.nack(Duration::from_secs(1))).await;
    assert!(nacked.is_ok(), "a nack still waited after {BOUND:?}");
    let acked = tokio::time::timeout(BOUND, held.next().unwrap().ack.ack()).await;
    assert!(
        matches!(acked, Ok(Err(_))),
        "an ack still waited after {BOUND:?}, or succeeded: {acked:?}"
    );
    // Twenty more acks fail, to be sent again by the next receive or "in progress" tick.
    let batch: Vec<_> = held.by_ref().take(20).map(|d| d.ack).collect();
    let acked = tokio::time::timeout(BOUND, NatsAck::ack_all(batch)).await;
    assert!(
        matches!(acked, Ok(Err(_))),
        "a batch's acks still waited after {BOUND:?}, or succeeded: {acked:?}"
    );
    let message = held.next().unwrap();
    let parked = tokio::time::timeout(
        BOUND,
        message.ack.dead_letter(&message.message, "silent test"),
    )
    .await;
    assert!(
        matches!(parked, Ok(Err(_))),
        "a dead letter still waited after {BOUND:?}, or succeeded: {parked:?}"
    );
    // The first receive reports the lost connection; the next ones send the failed ack again
    // and pull, and fail in time too.
    for _ in 0..3 {
        let received = tokio::time::timeout(BOUND, source.receive(10)).await;
        assert!(
            matches!(received, Ok(Err(_))),
            "a receive still waited after {BOUND:?}, or succeeded"
        );
    }
    drop(held);
    drop(proxy);
    queue.cleanup().await;
}
