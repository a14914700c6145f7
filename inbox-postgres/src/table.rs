//! Validated names and the key layout of the inbox table.

use std::fmt;

use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{Error, Result};

/// A schema-qualified table name whose parts are plain SQL identifiers, so they can be quoted
/// into SQL text without any risk of injection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

impl TableName {
    /// `table` in the connection's `search_path`.
    pub fn new(table: &str) -> Result<Self> {
        Ok(Self {
            schema: None,
            table: identifier("table", table)?,
        })
    }

    /// `schema.table`.
    pub fn qualified(schema: &str, table: &str) -> Result<Self> {
        Ok(Self {
            schema: Some(identifier("schema", schema)?),
            table: identifier("table", table)?,
        })
    }

    pub(crate) fn default_inbox() -> Self {
        Self {
            schema: None,
            table: "inbox".to_owned(),
        }
    }

    /// The table name alone.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The schema, if one was given.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// A sibling table or index name: `<table>_<suffix>`, in the same schema.
    pub(crate) fn sibling(&self, suffix: &str) -> String {
        let name = format!("\"{}_{suffix}\"", self.table);
        match &self.schema {
            Some(schema) => format!("\"{schema}\".{name}"),
            None => name,
        }
    }

    /// The bare quoted name of a sibling, for index names (which take no schema).
    pub(crate) fn sibling_bare(&self, suffix: &str) -> String {
        format!("\"{}_{suffix}\"", self.table)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "\"{schema}\".\"{}\"", self.table),
            None => write!(f, "\"{}\"", self.table),
        }
    }
}

fn identifier(what: &'static str, name: &str) -> Result<String> {
    let mut chars = name.chars();
    let plain = name.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if plain {
        Ok(name.to_owned())
    } else {
        Err(Error::InvalidIdentifier {
            what,
            name: name.to_owned(),
        })
    }
}

/// How message IDs are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyMode {
    /// The ID verbatim in a `text` column: any ID, at the price of its length per row and in
    /// the index.
    #[default]
    Text,
    /// The ID parsed as a UUID into a 16-byte `uuid` column. IDs that are not UUIDs are refused
    /// (and dead-lettered). UUIDv7 IDs (what this project's producer helpers send) keep the index
    /// append-only.
    Uuid,
    /// Any text ID, kept as 16 bytes: the first 128 bits of SHA-256 over the consumer name, a
    /// zero byte and the ID, in a `uuid` column. Two different IDs collide with probability about
    /// n²/2¹²⁹ among n remembered IDs (below 10⁻²² at 190 million), and a collision can only make
    /// a message be skipped as a duplicate. The original ID is not stored. On the partitioned
    /// layout the key of a UUIDv7 ID starts with the ID's time instead (see
    /// [`Partitions`](crate::Partitions)).
    Hashed,
}

impl KeyMode {
    pub(crate) fn column_type(self) -> &'static str {
        match self {
            KeyMode::Text => "text",
            KeyMode::Uuid | KeyMode::Hashed => "uuid",
        }
    }
}

/// The key of `id` for `consumer` in hashed mode.
pub(crate) fn hashed_key(consumer: &str, id: &str) -> Uuid {
    let mut hasher = Sha256::new();
    hasher.update(consumer.as_bytes());
    hasher.update([0u8]);
    hasher.update(id.as_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Uuid::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_identifiers_pass() {
        assert!(TableName::qualified("public", "inbox_2").is_ok());
        assert!(TableName::new("_x").is_ok());
        for bad in ["", "1abc", "x;drop table y", "a-b", "a b", "\"q\"", "ä"] {
            let err = TableName::new(bad).unwrap_err();
            assert!(
                err.to_string().contains("is not a plain SQL identifier"),
                "{err}"
            );
        }
        let err = TableName::new("x;drop").unwrap_err().to_string();
        assert_eq!(
            err,
            "table name `x;drop` is not a plain SQL identifier (a letter or `_`, then letters, digits or `_`, at most 63 bytes)"
        );
        assert!(TableName::new(&"a".repeat(64)).is_err());
        assert_eq!(
            TableName::qualified("s", "t").unwrap().to_string(),
            "\"s\".\"t\""
        );
    }

    #[test]
    fn hashed_keys_depend_on_consumer_and_id() {
        assert_eq!(hashed_key("c", "id"), hashed_key("c", "id"));
        assert_ne!(hashed_key("c", "id"), hashed_key("d", "id"));
        assert_ne!(hashed_key("c", "id"), hashed_key("c", "id "));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(hashed_key("ab", "c"), hashed_key("a", "bc"));
    }
}
