//! Shared helpers for the RabbitMQ tests: random queues, publishing, reading queues back (the
//! conformance suite's, `inbox_conformance::rabbitmq`).
#![allow(dead_code, unused_imports, unreachable_pub)]

pub use inbox_conformance::rabbitmq::{
    admin_channel, amqp_url, cleanup, close_connection, close_pids, connection_pids, drain,
    fresh_config, fresh_config_on, left_on, passive_declare, publisher, Parked,
};
use inbox_conformance::wallet::CreditEvent;

pub fn credit(account_id: i64, amount: i64) -> Vec<u8> {
    CreditEvent::new(account_id, amount).to_json()
}
