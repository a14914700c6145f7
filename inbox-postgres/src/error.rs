//! Errors of the Postgres store.

use inbox_core::Recovery;

/// What went wrong in the Postgres inbox store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A schema or table name that is not a plain SQL identifier. Names are quoted into SQL, so
    /// only plain identifiers are accepted.
    #[error("{what} name `{name}` is not a plain SQL identifier (a letter or `_`, then letters, digits or `_`, at most 63 bytes)")]
    InvalidIdentifier {
        /// `schema` or `table`.
        what: &'static str,
        /// The refused name.
        name: String,
    },
    /// A table name so long that a name the store derives from it would be over PostgreSQL's
    /// limit of 63 bytes, which PostgreSQL would cut short silently.
    #[error("table name `{name}` is too long for the names derived from it: `{derived}` would be {bytes} bytes, over PostgreSQL's limit of 63 for identifiers (it would be cut short silently); use a table name of at most {max} bytes", max = crate::TableName::MAX_LEN)]
    TableNameTooLong {
        /// The refused name.
        name: String,
        /// The longest name derived from it.
        derived: String,
        /// Its length in bytes.
        bytes: usize,
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
    /// An outbox message's header value is not UTF-8: the outbox keeps headers as JSON text.
    #[error("header `{name}` of outbox message {id} is not UTF-8 text, and the outbox keeps headers as JSON text; encode the value (base64, hex) before writing it")]
    HeaderNotText {
        /// The message's ID.
        id: String,
        /// The header's name.
        name: String,
    },
    /// PostgreSQL is reached through a transaction pooler (PgBouncer with `pool_mode =
    /// transaction`) while the pool's connections cache prepared statements, which live in one
    /// server session when the pooler hands each transaction to any, and the pooler does not
    /// carry them to the next session.
    #[error("PostgreSQL is reached through a transaction pooler (such as PgBouncer with pool_mode = transaction) and this pool's connections cache prepared statements, which would fail or run under another client's statement name in the next transaction's server session; add `statement-cache-capacity=0` to the database URL (or set `PgConnectOptions::statement_cache_capacity(0)`), or let the pooler carry prepared statements (PgBouncer 1.21 or later: `max_prepared_statements`)")]
    StatementCacheBehindPooler,
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

/// What the consumer should do after the database error `e`.
///
/// - `Reconnect`: the database cannot work right now (connection exception, server shutting
///   down or starting, out of connections, disk or memory): nothing about the messages, so the
///   consumer holds them and tries again.
/// - `Fatal`: a missing table or column, no privilege, no schema: run the migrations or fix the
///   grants.
/// - `Retry`: this transaction failed (a constraint, bad data, an aborted transaction, a deadlock
///   or serialization failure): the consumer finds the message that fails and retries it alone.
fn database_recovery(e: &sqlx::Error) -> Recovery {
    match e.as_database_error().and_then(|db| db.code()).as_deref() {
        // 26000, 42P05: a prepared statement missing or already there, which a transaction
        // pooler in front of a pool that caches statements causes (see `pooling.rs`).
        Some("42P01" | "42703" | "42501" | "3F000" | "26000" | "42P05") => Recovery::Fatal,
        // 08: connection exception; 53: insufficient resources; 58: system error;
        // 57P01-57P03: admin shutdown, crash shutdown, cannot connect now.
        Some(code)
            if code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("58")
                || matches!(code, "57P01" | "57P02" | "57P03") =>
        {
            Recovery::Reconnect
        }
        _ => Recovery::Retry,
    }
}
