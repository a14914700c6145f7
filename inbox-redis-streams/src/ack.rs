//! `XACK`, one entry or a whole batch per round-trip; a dead letter's `XADD` and its `XACK` in
//! one script.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::{dead_letter, Ack, Message, SourceError};
use redis::Value;
use tracing::debug;

use crate::config::Settings;
use crate::connection::Conn;
use crate::reply::{self, Fields};
use crate::source::rebuild_fields;
use crate::sweep::{Mark, Reported};
use crate::{Error, Result};

/// Acknowledges one stream entry: `XACK <stream> <group> <entry ID>`, which removes it from the
/// group's pending list.
///
/// [`Ack::nack`] leaves the entry pending: Redis cannot delay a redelivery, so the entry comes
/// back once it has been idle for `claim_idle`, through `XAUTOCLAIM` (by this consumer or
/// another), with its delivery count raised.
///
/// [`Ack::dead_letter`] reads the entry's own fields back (`XRANGE`), then copies them to the
/// dead-letter stream and acks the entry in one script (see [Ack semantics](crate#ack-semantics)).
/// When it fails the entry stays pending and comes back as after a nack.
///
/// [`Ack::redeliver`] also leaves the entry pending, for the delay asked: it writes a
/// [`Mark`] in the hash `<stream>:<group>:redeliveries` and restarts the entry's idle time
/// (`XCLAIM … 0 <entry ID> JUSTID`, which leaves the delivery count alone); the source's claim
/// sweep takes it once it has been idle for its delay (see [`crate::sweep`]). A copy whose
/// entry was handed out again since (its `XPENDING` count is higher) leaves it as a nack does:
/// the latest copy settles it ([`Reported::may_hand_back`]). Later copies report the redelivery
/// count in [`Metadata::redeliveries`](inbox_core::Metadata::redeliveries); the mark is deleted
/// when the entry is acked or dead-lettered. The entry never leaves the stream or its pending
/// list, so other groups see nothing and a crash loses nothing; a consumer that reconnects
/// rereads its own pending entries at once, delayed or not.
#[derive(Debug)]
pub struct RedisStreamAck {
    conn: Conn,
    settings: Arc<Settings>,
    entry_id: String,
    /// What this copy reported: its delivery count goes into the mark of a hand-back, and
    /// when its redelivery count is above 0, settling it deletes its mark.
    reported: Reported,
}

impl RedisStreamAck {
    pub(crate) fn new(
        conn: Conn,
        settings: Arc<Settings>,
        entry_id: String,
        reported: Reported,
    ) -> Self {
        Self {
            conn,
            settings,
            entry_id,
            reported,
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
        cmd.arg((PARK, 2, &s.dead_letter_stream, &s.stream))
            .arg((&s.group, &self.entry_id));
        for (name, value) in &fields {
            cmd.arg((name.as_slice(), value.as_slice()));
        }
        cmd.arg((dead_letter::REASON, reason))
            .arg((dead_letter::ORIGINAL_SOURCE, &message.meta.source))
            .arg((dead_letter::ORIGINAL_POSITION, &message.meta.position));
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
    let value = s.on_stream(conn, "XRANGE", (entry_id, entry_id)).await?;
    Ok(reply::range_reply(value)?
        .into_iter()
        .find(|e| e.id == entry_id)
        .and_then(|e| e.fields))
}

/// One `XACK` for many entries of one stream and group.
pub(crate) async fn xack(conn: &Conn, s: &Settings, ids: &[String]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let acked: i64 = s.on_group(conn, "XACK", ids).await?;
    if acked < ids.len() as i64 {
        // Another consumer claimed and acked some of them first (this one was slow past
        // `claim_idle`); the inbox already made that harmless.
        debug!(stream = %s.stream, asked = ids.len(), acked, "some entries were acked already");
    }
    Ok(())
}

/// Deletes the redelivery marks of settled entries; a failure only leaves a stale mark, which
/// the next sweep ignores (the entry is no longer pending).
async fn unmark(conn: &Conn, s: &Settings, ids: &[&str]) {
    if ids.is_empty() {
        return;
    }
    if let Err(e) = s.on_marks::<i64>(conn, "HDEL", ids).await {
        debug!(error = %e, "could not delete redelivery marks; they outlive their entries");
    }
}

impl Ack for RedisStreamAck {
    async fn ack(self) -> Result<(), SourceError> {
        Self::ack_all(vec![self]).await
    }

    /// Marks the entry with its delay and restarts its idle time; see the type's docs.
    async fn redeliver(
        self,
        _message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        let (s, id) = (&self.settings, &self.entry_id);
        let rows = s.on_group(&self.conn, "XPENDING", (id, id, 1)).await?;
        let now = reply::pending_counts(rows)?.get(id).copied();
        if !self.reported.may_hand_back(now) {
            debug!(stream = %s.stream, entry = %id, delivery_count = ?self.reported.delivery_count, now = ?now, "an earlier copy: the entry was handed out again since, and its latest copy settles it; left pending");
            return Ok(());
        }
        let mark = Mark::new(redelivery + 1, delay, self.reported.delivery_count).to_string();
        let _: i64 = s.on_marks(&self.conn, "HSET", (id, mark)).await?;
        let args = (&s.consumer, 0, id, "JUSTID");
        let _: Value = s.on_group(&self.conn, "XCLAIM", args).await?;
        Ok(())
    }

    /// Leaves the entry pending; see the type's docs.
    async fn nack(self, _retry_after: Duration) -> Result<(), SourceError> {
        debug!(stream = %self.settings.stream, entry = %self.entry_id, "left pending; XAUTOCLAIM brings it back after claim_idle");
        Ok(())
    }

    /// `XADD` to the dead-letter stream and `XACK` in one script; see the type's docs.
    async fn dead_letter(self, message: &Message, reason: &str) -> Result<(), SourceError> {
        self.park(message, reason).await?;
        if self.reported.redeliveries > 0 {
            unmark(&self.conn, &self.settings, &[&self.entry_id]).await;
        }
        Ok(())
    }

    /// One `XACK` per stream and group (a batch is normally all one), with every entry ID.
    async fn ack_all(mut acks: Vec<Self>) -> Result<(), SourceError> {
        while let Some(first) = acks.first() {
            let (settings, conn) = (Arc::clone(&first.settings), first.conn.clone());
            let (same, rest): (Vec<_>, Vec<_>) = acks.into_iter().partition(|ack| {
                ack.settings.stream == settings.stream && ack.settings.group == settings.group
            });
            acks = rest;
            let ids: Vec<String> = same.iter().map(|ack| ack.entry_id.clone()).collect();
            xack(&conn, &settings, &ids).await?;
            let marked: Vec<&str> = same
                .iter()
                .filter(|ack| ack.reported.redeliveries > 0)
                .map(|ack| ack.entry_id.as_str())
                .collect();
            unmark(&conn, &settings, &marked).await;
        }
        Ok(())
    }
}
