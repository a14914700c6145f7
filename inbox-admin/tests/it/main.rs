//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod cli;
mod common;
mod dead_letters;
mod json_and_progress;
// The brokers' TLS tests: the CLI is built with their TLS support.
#[cfg(all(feature = "kafka", feature = "rabbitmq", feature = "redis"))]
mod tls;
