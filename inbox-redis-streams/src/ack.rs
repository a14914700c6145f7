//! `XACK`, one entry or a whole batch per round-trip; a dead letter's `XADD` and its `XACK` in
//! one script.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::{async_trait, dead_letter, Ack, Message, SourceError};
use redis::Value;
use tracing::debug;

use crate::config::Settings;
use crate::connection::Conn;
use crate::reply::{self, Fields};
use crate::source::rebuild_fields;
use crate::{Error, Result};

/// Acknowledges one stream entry: `XACK <stream> <group> <entry ID>`, which removes it from the
/// group's pending list.
///
/// [`Ack::nack`] leaves the entry pending: Redis cannot delay a redelivery, so the entry comes
/// back once it has been idle for `claim_idle`, through `XAUTOCLAIM` (by this consumer or
/// another), with its delivery count raised.
///
/// [`Ack::dead_letter`] reads the entry's own fields back (`XRANGE`), then, in one script
/// (`EVAL`), `XADD <dead-letter stream> * <original fields…> reason <reason> original_source
/// <stream> original_position <entry ID>` (the names of [`inbox_core::dead_letter`]) and, only
/// if that succeeded, `XACK <stream> <group> <entry ID>`: the copy and the ack are one step.
/// When it fails the entry stays pending and comes back as after a nack.
#[derive(Debug)]
pub struct RedisStreamAck {
    conn: Conn,
    settings: Arc<Settings>,
    entry_id: String,
}

impl RedisStreamAck {
    pub(crate) fn new(conn: Conn, settings: Arc<Settings>, entry_id: String) -> Self {
        Self {
            conn,
            settings,
            entry_id,
        }
    }

    /// The stream entry ID this handle acknowledges.
    pub fn entry_id(&self) -> &str {
        &self.entry_id
    }

    /// `XADD` to the dead-letter stream, then `XACK`, in one script ([`PARK`]).
    async fn park(&self, message: &Message, reason: &str) -> Result<()> {
        let original = entry_fields(&self.conn, &self.settings, &self.entry_id).await?;
        let s = &self.settings;
        let fields = original.unwrap_or_else(|| rebuild_fields(s, message));
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(PARK)
            .arg(2)
            .arg(&s.dead_letter_stream)
            .arg(&s.stream)
            .arg(&s.group)
            .arg(&self.entry_id);
        for (name, value) in &fields {
            cmd.arg(name.as_slice()).arg(value.as_slice());
        }
        cmd.arg(dead_letter::REASON)
            .arg(reason)
            .arg(dead_letter::ORIGINAL_SOURCE)
            .arg(&message.meta.source)
            .arg(dead_letter::ORIGINAL_POSITION)
            .arg(&message.meta.position);
        // Not repeated on a new connection: a lost reply may hide a copy already added.
        let _: Value = self.conn.query(&cmd, Duration::ZERO).await.map_err(|e| {
            Error::redis(
                format!(
                    "XADD to dead-letter stream {} and XACK of entry {}",
                    s.dead_letter_stream, self.entry_id
                ),
                e,
            )
        })?;
        Ok(())
    }
}

/// Parks an entry and acks it in one step: `XADD` to the dead-letter stream (`KEYS[1]`) with the
/// fields from `ARGV[3]` on, then `XACK` of entry `ARGV[2]` of the stream (`KEYS[2]`) for group
/// `ARGV[1]`. A script, not `MULTI`: inside `MULTI` an `XADD` that fails when it runs (the key
/// holds another type) does not stop the `XACK`, and the entry would be acked with no copy
/// anywhere; a failing `redis.call` ends the script before it.
/// A script's keys must share a hash slot on a Redis Cluster: name the streams with one hash tag
/// there (`{orders}` and `{orders}:dlq`).
const PARK: &str = r"
local added = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return added
";

/// An entry's own fields, read back so a dead-letter copy is exact (an invalid ID is kept as
/// sent); `None` when it is gone from the stream.
pub(crate) async fn entry_fields(
    conn: &Conn,
    s: &Settings,
    entry_id: &str,
) -> Result<Option<Fields>> {
    let value: Value = conn
        .idempotent(
            redis::cmd("XRANGE")
                .arg(&s.stream)
                .arg(entry_id)
                .arg(entry_id),
        )
        .await
        .map_err(|e| Error::redis(format!("XRANGE on stream {}", s.stream), e))?;
    Ok(reply::range_reply(value)?
        .into_iter()
        .find(|e| e.id == entry_id)
        .and_then(|e| e.fields))
}

/// One `XACK` for many entries of one stream and group.
pub(crate) async fn xack(conn: &mut Conn, s: &Settings, ids: &[String]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let mut cmd = redis::cmd("XACK");
    cmd.arg(&s.stream).arg(&s.group).arg(ids);
    let acked: i64 = conn
        .idempotent(&cmd)
        .await
        .map_err(|e| Error::redis(format!("XACK on stream {}", s.stream), e))?;
    if acked < ids.len() as i64 {
        // Another consumer claimed and acked some of them first (this one was slow past
        // `claim_idle`); the inbox already made that harmless.
        debug!(stream = %s.stream, asked = ids.len(), acked, "some entries were acked already");
    }
    Ok(())
}

#[async_trait]
impl Ack for RedisStreamAck {
    async fn ack(mut self) -> Result<(), SourceError> {
        Ok(xack(&mut self.conn, &self.settings, &[self.entry_id]).await?)
    }

    /// Leaves the entry pending; see the type's docs.
    async fn nack(self, _retry_after: Duration) -> Result<(), SourceError> {
        debug!(stream = %self.settings.stream, entry = %self.entry_id, "left pending; XAUTOCLAIM brings it back after claim_idle");
        Ok(())
    }

    /// `XADD` to the dead-letter stream and `XACK` in one script; see the type's docs.
    async fn dead_letter(self, message: &Message, reason: &str) -> Result<(), SourceError> {
        Ok(self.park(message, reason).await?)
    }

    /// One `XACK` per stream and group (a batch is normally all one), with every entry ID.
    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        let mut groups: Vec<(Arc<Settings>, Conn, Vec<String>)> = Vec::new();
        for ack in acks {
            let same = groups
                .iter_mut()
                .find(|(s, _, _)| s.stream == ack.settings.stream && s.group == ack.settings.group);
            match same {
                Some((_, _, ids)) => ids.push(ack.entry_id),
                None => groups.push((ack.settings, ack.conn, vec![ack.entry_id])),
            }
        }
        for (settings, mut conn, ids) in groups {
            xack(&mut conn, &settings, &ids).await?;
        }
        Ok(())
    }
}
