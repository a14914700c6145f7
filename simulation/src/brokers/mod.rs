//! The simulated brokers, each with its broker's rules and the adapter's own bookkeeping:
//! [`kafka`] a consumer group over partitions under the Kafka adapter's own tracker, `sqs` SQS
//! (FIFO and standard) under the SQS adapter's own decisions, `redis` a Redis stream under the
//! adapter's own sweep, `rabbitmq` a RabbitMQ quorum queue with its delay queues under the
//! RabbitMQ adapter's own redelivery rules and unsettled tags.

use rand::rngs::StdRng;
use rand::RngExt;

use crate::broker::Broker;

pub mod kafka;
pub(crate) mod rabbitmq;
pub(crate) mod redis;
pub(crate) mod sqs;

/// The broker a seed runs on.
pub(crate) struct Picked {
    pub(crate) broker: Box<dyn Broker>,
    /// Its ordering lanes (1: none).
    pub(crate) lanes: usize,
    pub(crate) name: &'static str,
    /// Whether a lane with a message in flight gives out nothing more (SQS FIFO groups).
    pub(crate) groups_lock: bool,
}

/// Draws a broker.
pub(crate) fn pick(rng: &mut StdRng) -> Picked {
    let brokers: &[fn() -> Picked] = &[
        || Picked {
            broker: Box::new(kafka::Kafka::new()),
            lanes: 3,
            name: "Kafka",
            groups_lock: false,
        },
        || Picked {
            broker: Box::new(sqs::Sqs::new(true)),
            lanes: sqs::Sqs::lanes(true),
            name: "SQS FIFO",
            groups_lock: true,
        },
        || Picked {
            broker: Box::new(sqs::Sqs::new(false)),
            lanes: sqs::Sqs::lanes(false),
            name: "SQS standard",
            groups_lock: false,
        },
        || Picked {
            broker: Box::new(rabbitmq::RabbitMq::new()),
            lanes: 1,
            name: "RabbitMQ",
            groups_lock: false,
        },
        || Picked {
            broker: Box::new(redis::Redis::new()),
            lanes: 1,
            name: "Redis Streams",
            groups_lock: false,
        },
    ];
    brokers[rng.random_range(0..brokers.len())]()
}
