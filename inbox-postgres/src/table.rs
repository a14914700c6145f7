//! Validated names and the key layout of the inbox table.

use std::fmt;

use inbox_core::sql::is_plain_identifier;

use crate::{Error, KeyMode, Result};

/// A schema-qualified table name whose parts are plain SQL identifiers, so they can be quoted
/// into SQL text without any risk of injection.
///
/// The table name takes at most [`TableName::MAX_LEN`] (53) bytes: the store derives names of
/// up to 10 more bytes from it (`<table>_consumers`, `<table>_processed`, `<table>_unsent`,
/// `<table>_fenced`, ...), and PostgreSQL would cut a name over its limit of 63 bytes short
/// without an error, so that two derived names, or a derived name and another table's, could
/// become one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

/// PostgreSQL's longest identifier, in bytes (`NAMEDATALEN - 1`).
const MAX_IDENTIFIER: usize = 63;

/// What the store appends to a table name for the names it derives from it, the longest
/// first. Partition names (`<table>_p20250301_0000`, `<table>_default`) shorten the table's
/// name instead (`partition::name_prefix`).
const DERIVED_SUFFIXES: [&str; 7] = [
    "_consumers",
    "_processed",
    "_effects",
    "_unsent",
    "_fenced",
    "_done",
    "_pkey",
];

impl TableName {
    /// The longest table name: every name derived from it still fits PostgreSQL's 63 bytes.
    pub const MAX_LEN: usize = MAX_IDENTIFIER - DERIVED_SUFFIXES[0].len();

    /// `table` in the connection's `search_path`.
    ///
    /// # Errors
    /// [`Error::InvalidIdentifier`] for a name that is not a plain SQL identifier,
    /// [`Error::TableNameTooLong`] for one over [`TableName::MAX_LEN`] bytes.
    pub fn new(table: &str) -> Result<Self> {
        Ok(Self {
            schema: None,
            table: table_identifier(table)?,
        })
    }

    /// `schema.table`.
    ///
    /// # Errors
    /// As [`TableName::new`], and [`Error::InvalidIdentifier`] for a schema name that is not a
    /// plain SQL identifier of at most 63 bytes.
    pub fn qualified(schema: &str, table: &str) -> Result<Self> {
        Ok(Self {
            schema: Some(identifier("schema", schema)?),
            table: table_identifier(table)?,
        })
    }

    /// A default name of the crate's own (`inbox`, `outbox`), plain by construction.
    pub(crate) fn default_name(table: &'static str) -> Self {
        debug_assert!(is_plain_identifier(table) && table.len() <= Self::MAX_LEN);
        Self {
            schema: None,
            table: table.to_owned(),
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

    /// `name` in this table's schema, quoted.
    pub(crate) fn qualify(&self, name: &str) -> String {
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{name}\""),
            None => format!("\"{name}\""),
        }
    }

    /// A sibling table or index name: `<table>_<suffix>`, in the same schema.
    pub(crate) fn sibling(&self, suffix: &str) -> String {
        self.qualify(&self.derived(suffix))
    }

    /// The bare quoted name of a sibling, for index names (which take no schema).
    pub(crate) fn sibling_bare(&self, suffix: &str) -> String {
        format!("\"{}\"", self.derived(suffix))
    }

    fn derived(&self, suffix: &str) -> String {
        debug_assert!(
            DERIVED_SUFFIXES.contains(&format!("_{suffix}").as_str()),
            "`_{suffix}` is not in DERIVED_SUFFIXES, whose longest bounds the table name"
        );
        format!("{}_{suffix}", self.table)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.qualify(&self.table))
    }
}

/// `name` as a table name: a plain identifier short enough for every name derived from it.
fn table_identifier(name: &str) -> Result<String> {
    if !is_plain_identifier(name) {
        return Err(Error::InvalidIdentifier {
            what: "table",
            name: name.to_owned(),
        });
    }
    if name.len() > TableName::MAX_LEN {
        let derived = format!("{name}{}", DERIVED_SUFFIXES[0]);
        return Err(Error::TableNameTooLong {
            bytes: derived.len(),
            derived,
            name: name.to_owned(),
        });
    }
    Ok(name.to_owned())
}

fn identifier(what: &'static str, name: &str) -> Result<String> {
    if is_plain_identifier(name) && name.len() <= MAX_IDENTIFIER {
        Ok(name.to_owned())
    } else {
        Err(Error::InvalidIdentifier {
            what,
            name: name.to_owned(),
        })
    }
}

/// The column type of message keys in `mode`.
pub(crate) fn column_type(mode: KeyMode) -> &'static str {
    match mode {
        KeyMode::Text => "text",
        KeyMode::Uuid | KeyMode::Hashed => "uuid",
    }
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
        assert!(matches!(
            TableName::new(&"a".repeat(64)),
            Err(Error::TableNameTooLong { bytes: 74, .. })
        ));
        assert!(TableName::new(&"a".repeat(TableName::MAX_LEN)).is_ok());
        assert!(TableName::qualified(&"s".repeat(63), "t").is_ok());
        assert!(matches!(
            TableName::qualified(&"s".repeat(64), "t"),
            Err(Error::InvalidIdentifier { what: "schema", .. })
        ));
        assert_eq!(
            TableName::qualified("s", "t").unwrap().to_string(),
            "\"s\".\"t\""
        );
    }

    #[test]
    fn the_longest_derived_name_bounds_the_table_name() {
        let longest = DERIVED_SUFFIXES.iter().map(|s| s.len()).max();
        assert_eq!(longest, Some(DERIVED_SUFFIXES[0].len()));
        assert_eq!(TableName::MAX_LEN, 53);
    }
}
