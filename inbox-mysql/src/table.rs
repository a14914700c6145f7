//! [`TableName`]: where the inbox lives, and the column type of each [`KeyMode`].

use std::fmt;

use inbox_core::sql::is_plain_identifier;

use crate::{Error, KeyMode, Result};

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
        Ok(Self {
            database: Some(identifier("database", database)?),
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

fn identifier(what: &'static str, name: &str) -> Result<String> {
    if !is_plain_identifier(name) || name.len() > MAX_IDENTIFIER {
        return Err(Error::InvalidIdentifier {
            what,
            name: name.to_owned(),
        });
    }
    Ok(name.to_owned())
}

fn table_identifier(name: &str) -> Result<String> {
    let name = identifier("table", name)?;
    if name.len() > TableName::MAX_LEN {
        return Err(Error::TableNameTooLong { name });
    }
    Ok(name)
}

/// The longest text key the `varbinary` key column holds, in bytes. A longer value would be
/// refused by a strict server and cut short by a non-strict one, making two IDs that share this
/// prefix one key.
pub(crate) const TEXT_KEY_MAX: usize = 1024;

/// The column type of message keys in `mode`, as `information_schema.COLUMNS.COLUMN_TYPE`
/// spells it.
pub(crate) fn column_type(mode: KeyMode) -> &'static str {
    match mode {
        KeyMode::Text => "varbinary(1024)",
        KeyMode::Uuid | KeyMode::Hashed => "binary(16)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_key_limit_is_the_column_s() {
        assert_eq!(
            column_type(KeyMode::Text),
            format!("varbinary({TEXT_KEY_MAX})")
        );
    }

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
}
