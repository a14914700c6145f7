//! What is on a Redis stream, read over a raw connection: entries pending and not yet delivered,
//! the dead-letter stream; and raw writes the adapter would refuse to make.

use std::time::Duration;

use inbox_redis_streams::redis::{self, aio::MultiplexedConnection, AsyncConnectionConfig, Value};

use super::{redis_url, GROUP};

/// A plain connection to `REDIS_URL`.
pub async fn raw() -> MultiplexedConnection {
    raw_at(&redis_url()).await
}

/// A plain connection to the Redis at `url`. It waits up to 10 s for each answer: the client's
/// default, 500 ms, failed a CI run's check ("XADD: timed out") while a server of a scenario's
/// own, which syncs every write to disk, waited on a loaded machine's disk.
pub(super) async fn raw_at(url: &str) -> MultiplexedConnection {
    let config = AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    redis::Client::open(url)
        .unwrap_or_else(|e| panic!("{url}: {e}"))
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap_or_else(|e| panic!("Redis at {url}: {e}"))
}

/// Entries delivered to the group [`GROUP`] and not acked yet.
pub async fn pending(stream: &str) -> i64 {
    pending_with(&mut raw().await, stream).await
}

/// [`pending`] over a connection of your own (another database number).
pub async fn pending_with(conn: &mut MultiplexedConnection, stream: &str) -> i64 {
    let v: Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(GROUP)
        .query_async(conn)
        .await
        .expect("XPENDING");
    match v {
        Value::Array(parts) => match parts.first() {
            Some(Value::Int(n)) => *n,
            other => panic!("unexpected XPENDING reply {other:?}"),
        },
        other => panic!("unexpected XPENDING reply {other:?}"),
    }
}

/// Entries not yet handed to any consumer of the group (`lag` in `XINFO GROUPS`).
pub async fn lag(stream: &str) -> i64 {
    lag_with(&mut raw().await, stream).await
}

/// [`lag`] over a connection of your own.
pub async fn lag_with(conn: &mut MultiplexedConnection, stream: &str) -> i64 {
    let v: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await
        .expect("XINFO GROUPS");
    let Value::Array(groups) = v else {
        panic!("XINFO GROUPS: {v:?}")
    };
    for group in groups {
        let fields: Vec<Value> = match group {
            Value::Array(f) => f,
            Value::Map(m) => m.into_iter().flat_map(|(k, v)| [k, v]).collect(),
            other => panic!("XINFO group: {other:?}"),
        };
        let mut it = fields.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            if matches!(&k, Value::BulkString(b) if b == b"lag") {
                return match v {
                    Value::Int(n) => n,
                    other => panic!("lag: {other:?}"),
                };
            }
        }
    }
    panic!("no lag for {stream}")
}

/// The dead-letter stream's (`<stream>:dlq`) entries, each as its fields.
pub async fn dead_letters(stream: &str) -> Vec<Vec<(String, String)>> {
    dead_letters_with(&mut raw().await, stream).await
}

/// [`dead_letters`] over a connection of your own.
pub async fn dead_letters_with(
    conn: &mut MultiplexedConnection,
    stream: &str,
) -> Vec<Vec<(String, String)>> {
    let v: Value = redis::cmd("XRANGE")
        .arg(format!("{stream}:dlq"))
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .expect("XRANGE dlq");
    let Value::Array(entries) = v else {
        return Vec::new();
    };
    entries
        .into_iter()
        .map(|e| {
            let Value::Array(mut parts) = e else {
                panic!("entry {e:?}")
            };
            let Value::Array(flat) = parts.remove(1) else {
                panic!("fields")
            };
            let text = |v: Value| match v {
                Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                other => format!("{other:?}"),
            };
            let mut out = Vec::new();
            let mut it = flat.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((text(k), text(v)));
            }
            out
        })
        .collect()
}

/// Adds an entry with exactly these fields; returns its ID.
pub async fn xadd_raw(stream: &str, fields: &[(&str, &str)]) -> String {
    xadd_with(&mut raw().await, stream, fields).await
}

/// [`xadd_raw`] over a connection of your own.
pub(super) async fn xadd_with(
    conn: &mut MultiplexedConnection,
    stream: &str,
    fields: &[(&str, &str)],
) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async(conn).await.expect("XADD")
}

/// Deletes `stream` and its dead-letter stream.
pub async fn cleanup(stream: &str) {
    cleanup_with(&mut raw().await, stream).await;
}

/// [`cleanup`] over a connection of your own.
pub(super) async fn cleanup_with(conn: &mut MultiplexedConnection, stream: &str) {
    let _: redis::RedisResult<i64> = redis::cmd("DEL")
        .arg(stream)
        .arg(format!("{stream}:dlq"))
        .arg(format!("{stream}:{}:redeliveries", super::GROUP))
        .query_async(conn)
        .await;
}
