//! The simulated brokers, each with its broker's rules: [`kafka`] a consumer group over
//! partitions, [`basic`] SQS (FIFO and standard), a RabbitMQ queue and a Redis stream.

pub mod basic;
pub mod kafka;
pub(crate) mod sqs;
