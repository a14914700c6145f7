//! What a hand-back costs against the quorum queue's `x-delivery-limit`.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::*;
use inbox_core::{Ack, Delivery, MessageSource, Publish};
use inbox_rabbitmq::{RabbitAck, RabbitSource};

async fn receive_one(source: &mut RabbitSource) -> Delivery<RabbitAck> {
    for _ in 0..40 {
        match source.receive(1).await {
            Ok(mut batch) => {
                if let Some(delivery) = batch.pop() {
                    return delivery;
                }
            }
            Err(e) => println!("receive: {e}"),
        }
    }
    panic!("the message did not come back");
}

/// A hand-back (a nack, as after a store error) raises the count by at most one, and so does a
/// connection lost while a delayed nack waits: the late nack cannot count a second time.
#[tokio::test]
async fn a_hand_back_costs_at_most_one_delivery_count() {
    let config = fresh_config("count");
    let publisher = publisher(&config).await;
    publisher
        .send(config.queue(), b"handed back")
        .await
        .unwrap();
    let mut source = config.clone().connect().await.unwrap();

    let first = receive_one(&mut source).await;
    let first_count = first.message.meta.delivery_count;
    first.ack.nack(Duration::ZERO).await.unwrap();

    let second = receive_one(&mut source).await;
    let nacked_count = second.message.meta.delivery_count;
    // Listed before the nack, so that only the close (one rabbitmqctl call) runs while the
    // delayed nack waits: a nack firing before the close would be a second, real hand-back.
    let pids = connection_pids(&config.effective_connection_name()).await;
    let nack_delay = Duration::from_secs(5);
    let nacked_at = tokio::time::Instant::now();
    second.ack.nack(nack_delay).await.unwrap();
    close_pids(&pids).await;
    assert!(
        nacked_at.elapsed() < nack_delay,
        "the connection was closed {:?} after the nack, too late to test a late nack",
        nacked_at.elapsed()
    );

    let third = receive_one(&mut source).await;
    let lost_count = third.message.meta.delivery_count;
    // The delayed nack fires on the closed channel and goes nowhere.
    tokio::time::sleep_until(nacked_at + nack_delay + Duration::from_secs(1)).await;
    third.ack.ack().await.unwrap();
    source.close().await;
    println!(
        "delivery counts: first {first_count:?}, after a nack {nacked_count:?}, \
         after a connection loss {lost_count:?}"
    );
    assert_eq!(first_count, Some(1));
    // A broker that does not report the count cannot over-count.
    let nacked = nacked_count.unwrap_or(1);
    let lost = lost_count.unwrap_or(nacked);
    assert!(nacked <= 2, "a nack counted {} times", nacked - 1);
    assert!(
        lost <= nacked + 1,
        "a connection loss counted {} times",
        lost - nacked
    );
    assert_eq!(left_on(config.queue()).await, 0);
    cleanup(&config).await;
}
