//! The crate's integration tests in one binary, a module per file: one link instead of one per
//! file (nextest still runs each test in a process of its own).

mod app_table_store;
mod batch_handler;
mod common_effects;
mod common_partitions;
mod effects_budgets;
mod effects_crashes;
mod effects_fencing;
mod effects_redis;
mod effects_stalls;
mod effects_store;
mod failover;
mod keys;
mod migration_sql;
mod outbox;
mod partition_convert;
mod partitions;
mod pgbouncer;
mod pipeline;
mod postgres_restart;
mod redaction;
mod retention;
mod scenarios;
mod sharding;
mod store_faults;
mod store_suite;
mod timeouts;
mod tls;
