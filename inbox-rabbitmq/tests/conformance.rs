//! The conformance suite (`inbox-conformance`) on a real RabbitMQ quorum queue.

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::*;
use inbox_conformance::{async_trait, DeadLetter, TestBroker, TestQueue};
use inbox_core::dead_letter::REASON;
use inbox_rabbitmq::lapin::BasicProperties;
use inbox_rabbitmq::{RabbitProducer, RabbitSource, RabbitSourceBuilder};

struct Rabbit;

/// A quorum queue of its own; its dead letters go to `<queue>.dlq`.
struct Queue {
    config: RabbitSourceBuilder,
    publisher: RabbitProducer,
    /// What `dead_letters` took off the DLQ so far.
    parked: Mutex<Vec<DeadLetter>>,
}

#[async_trait]
impl TestBroker for Rabbit {
    type Queue = Queue;
    async fn queue(&self, scenario: &str) -> Queue {
        self.attach(fresh_config(scenario).queue()).await
    }

    async fn attach(&self, name: &str) -> Queue {
        let config = RabbitSource::builder(name)
            .url(amqp_url())
            .poll_timeout(Duration::from_millis(200));
        Queue {
            publisher: publisher(&config).await, // declares the queue and its DLQ
            config,
            parked: Mutex::default(),
        }
    }
}

#[async_trait]
impl TestQueue for Queue {
    type Source = RabbitSource;

    fn counts_deliveries(&self) -> bool {
        true // the quorum queue's x-delivery-count
    }

    fn name(&self) -> String {
        self.config.queue().to_owned()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        let props = match id {
            Some(id) => BasicProperties::default().with_message_id(id.into()),
            None => BasicProperties::default(),
        };
        self.publisher
            .publish_with_properties(self.config.queue(), payload, props)
            .await
            .expect("publish");
    }

    async fn source(&self, member: &str) -> RabbitSource {
        // Members share the queue; the name only tells their connections apart on the broker.
        let config = self.config.clone().connection_name(format!(
            "inbox-conformance {} {member}",
            self.config.queue()
        ));
        config.connect().await.expect("connect source")
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        let taken = drain(&self.config.dead_letter_queue()).await;
        let mut parked = self.parked.lock().expect("parked");
        parked.extend(taken.into_iter().map(|p| {
            DeadLetter {
                // A message the broker parked (x-delivery-limit) has no reason of the consumer's.
                reason: p
                    .header(REASON)
                    .or_else(|| p.header("x-first-death-reason"))
                    .unwrap_or_default(),
                payload: p.body,
            }
        }));
        parked.clone()
    }

    async fn left(&self) -> u64 {
        // Ready messages once no consumer holds any: unacked ones are back in the queue by then.
        left_on(self.config.queue()).await.into()
    }

    async fn cleanup(&self) {
        cleanup(&self.config).await;
    }
}

inbox_conformance::suite!(Rabbit);
