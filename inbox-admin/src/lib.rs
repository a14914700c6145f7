//! The library half of `inbox-admin`: the progress display of its long commands, which the
//! workspace's evidence tool shows its runs with too. The operator CLI itself is the binary;
//! `inbox-admin --help` lists its commands.

pub mod progress;
