//! Parsing of stream replies, by hand rather than through the client's typed replies: those keep
//! fields in a hash map, losing the entry's field order, and cannot show an entry that was
//! deleted while pending (its fields come back as nil).

use std::collections::HashMap;

use redis::Value;

use crate::{Error, Result};

/// A stream entry's fields, in the order they were added.
pub(crate) type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// One entry as a read or claim returns it.
#[derive(Debug)]
pub(crate) struct Entry {
    /// The stream entry ID, `<ms>-<seq>`.
    pub(crate) id: String,
    /// `None`: the entry is still pending but was deleted from the stream (`XDEL`, `XTRIM`).
    pub(crate) fields: Option<Fields>,
}

/// An `XREADGROUP` reply for one stream: nil on timeout, else `[[key, [entry...]]]` (RESP2) or
/// `{key: [entry...]}` (RESP3).
pub(crate) fn read_reply(command: &'static str, value: Value) -> Result<Vec<Entry>> {
    let streams = match value {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .map(|stream| match stream {
                Value::Array(mut pair) if pair.len() == 2 => Ok(pair.remove(1)),
                other => Err(Error::reply(
                    command,
                    format!("stream is not [key, entries]: {other:?}"),
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        Value::Map(streams) => streams.into_iter().map(|(_, entries)| entries).collect(),
        other => return Err(Error::reply(command, format!("not an array: {other:?}"))),
    };
    let mut entries = Vec::new();
    for stream in streams {
        entries.extend(entry_list(command, stream)?);
    }
    Ok(entries)
}

/// The reply to `XRANGE`: a plain entry list.
pub(crate) fn range_reply(value: Value) -> Result<Vec<Entry>> {
    entry_list("XRANGE", value)
}

/// An `XAUTOCLAIM` reply: `[next cursor, [entry...], [deleted id...]]` (Redis 7; Redis 6.2 has
/// no third element).
pub(crate) fn autoclaim_reply(value: Value) -> Result<(String, Vec<Entry>)> {
    const CMD: &str = "XAUTOCLAIM";
    let Value::Array(parts) = value else {
        return Err(Error::reply(CMD, format!("not an array: {value:?}")));
    };
    let mut parts = parts.into_iter();
    let cursor = match parts.next() {
        Some(v) => text(CMD, v)?,
        None => return Err(Error::reply(CMD, "empty reply")),
    };
    let entries = match parts.next() {
        Some(v) => entry_list(CMD, v)?,
        None => Vec::new(),
    };
    Ok((cursor, entries))
}

/// The extended `XPENDING` reply: `[[id, consumer, idle ms, delivery count]...]`, as a map from
/// entry ID to delivery count.
pub(crate) fn pending_counts(value: Value) -> Result<HashMap<String, u32>> {
    const CMD: &str = "XPENDING";
    let Value::Array(rows) = value else {
        return Err(Error::reply(CMD, format!("not an array: {value:?}")));
    };
    let mut counts = HashMap::with_capacity(rows.len());
    for row in rows {
        let Value::Array(row) = row else {
            return Err(Error::reply(CMD, format!("row is not an array: {row:?}")));
        };
        let mut row = row.into_iter();
        let (Some(id), Some(count)) = (row.next(), row.nth(2)) else {
            return Err(Error::reply(CMD, "row has fewer than 4 elements"));
        };
        let count = match count {
            Value::Int(n) => u32::try_from(n).unwrap_or(u32::MAX),
            other => text(CMD, other)?
                .parse()
                .map_err(|e| Error::reply(CMD, format!("delivery count: {e}")))?,
        };
        counts.insert(text(CMD, id)?, count);
    }
    Ok(counts)
}

fn entry_list(command: &'static str, value: Value) -> Result<Vec<Entry>> {
    let items = match value {
        Value::Array(items) => items,
        Value::Nil => return Ok(Vec::new()),
        other => {
            return Err(Error::reply(
                command,
                format!("entries are not an array: {other:?}"),
            ))
        }
    };
    items.into_iter().map(|item| entry(command, item)).collect()
}

fn entry(command: &'static str, value: Value) -> Result<Entry> {
    let Value::Array(parts) = value else {
        return Err(Error::reply(
            command,
            format!("entry is not an array: {value:?}"),
        ));
    };
    let mut parts = parts.into_iter();
    let id = match parts.next() {
        Some(v) => text(command, v)?,
        None => return Err(Error::reply(command, "entry without an ID")),
    };
    let fields = match parts.next() {
        None | Some(Value::Nil) => None,
        Some(Value::Array(flat)) => {
            if flat.len() % 2 != 0 {
                return Err(Error::reply(
                    command,
                    format!("entry {id} has an odd field list"),
                ));
            }
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut flat = flat.into_iter();
            while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
                fields.push((bytes(command, name)?, bytes(command, value)?));
            }
            Some(fields)
        }
        Some(Value::Map(pairs)) => Some(
            pairs
                .into_iter()
                .map(|(n, v)| Ok((bytes(command, n)?, bytes(command, v)?)))
                .collect::<Result<_>>()?,
        ),
        Some(other) => {
            return Err(Error::reply(
                command,
                format!("fields of {id} are not an array: {other:?}"),
            ))
        }
    };
    Ok(Entry { id, fields })
}

fn bytes(command: &'static str, value: Value) -> Result<Vec<u8>> {
    match value {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::Int(n) => Ok(n.to_string().into_bytes()),
        Value::VerbatimString { text, .. } => Ok(text.into_bytes()),
        other => Err(Error::reply(
            command,
            format!("expected a string, got {other:?}"),
        )),
    }
}

fn text(command: &'static str, value: Value) -> Result<String> {
    String::from_utf8(bytes(command, value)?)
        .map_err(|_| Error::reply(command, "an entry ID is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::BulkString(x.as_bytes().to_vec())
    }

    #[test]
    fn reads_keep_field_order_and_deleted_entries() {
        let reply = Value::Array(vec![Value::Array(vec![
            s("k"),
            Value::Array(vec![
                Value::Array(vec![
                    s("1-0"),
                    Value::Array(vec![s("b"), s("2"), s("a"), s("1")]),
                ]),
                Value::Array(vec![s("2-0"), Value::Nil]),
            ]),
        ])]);
        let entries = read_reply("XREADGROUP", reply).expect("parses");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].id, "1-0");
        let fields = entries[0].fields.as_ref().expect("parses");
        assert_eq!(fields[0], (b"b".to_vec(), b"2".to_vec()));
        assert_eq!(fields[1], (b"a".to_vec(), b"1".to_vec()));
        assert!(entries[1].fields.is_none());
        assert!(read_reply("XREADGROUP", Value::Nil)
            .expect("parses")
            .is_empty());
    }

    #[test]
    fn autoclaim_and_pending_replies_parse() {
        let reply = Value::Array(vec![
            s("0-0"),
            Value::Array(vec![Value::Array(vec![
                s("3-0"),
                Value::Array(vec![s("x"), s("y")]),
            ])]),
            Value::Array(vec![]),
        ]);
        let (cursor, entries) = autoclaim_reply(reply).expect("parses");
        assert_eq!(cursor, "0-0");
        assert_eq!(entries[0].id, "3-0");
        let pending = Value::Array(vec![Value::Array(vec![
            s("3-0"),
            s("c1"),
            Value::Int(1200),
            Value::Int(4),
        ])]);
        assert_eq!(pending_counts(pending).expect("parses")["3-0"], 4);
    }
}
