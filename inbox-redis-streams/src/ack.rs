//! `XACK`, one entry or a whole batch per round-trip.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::{async_trait, Ack, SourceError};
use tracing::debug;

use crate::config::Settings;
use crate::connection::Conn;
use crate::{Error, Result};

/// Acknowledges one stream entry: `XACK <stream> <group> <entry ID>`, which removes it from the
/// group's pending list.
///
/// [`Ack::nack`] leaves the entry pending: Redis cannot delay a redelivery, so the entry comes
/// back once it has been idle for `claim_idle`, through `XAUTOCLAIM` (by this consumer or
/// another), with its delivery count raised. In `AckMode::NoAck` (feature
/// `never-in-production`) both do nothing: Redis forgot the entry when it handed it out.
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
}

/// One `XACK` for many entries of one stream and group.
pub(crate) async fn xack(conn: &mut Conn, s: &Settings, ids: &[String]) -> Result<()> {
    if ids.is_empty() || s.ack_mode.forgets_on_delivery() {
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
