//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod builders;
mod claim_zombie;
mod common;
// Starts a cluster of its own: needs `redis-server` and `redis-cli` on the PATH.
#[cfg(feature = "cluster")]
mod cluster;
mod conformance;
mod delayed_redelivery;
mod foreign_ids;
mod group_gone;
mod outbox_relay;
mod reconnect;
mod redaction;
mod scenarios;
mod shutdown;
mod source_behaviour;
#[cfg(feature = "tls")]
mod tls;
