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
        // Redis shows a deleted pending entry here as `[id, nil]`, never as a bare nil; one
        // would carry no ID to act on, so it is skipped rather than failing the whole read.
        entries.extend(entry_list(command, stream)?.entries);
    }
    Ok(entries)
}

/// The reply to `XRANGE`: a plain entry list.
pub(crate) fn range_reply(value: Value) -> Result<Vec<Entry>> {
    Ok(entry_list("XRANGE", value)?.entries)
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
    let cursor = match parts.next() {
        Some(v) => text(CMD, v)?,
        None => return Err(Error::reply(CMD, "empty reply")),
    };
    let list = match parts.next() {
        Some(v) => entry_list(CMD, v)?,
        None => EntryList::default(),
    };
    let deleted = match parts.next() {
        None | Some(Value::Nil) => Vec::new(),
        Some(Value::Array(ids)) => ids
            .into_iter()
            .map(|id| text(CMD, id))
            .collect::<Result<_>>()?,
        Some(other) => {
            return Err(Error::reply(
                CMD,
                format!("deleted IDs are not an array: {other:?}"),
            ))
        }
    };
    Ok(Claimed {
        cursor,
        entries: list.entries,
        vanished: list.nils,
        deleted,
    })
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

/// `XPENDING key group start end count` rows: each entry's ID, idle time in milliseconds and
/// delivery count.
pub(crate) fn pending_rows(value: Value) -> Result<Vec<Pending>> {
    const CMD: &str = "XPENDING";
    let Value::Array(rows) = value else {
        return Err(Error::reply(CMD, format!("not an array: {value:?}")));
    };
    let number = |what: &str, v: Value| -> Result<u64> {
        match v {
            Value::Int(n) => Ok(u64::try_from(n).unwrap_or(0)),
            other => text(CMD, other)?
                .parse()
                .map_err(|e| Error::reply(CMD, format!("{what}: {e}"))),
        }
    };
    let mut pending = Vec::with_capacity(rows.len());
    for row in rows {
        let Value::Array(row) = row else {
            return Err(Error::reply(CMD, format!("row is not an array: {row:?}")));
        };
        let mut row = row.into_iter();
        let (Some(id), Some(ms), Some(count)) = (row.next(), row.nth(1), row.next()) else {
            return Err(Error::reply(CMD, "row has fewer than 4 elements"));
        };
        pending.push(Pending {
            id: text(CMD, id)?,
            idle_ms: number("idle time", ms)?,
            delivery_count: u32::try_from(number("delivery count", count)?).unwrap_or(u32::MAX),
        });
    }
    Ok(pending)
}

/// The entries of a list, and how many of its elements were a bare nil instead of an entry.
#[derive(Debug, Default)]
struct EntryList {
    entries: Vec<Entry>,
    nils: usize,
}

fn entry_list(command: &'static str, value: Value) -> Result<EntryList> {
    let items = match value {
        Value::Array(items) => items,
        Value::Nil => return Ok(EntryList::default()),
        other => {
            return Err(Error::reply(
                command,
                format!("entries are not an array: {other:?}"),
            ))
        }
    };
    let mut list = EntryList {
        entries: Vec::with_capacity(items.len()),
        nils: 0,
    };
    for item in items {
        match item {
            Value::Nil => list.nils += 1,
            item => list.entries.push(entry(command, item)?),
        }
    }
    Ok(list)
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
