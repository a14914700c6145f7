//! [`TableName`] and [`KeyMode`]: where the inbox lives and how it keeps message IDs.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// MySQL's limit for identifiers, in bytes (characters, for the plain ASCII names accepted).
const MAX_IDENTIFIER: usize = 64;
/// The suffix of the longest name derived from the table name.
const CONSUMERS_SUFFIX: &str = "_consumers";

/// The inbox table's name, optionally in another database than the connection's: checked to be
/// plain SQL identifiers, so they can be quoted into SQL safely.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    database: Option<String>,
    table: String,
}

impl TableName {
    /// The longest table name accepted: `<table>_consumers` must stay within 64 bytes.
    pub const MAX_LEN: usize = MAX_IDENTIFIER - CONSUMERS_SUFFIX.len();

    /// `table` in the connection's database.
    ///
    /// # Errors
    /// [`Error::InvalidIdentifier`] for a name that is not a plain SQL identifier,
    /// [`Error::TableNameTooLong`] for one over [`TableName::MAX_LEN`] bytes.
    pub fn new(table: &str) -> Result<Self> {
        Ok(Self {
            database: None,
            table: table_identifier(table)?,
        })
    }

    /// `database.table`.
    ///
    /// # Errors
    /// As [`TableName::new`], and [`Error::InvalidIdentifier`] for a database name that is not
    /// a plain SQL identifier of at most 64 bytes.
    pub fn qualified(database: &str, table: &str) -> Result<Self> {
        if !plain(database) || database.len() > MAX_IDENTIFIER {
            return Err(Error::InvalidIdentifier {
                what: "database",
                name: database.to_owned(),
            });
        }
        Ok(Self {
            database: Some(database.to_owned()),
            table: table_identifier(table)?,
        })
    }

    pub(crate) fn default_inbox() -> Self {
        Self {
            database: None,
            table: "inbox".to_owned(),
        }
    }

    /// The table name alone.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The database, if one was given.
    pub fn database(&self) -> Option<&str> {
        self.database.as_deref()
    }

    /// `<table>_consumers`, in the same database, quoted.
    pub(crate) fn consumers(&self) -> String {
        self.quoted(&format!("{}{CONSUMERS_SUFFIX}", self.table))
    }

    fn quoted(&self, table: &str) -> String {
        match &self.database {
            Some(database) => format!("`{database}`.`{table}`"),
            None => format!("`{table}`"),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.quoted(&self.table))
    }
}

fn table_identifier(name: &str) -> Result<String> {
    if !plain(name) || name.len() > MAX_IDENTIFIER {
        return Err(Error::InvalidIdentifier {
            what: "table",
            name: name.to_owned(),
        });
    }
    if name.len() > TableName::MAX_LEN {
        return Err(Error::TableNameTooLong {
            name: name.to_owned(),
        });
    }
    Ok(name.to_owned())
}

/// A letter or `_`, then letters, digits or `_`.
fn plain(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// How message IDs are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyMode {
    /// The ID verbatim in a `varbinary(1024)` column, compared byte for byte: any ID the core
    /// accepts (at most 1024 bytes), at the price of its length per row and in the primary key.
    /// Binary, not `varchar`: a `varchar` collation would make `evt-1` and `EVT-1` (and, with
    /// `PAD SPACE`, `evt-1 `) the same ID.
    #[default]
    Text,
    /// The ID parsed as a UUID into a `binary(16)` column. IDs that are not UUIDs are refused
    /// (and dead-lettered). UUIDv7 IDs keep the primary key append-only.
    Uuid,
    /// Any ID, kept as 16 bytes in a `binary(16)` column: the first 128 bits of SHA-256 over the
    /// consumer name, a zero byte and the ID (the same key the PostgreSQL store computes). Two
    /// different IDs collide with probability about n²/2¹²⁹ among n remembered IDs, and a
    /// collision can only make a message be skipped as a duplicate. The original ID is not
    /// stored. The keys are random, so inserts land all over the primary key.
    Hashed,
}

impl KeyMode {
    /// The column type, as `information_schema.COLUMNS.COLUMN_TYPE` spells it.
    pub(crate) fn column_type(self) -> &'static str {
        match self {
            KeyMode::Text => "varbinary(1024)",
            KeyMode::Uuid | KeyMode::Hashed => "binary(16)",
        }
    }
}

/// The key of `id` for `consumer` in hashed mode.
pub(crate) fn hashed_key(consumer: &str, id: &str) -> [u8; 16] {
    let mut hasher = Sha256::new();
    hasher.update(consumer.as_bytes());
    hasher.update([0u8]);
    hasher.update(id.as_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_identifiers_pass() {
        assert!(TableName::qualified("billing", "inbox_2").is_ok());
        for bad in ["", "1abc", "x;drop table y", "a-b", "a b", "`q`", "ä"] {
            let err = TableName::new(bad).expect_err(bad).to_string();
            assert!(err.contains("is not a plain SQL identifier"), "{err}");
        }
        assert_eq!(
            TableName::new("x;drop").expect_err("refused").to_string(),
            "table name `x;drop` is not a plain SQL identifier (a letter or `_`, then letters, \
             digits or `_`, at most 64 bytes)"
        );
        assert!(matches!(
            TableName::qualified("a`b", "t"),
            Err(Error::InvalidIdentifier {
                what: "database",
                ..
            })
        ));
        assert!(TableName::new(&"a".repeat(TableName::MAX_LEN)).is_ok());
        assert!(matches!(
            TableName::new(&"a".repeat(TableName::MAX_LEN + 1)),
            Err(Error::TableNameTooLong { .. })
        ));
        assert_eq!(
            TableName::qualified("d", "t").expect("valid").to_string(),
            "`d`.`t`"
        );
        assert_eq!(
            TableName::new("t").expect("valid").consumers(),
            "`t_consumers`"
        );
    }

    #[test]
    fn hashed_keys_depend_on_consumer_and_id() {
        assert_eq!(hashed_key("c", "id"), hashed_key("c", "id"));
        assert_ne!(hashed_key("c", "id"), hashed_key("d", "id"));
        assert_ne!(hashed_key("c", "id"), hashed_key("c", "id "));
        assert_ne!(hashed_key("ab", "c"), hashed_key("a", "bc"));
    }
}
