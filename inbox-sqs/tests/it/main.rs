//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod builders;
mod common;
mod conformance;
mod credentials;
mod dead_letters;
mod foreign_ids;
mod metadata;
mod outbox_relay;
mod redaction;
mod redelivery;
mod replay;
mod scenarios;
mod strict_order;
mod visibility;
