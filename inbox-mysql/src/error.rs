//! Errors of the MySQL store, and what the consumer does after each.

use inbox_core::Recovery;

/// What went wrong in the MySQL inbox store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database or table name that is not a plain SQL identifier. Names are quoted into SQL,
    /// so only plain identifiers are accepted.
    #[error("{what} name `{name}` is not a plain SQL identifier (a letter or `_`, then letters, digits or `_`, at most 64 bytes)")]
    InvalidIdentifier {
        /// `database` or `table`.
        what: &'static str,
        /// The refused name.
        name: String,
    },
    /// A table name so long that `<table>_consumers` would be over MySQL's limit of 64 bytes.
    #[error("table name `{name}` is too long: `{name}_consumers` would be over MySQL's limit of 64 bytes for identifiers; use a table name of at most {max} bytes", max = crate::TableName::MAX_LEN)]
    TableNameTooLong {
        /// The refused name.
        name: String,
    },
    /// The inbox table exists with another key type than configured.
    #[error("inbox table {table} keeps message IDs as `{found}`, but the store is configured for {expected:?}; use that key mode or another table")]
    KeyModeMismatch {
        /// The table.
        table: String,
        /// The column type found.
        found: String,
        /// The configured mode.
        expected: crate::KeyMode,
    },
    /// Another instance held the migration lock of this table for a minute.
    #[error("the migration lock of inbox table {table} was not granted within 60 s: another instance is migrating it, or a session holds `GET_LOCK('inbox migrate {table}')`")]
    MigrationLocked {
        /// The table.
        table: String,
    },
    /// The consumers table handed out an id outside `smallint`: 32,767 consumer names.
    #[error("consumer `{name}` got id {id} in {table}, over the 32,767 consumer names it holds; remove names no longer used")]
    TooManyConsumers {
        /// The consumer's name.
        name: String,
        /// The id it got.
        id: u64,
        /// The consumers table.
        table: String,
    },
    /// The database failed.
    #[error("database error while {context}: {source}")]
    Database {
        /// What was being done.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

inbox_core::sqlx_store_errors!(database_recovery);

/// MySQL's error number of `e`, for a database error.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    let d = e.as_database_error()?;
    d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .map(|m| m.number())
}

/// `ER_DUP_ENTRY`: the claim's key is there already.
pub(crate) const DUPLICATE_KEY: u16 = 1062;
/// `ER_LOCK_DEADLOCK`: InnoDB rolled the whole transaction back.
pub const DEADLOCK: u16 = 1213;
/// `ER_LOCK_WAIT_TIMEOUT`: a row lock was not granted within `innodb_lock_wait_timeout`; the
/// statement (and with `innodb_rollback_on_timeout`, the transaction) was rolled back.
pub const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// What the consumer should do after the database error `e`.
///
/// - `Retry`: this transaction failed and another attempt may pass: a deadlock ([`DEADLOCK`],
///   1213) or a lock wait timeout ([`LOCK_WAIT_TIMEOUT`], 1205), a statement cut off by a time
///   limit, a constraint or bad data. The consumer finds the message that fails and retries it
///   alone.
/// - `Reconnect`: the server cannot be reached or cannot work right now (connection lost or
///   killed, server shutting down, too many connections, out of memory or disk): nothing about
///   the messages; the consumer holds them and tries again. A commit cut off this way has an
///   unknown outcome: the redelivery finds the claim if it committed, and applies the message
///   if it did not.
/// - `Fatal`: a missing table, column or database, no privilege: run the migration or fix the
///   grants.
fn database_recovery(e: &sqlx::Error) -> Recovery {
    match number(e) {
        // No such table, column or database; access denied (to the server, a database, a
        // table, a column).
        Some(1146 | 1054 | 1049 | 1044 | 1045 | 1142 | 1143) => Recovery::Fatal,
        // Too many connections, out of memory, disk full, server shutdown, aborted
        // connection, network read/write errors, connection killed, server has gone away,
        // lost connection.
        Some(
            1040 | 1041 | 1021 | 1053 | 1077 | 1152 | 1153 | 1154 | 1155 | 1156 | 1157 | 1158
            | 1159 | 1160 | 1161 | 1927 | 2002 | 2003 | 2006 | 2013,
        ) => Recovery::Reconnect,
        _ => Recovery::Retry,
    }
}
