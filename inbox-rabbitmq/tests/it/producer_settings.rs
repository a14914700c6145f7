//! The producer's connection settings are checked as the source's are.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common::amqp_url;
use inbox_rabbitmq::RabbitConnection;

/// `heartbeat(0)` would ask the broker for no heartbeat at all, and `operation_timeout(0)` fail
/// every connect: the producer refuses both with the source's message, which names the fix.
#[tokio::test]
async fn the_producer_refuses_what_the_source_refuses_with_the_same_message() {
    let broker = RabbitConnection::new(amqp_url());
    for (setting, connection) in [
        ("heartbeat(0)", broker.clone().heartbeat(Duration::ZERO)),
        (
            "operation_timeout(0)",
            broker.operation_timeout(Duration::ZERO),
        ),
    ] {
        let source = connection.source("never-declared").connect().await;
        let expected = source.err().unwrap().to_string();
        let refused = match connection.producer().connect().await {
            Ok(_) => panic!("the producer connected with {setting}"),
            Err(e) => e.to_string(),
        };
        assert_eq!(refused, expected, "{setting}");
    }
}
