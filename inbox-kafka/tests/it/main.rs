//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod builders;
mod commits;
mod common;
mod compression;
mod conformance;
mod dead_letter_replay;
mod dead_letter_topic;
mod foreign_ids;
mod metadata;
mod mock;
mod mock_cluster;
mod outbox_relay;
mod parallel;
mod rebalance;
mod redelivery_rebalance;
// TLS, SASL and OAUTHBEARER need librdkafka built with OpenSSL (the feature `tls`).
#[cfg(feature = "tls")]
mod sasl;
mod scenarios;
mod strict_order;
#[cfg(feature = "tls")]
mod tls;
#[cfg(feature = "tls")]
mod token_provider;
