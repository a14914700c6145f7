//! What the SQL stores share: how they keep message IDs ([`KeyMode`], [`hashed_key`],
//! [`uuid_key`], [`primary_key`]) and claim them ([`claim_keys`], [`first_claims`]), which names
//! they accept to quote into SQL ([`is_plain_identifier`]), the consumer a bound store claims for
//! ([`BoundConsumer`]), how a migration script is printed ([`push_statements`]) and the errors of
//! a store on sqlx (`sqlx_store_errors!`). Each store's docs say which column type each mode
//! takes there.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::hash::Hash;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{InvalidId, MessageId, OperationError, Recovery, RefusedId, StoreError};

/// The consumer a bound SQL store claims for ([`InboxStore::bind`](crate::InboxStore::bind)):
/// its name, and the small integer standing for it in the store's table of consumers, read (or
/// registered) once, at the store's first `begin`, before the transaction opens.
#[derive(Debug)]
pub struct BoundConsumer {
    name: String,
    id: OnceLock<i16>,
}

impl BoundConsumer {
    /// The consumer `name`, its id not read yet.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            id: OnceLock::new(),
        }
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its id, once [`BoundConsumer::set_id`] was called.
    pub fn id(&self) -> Option<i16> {
        self.id.get().copied()
    }

    /// Records its id; a second call (a lane that raced to read it) changes nothing.
    pub fn set_id(&self, id: i16) {
        let _ = self.id.set(id);
    }

    /// The name and id a claim uses; a store not bound, or whose first `begin` has not read the
    /// id, fails the claim with [`Recovery::Fatal`] saying so.
    pub fn for_claim(bound: Option<&Self>) -> Result<(&str, i16), StoreError> {
        match bound.and_then(|b| Some((b.name.as_str(), b.id()?))) {
            Some(found) => Ok(found),
            None => Err(OperationError::new(
                Recovery::Fatal,
                "claiming message IDs",
                "the store is not bound to a consumer: claims go through a Consumer, or through \
                 InboxStore::bind and then begin",
            )),
        }
    }
}

/// How a store keeps message IDs. Not `#[non_exhaustive]`: the stores match it exhaustively, so
/// a new mode is one every store takes up at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyMode {
    /// The ID verbatim, compared byte for byte: any ID the core accepts, at the price of its
    /// length per row and in the index.
    #[default]
    Text,
    /// The ID parsed as a UUID, kept as 16 bytes. IDs that are not UUIDs are refused (and
    /// dead-lettered). UUIDv7 IDs (what this project's producer helpers send) keep the index
    /// append-only.
    Uuid,
    /// Any ID, kept as 16 bytes: its [`hashed_key`]. Two different IDs collide with probability
    /// about n²/2¹²⁹ among n remembered IDs (below 10⁻²² at 190 million), and a collision can
    /// only make a message be skipped as a duplicate. The original ID is not stored. The keys
    /// are random, so inserts land all over the index.
    Hashed,
}

/// The key of `id` for `consumer` in [`KeyMode::Hashed`]: the first 128 bits of SHA-256 over
/// the consumer name, a zero byte and the ID. Every store computes the same key.
pub fn hashed_key(consumer: &str, id: &str) -> [u8; 16] {
    let digest = Sha256::new()
        .chain_update(consumer)
        .chain_update([0])
        .chain_update(id)
        .finalize();
    std::array::from_fn(|i| digest[i])
}

/// The key of `id` in [`KeyMode::Uuid`]: the ID parsed as a UUID, or refused with the fix.
pub fn uuid_key(id: &MessageId) -> Result<Uuid, InvalidId> {
    Uuid::parse_str(id.as_str()).map_err(|_| {
        InvalidId::RefusedByStore(format!(
            "`{}` is not a UUID, and this inbox keeps UUID keys (use KeyMode::Text or KeyMode::Hashed for other IDs)",
            id.escaped()
        ))
    })
}

/// The key `key` makes of each of `ids`; an ID it refuses fails the claim with [`RefusedId`] at
/// that ID's index, before the store writes anything.
pub fn claim_keys<K>(
    ids: &[MessageId],
    mut key: impl FnMut(&MessageId) -> Result<K, InvalidId>,
) -> Result<Vec<K>, StoreError> {
    ids.iter()
        .enumerate()
        .map(|(index, id)| key(id).map_err(|reason| RefusedId { index, reason }.into()))
        .collect()
}

/// A claim's answer, one flag per key: new only for the first occurrence of a key the insert
/// added (`fresh`). Two IDs can make one key (a UUID spelt in capitals, in braces, without
/// hyphens), and the insert keeps one row.
pub fn first_claims<K, Q>(keys: &[Q], mut fresh: HashSet<K>) -> Vec<bool>
where
    K: Borrow<Q> + Eq + Hash,
    Q: Eq + Hash,
{
    keys.iter().map(|k| fresh.remove(k)).collect()
}

/// The primary key of a table of claims in `mode`: the hashed key alone, which covers the
/// consumer already, or the consumer and the key.
pub fn primary_key(mode: KeyMode) -> &'static str {
    match mode {
        KeyMode::Hashed => "message_id",
        KeyMode::Text | KeyMode::Uuid => "consumer_id, message_id",
    }
}

/// `statements` appended to the migration script `sql`, each after an empty line and ending in
/// `;`: the builders indent for the Rust source, the script indents continuation lines once.
pub fn push_statements(sql: &mut String, statements: impl IntoIterator<Item = String>) {
    for statement in statements {
        let lines: Vec<&str> = statement.lines().map(str::trim).collect();
        sql.push('\n');
        sql.push_str(&lines.join("\n    "));
        sql.push_str(";\n");
    }
}

/// A letter or `_`, then letters, digits or `_` (ASCII): a name that can be quoted into SQL
/// text without any risk of injection. The length limit is the database's, for each store to
/// check.
pub fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The error plumbing of every store on sqlx, once; the store supplies its dialect,
/// `$database_recovery(&sqlx::Error) -> Recovery` for database errors, from the server's codes.
/// In the store's error module, beside its `Error` with a `Database { context, source }`
/// variant, it defines `Result`, `db(context)`, `recovery` (the dialect's for a database error;
/// [`Recovery::Reconnect`] for a connection lost or not made, [`Recovery::Fatal`] for a closed
/// pool or a bad configuration, else [`Recovery::Retry`]), `store_err(context)` and
/// `From<Error> for StoreError` (any error but a database one is fatal). It expands in the
/// store's crate, which depends on sqlx: this crate does not.
#[doc(hidden)]
#[macro_export]
macro_rules! sqlx_store_errors {
    ($database_recovery:path) => {
        /// `Result` with this crate's [`Error`].
        pub type Result<T, E = Error> = ::std::result::Result<T, E>;

        pub(crate) fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> Error {
            move |source| Error::Database { context, source }
        }

        /// What the consumer should do after `e`.
        pub(crate) fn recovery(e: &sqlx::Error) -> $crate::Recovery {
            match e {
                sqlx::Error::Database(_) => $database_recovery(e),
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::WorkerCrashed => $crate::Recovery::Reconnect,
                sqlx::Error::PoolClosed | sqlx::Error::Configuration(_) => $crate::Recovery::Fatal,
                _ => $crate::Recovery::Retry,
            }
        }

        pub(crate) fn store_err(
            context: &'static str,
        ) -> impl FnOnce(sqlx::Error) -> $crate::StoreError {
            move |e| $crate::StoreError::new(recovery(&e), context, e)
        }

        impl From<Error> for $crate::StoreError {
            fn from(e: Error) -> Self {
                let recovery = match &e {
                    Error::Database { source, .. } => recovery(source),
                    _ => $crate::Recovery::Fatal,
                };
                $crate::StoreError::new(recovery, "inbox store", e)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed_keys_depend_on_consumer_and_id() {
        assert_eq!(hashed_key("c", "id"), hashed_key("c", "id"));
        assert_ne!(hashed_key("c", "id"), hashed_key("d", "id"));
        assert_ne!(hashed_key("c", "id"), hashed_key("c", "id "));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(hashed_key("ab", "c"), hashed_key("a", "bc"));
        // Stored keys outlive releases: the formula must not change.
        let expected = 0x899d23f199328740c950c7bc8573efa1_u128.to_be_bytes();
        assert_eq!(hashed_key("c", "id"), expected);
    }
}
