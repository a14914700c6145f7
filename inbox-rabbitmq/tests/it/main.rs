//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod alarm;
mod broker_restart;
mod builders;
mod common;
mod conformance;
mod connection_loss;
mod delay_queues;
mod delivery_count;
mod exchanges;
mod foreign_ids;
mod metadata;
mod outbox_relay;
mod producer_settings;
mod scenarios;
mod silent_broker;
#[cfg(feature = "tls")]
mod tls;
mod topology;
