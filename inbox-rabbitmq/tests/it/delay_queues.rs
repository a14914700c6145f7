//! The delay queues of a redelivery schedule, over a real broker.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::*;
use inbox_core::{Ack, Delivery, MessageSource, Publish};
use inbox_rabbitmq::lapin::options::QueueDeleteOptions;
use inbox_rabbitmq::{RabbitAck, RabbitSource};

const DELAY: Duration = Duration::from_millis(200);

async fn receive_one(source: &mut RabbitSource) -> Delivery<RabbitAck> {
    for _ in 0..40 {
        if let Some(delivery) = source.receive(1).await.unwrap().pop() {
            return delivery;
        }
    }
    panic!("no message came");
}

/// Hands `delivery` back for its first redelivery and waits for the copy.
async fn delayed_once(source: &mut RabbitSource, delivery: Delivery<RabbitAck>) -> u32 {
    let Delivery { message, ack } = delivery;
    ack.redeliver(&message, DELAY, 0)
        .await
        .expect("handed back to the delay queue");
    let copy = receive_one(source).await;
    assert_eq!(copy.message.id, message.id);
    let n = copy.message.meta.redeliveries;
    copy.ack.ack().await.unwrap();
    n
}

/// A delay queue deleted while the consumer runs (an operator's cleanup, a policy) is declared
/// again at the next hand-back to it: the message comes back after its delay, instead of every
/// hand-back of that step failing as unroutable until the process restarts.
#[tokio::test]
async fn a_delay_queue_deleted_while_consuming_is_declared_again() {
    let config = fresh_config("delay-gone");
    let publisher = publisher(&config).await;
    let mut source = config.clone().connect().await.unwrap();

    publisher.send(config.queue(), b"first").await.unwrap();
    let first = receive_one(&mut source).await;
    assert_eq!(delayed_once(&mut source, first).await, 1);

    let (_connection, channel) = admin_channel().await;
    let delay_queue = format!("{}.delay.0", config.queue());
    channel
        .queue_delete(delay_queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();

    publisher.send(config.queue(), b"second").await.unwrap();
    let second = receive_one(&mut source).await;
    let Delivery { message, ack } = second;
    let handed_back = ack.redeliver(&message, DELAY, 0).await;
    println!("hand-back after the delay queue was deleted: {handed_back:?}");
    handed_back.expect("the delay queue is declared again and takes the copy");
    let copy = receive_one(&mut source).await;
    assert_eq!(copy.message.id, message.id);
    assert_eq!(copy.message.meta.redeliveries, 1);
    copy.ack.ack().await.unwrap();

    source.close().await;
    assert_eq!(left_on(config.queue()).await, 0);
    cleanup(&config).await;
}
