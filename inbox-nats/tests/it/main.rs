//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod conformance;
mod dead_letters;
mod foreign_ids;
mod logins;
mod members;
mod silent_server;
mod source_behaviour;
