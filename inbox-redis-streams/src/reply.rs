//! Parsing of stream replies, by hand rather than through the client's typed replies: those keep
//! fields in a hash map, losing the entry's field order, and cannot show an entry that was
//! deleted while pending (its fields come back as nil, or, in a Redis 6.2 `XAUTOCLAIM`, the whole
//! entry does).

use std::collections::HashMap;

use redis::Value;

use crate::sweep::Pending;
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
    let streams: Vec<(Value, Value)> = parse(command, value)?;
    let mut entries = Vec::new();
    for (_key, stream) in streams {
        // Redis shows a deleted pending entry here as `[id, nil]`, never as a bare nil; one
        // would carry no ID to act on, so it is skipped rather than failing the whole read.
        entries.extend(entry_list(command, stream)?.0);
    }
    Ok(entries)
}

/// The reply to `XRANGE`: a plain entry list.
pub(crate) fn range_reply(value: Value) -> Result<Vec<Entry>> {
    Ok(entry_list("XRANGE", value)?.0)
}

/// One step of an `XAUTOCLAIM` sweep.
#[derive(Debug)]
pub(crate) struct Claimed {
    /// Where the next step starts; `0-0` when the sweep is complete.
    pub(crate) cursor: String,
    /// The entries now pending under the claiming consumer, in stream order.
    pub(crate) entries: Vec<Entry>,
    /// Redis 6.2: claimed entries that were trimmed or deleted from the stream, each sent as a
    /// bare nil. They are now pending under the claiming consumer, but the reply has no IDs
    /// for them: the caller has to find them in its pending list to `XACK` them.
    pub(crate) vanished: usize,
    /// Redis 7: IDs of pending entries that were deleted from the stream; Redis already
    /// removed them from the pending list.
    pub(crate) deleted: Vec<String>,
}

/// An `XAUTOCLAIM` reply: `[next cursor, [entry...], [deleted id...]]` (Redis 7) or
/// `[next cursor, [entry or nil...]]` (Redis 6.2, a nil for each deleted entry it claimed).
pub(crate) fn autoclaim_reply(value: Value) -> Result<Claimed> {
    const CMD: &str = "XAUTOCLAIM";
    let Value::Array(parts) = value else {
        return Err(Error::reply(CMD, format!("not an array: {value:?}")));
    };
    let mut parts = parts.into_iter();
    let Some(cursor) = parts.next() else {
        return Err(Error::reply(CMD, "empty reply"));
    };
    let (entries, vanished) = entry_list(CMD, parts.next().unwrap_or(Value::Nil))?;
    Ok(Claimed {
        cursor: parse(CMD, cursor)?,
        entries,
        vanished,
        deleted: parse(CMD, parts.next().unwrap_or(Value::Nil))?,
    })
}

/// The extended `XPENDING` reply as a map from entry ID to delivery count.
pub(crate) fn pending_counts(value: Value) -> Result<HashMap<String, u32>> {
    Ok(pending_rows(value)?
        .into_iter()
        .map(|row| (row.id, row.delivery_count))
        .collect())
}

/// The extended `XPENDING` reply: `[[id, consumer, idle ms, delivery count]...]`.
pub(crate) fn pending_rows(value: Value) -> Result<Vec<Pending>> {
    let rows: Vec<(String, Value, u64, u32)> = parse("XPENDING", value)?;
    Ok(rows
        .into_iter()
        .map(|(id, _consumer, idle_ms, delivery_count)| Pending {
            id,
            idle_ms,
            delivery_count,
        })
        .collect())
}

/// The client's own conversion, its error as this command's unexpected reply.
fn parse<T: redis::FromRedisValue>(command: &'static str, value: Value) -> Result<T> {
    redis::from_redis_value(value).map_err(|e| Error::reply(command, e.to_string()))
}

/// The entries of a list, and how many of its elements were a bare nil instead of an entry.
fn entry_list(command: &'static str, value: Value) -> Result<(Vec<Entry>, usize)> {
    let items: Vec<Option<Value>> = parse(command, value)?;
    let nils = items.iter().filter(|item| item.is_none()).count();
    let entries = items
        .into_iter()
        .flatten()
        .map(|item| entry(command, item))
        .collect::<Result<_>>()?;
    Ok((entries, nils))
}

/// `[id, [name, value...]]` (RESP2), `[id, {name: value...}]` (RESP3) or `[id, nil]`.
fn entry(command: &'static str, value: Value) -> Result<Entry> {
    let (id, fields): (String, Option<Value>) = parse(command, value)?;
    let pairs = match fields {
        None => return Ok(Entry { id, fields: None }),
        Some(Value::Map(pairs)) => pairs,
        Some(Value::Array(flat)) if flat.len() % 2 == 0 => {
            let mut flat = flat.into_iter();
            std::iter::from_fn(|| Some((flat.next()?, flat.next()?))).collect()
        }
        Some(other) => {
            return Err(Error::reply(
                command,
                format!("fields of {id} are not pairs: {other:?}"),
            ))
        }
    };
    let fields = pairs
        .into_iter()
        .map(|(name, value)| Ok((bytes(command, name)?, bytes(command, value)?)))
        .collect::<Result<_>>()?;
    Ok(Entry {
        id,
        fields: Some(fields),
    })
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

    /// Redis 6.2 answers a claimed entry that was trimmed or deleted with a bare nil in the
    /// entry list and has no list of deleted IDs; these are the bytes it sends (RESP2).
    #[test]
    fn a_redis_6_2_autoclaim_reply_with_a_trimmed_entry_keeps_the_live_ones() {
        let wire = b"*2\r\n$3\r\n0-0\r\n*3\r\n\
            *2\r\n$3\r\n1-0\r\n*2\r\n$7\r\npayload\r\n$1\r\na\r\n\
            $-1\r\n\
            *2\r\n$3\r\n3-0\r\n*2\r\n$7\r\npayload\r\n$1\r\nc\r\n";
        let reply = redis::parse_redis_value(wire).expect("valid RESP2");
        let claimed = autoclaim_reply(reply).expect("a 6.2 reply parses");
        assert_eq!(claimed.cursor, "0-0");
        let ids: Vec<&str> = claimed.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["1-0", "3-0"]);
        assert!(claimed.entries.iter().all(|e| e.fields.is_some()));
        assert_eq!(claimed.vanished, 1);
        assert!(claimed.deleted.is_empty());
    }

    #[test]
    fn autoclaim_and_pending_replies_parse() {
        let reply = Value::Array(vec![
            s("0-0"),
            Value::Array(vec![Value::Array(vec![
                s("3-0"),
                Value::Array(vec![s("x"), s("y")]),
            ])]),
            Value::Array(vec![s("2-0")]),
        ]);
        let claimed = autoclaim_reply(reply).expect("parses");
        assert_eq!(claimed.cursor, "0-0");
        assert_eq!(claimed.entries[0].id, "3-0");
        assert_eq!(claimed.vanished, 0);
        assert_eq!(claimed.deleted, ["2-0"]);
        let pending = Value::Array(vec![Value::Array(vec![
            s("3-0"),
            s("c1"),
            Value::Int(1200),
            Value::Int(4),
        ])]);
        assert_eq!(pending_counts(pending.clone()).expect("parses")["3-0"], 4);
        assert_eq!(
            pending_rows(pending).expect("parses"),
            [Pending {
                id: "3-0".into(),
                idle_ms: 1200,
                delivery_count: 4
            }]
        );
    }
}
