//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod algorithm;
mod batch_handler;
mod duplicate_entries;
mod effect_logs;
mod metrics;
mod probes;
mod redelivery;
mod sharding;
mod spans;
mod strict_order;
