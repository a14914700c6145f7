//! A broker that accepts the TCP connection and then says nothing: the producer gives up
//! after its operation timeout instead of waiting for good.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common::amqp_url;
use inbox_conformance::{FaultProxy, ProxyMode};
use inbox_core::Publish;
use inbox_rabbitmq::{Error, RabbitConnection};

const TIMEOUT: Duration = Duration::from_secs(1);
/// Far longer than `TIMEOUT`: past it the call hangs.
const HUNG: Duration = Duration::from_secs(15);

#[tokio::test]
async fn connecting_to_a_silent_broker_fails_within_the_operation_timeout() {
    // Accepts every connection and answers nothing.
    let (proxy, through) = FaultProxy::in_front_of_url(&amqp_url(), 5672)
        .await
        .unwrap();
    proxy.set_mode(ProxyMode::Blackhole);
    let producer = RabbitConnection::new(through)
        .operation_timeout(TIMEOUT)
        .producer();
    let connecting = tokio::time::timeout(HUNG, producer.connect()).await;
    match connecting {
        Err(_) => panic!("connect still waited after {HUNG:?}"),
        Ok(Ok(_)) => panic!("connected to a listener that answers nothing"),
        Ok(Err(e)) => assert!(matches!(e, Error::ConnectTimeout { .. }), "{e}"),
    }
}

#[tokio::test]
async fn reconnecting_to_a_silent_broker_on_send_fails_within_the_operation_timeout() {
    let (proxy, producer) = producer_behind_a_silent_network().await;
    // The connection is cut, and the broker then accepts new ones but says nothing.
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sending = tokio::time::timeout(HUNG, producer.send("never-declared", b"{}")).await;
    match sending {
        Err(_) => panic!("the send still waited after {HUNG:?}"),
        Ok(Ok(_)) => panic!("sent through a broker that answers nothing"),
        Ok(Err(e)) => assert!(format!("{e:?}").contains("ConnectTimeout"), "{e:?}"),
    }
}

/// A producer connected through `proxy`, which then passes nothing either way.
async fn producer_behind_a_silent_network() -> (FaultProxy, inbox_rabbitmq::RabbitProducer) {
    let (proxy, through) = FaultProxy::in_front_of_url(&amqp_url(), 5672)
        .await
        .unwrap();
    let producer = RabbitConnection::new(through)
        .operation_timeout(TIMEOUT)
        .producer()
        .connect()
        .await
        .unwrap();
    proxy.set_mode(ProxyMode::Blackhole);
    (proxy, producer)
}

#[tokio::test]
async fn a_send_whose_confirm_never_comes_fails_within_the_operation_timeout() {
    let (_proxy, producer) = producer_behind_a_silent_network().await;
    let sending = tokio::time::timeout(HUNG, producer.send("never-declared", b"{}")).await;
    match sending {
        Err(_) => panic!("the send still waited for its confirm after {HUNG:?}"),
        Ok(Ok(_)) => panic!("a send was confirmed through a network that passes nothing"),
        Ok(Err(e)) => assert!(format!("{e:?}").contains("ConfirmTimeout"), "{e:?}"),
    }
}

#[tokio::test]
async fn closing_a_producer_whose_broker_went_silent_ends_within_the_operation_timeout() {
    let (_proxy, producer) = producer_behind_a_silent_network().await;
    let closing = tokio::time::timeout(HUNG, producer.close()).await;
    assert!(closing.is_ok(), "close still waited after {HUNG:?}");
}
