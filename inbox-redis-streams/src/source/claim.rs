//! Recovery of dead consumers' entries: the `XAUTOCLAIM` sweep, and claimed entries that were
//! trimmed or deleted from the stream before anyone applied them.

use std::sync::Arc;

use inbox_core::Delivery;
use redis::Value;
use tokio::time::Instant;
use tracing::{info, warn};

use super::RedisStreamSource;
use crate::reply::{self, Entry};
use crate::sweep::{entry_id_key, Mark};
use crate::{RedisStreamAck, Result};

impl RedisStreamSource {
    /// One step of the `XAUTOCLAIM` sweep over the whole pending list, from `claim_cursor`.
    pub(super) async fn autoclaim(&mut self, max: usize) -> Result<Value> {
        let s = &self.settings;
        let idle = s.claim_idle.as_millis() as u64;
        let args = (&s.consumer, idle, self.sweep.cursor(), "COUNT", max);
        s.on_group(&self.commands, "XAUTOCLAIM", args).await
    }

    /// Whether any entry of this stream and group waits under a redelivery schedule: then the
    /// sweep is [`RedisStreamSource::claim_due`] instead of `XAUTOCLAIM`.
    pub(super) async fn any_delayed(&mut self) -> Result<bool> {
        let n: i64 = self
            .settings
            .on_marks(&self.commands, "HLEN", None::<&str>)
            .await?;
        Ok(n > 0)
    }

    /// The redelivery marks of `ids` ([`Settings::redeliveries_key`](crate::config::Settings)),
    /// for those handed back under a schedule.
    pub(super) async fn redelivery_marks(&self, ids: &[&str]) -> Result<Vec<Option<Mark>>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let values: Vec<Option<String>> =
            self.settings.on_marks(&self.commands, "HMGET", ids).await?;
        Ok(values.into_iter().map(|v| Mark::parse(&v?)).collect())
    }

    /// One step of the sweep while entries wait under a redelivery schedule (see
    /// [`crate::sweep`]): `XPENDING` from the sweep's cursor, [`Sweep::due`](crate::sweep::Sweep::due)
    /// picks the entries to claim, `XCLAIM` with each minimum idle time takes them. The reply has
    /// `XAUTOCLAIM`'s shape, for [`RedisStreamSource::deliver_claimed`].
    pub(super) async fn claim_due(&mut self, max: usize) -> Result<Value> {
        let s = Arc::clone(&self.settings);
        let args = (self.sweep.range_start(), "+", max);
        let rows = reply::pending_rows(s.on_group(&self.commands, "XPENDING", args).await?)?;
        let ids: Vec<&str> = rows.iter().map(|row| row.id.as_str()).collect();
        let marks = self.redelivery_marks(&ids).await?;
        let due = self.sweep.due(&rows, &marks, max);
        let mut entries = Vec::new();
        for (min_idle, ids) in &due.claims {
            let args = (&s.consumer, *min_idle, ids);
            if let Value::Array(claimed) = s.on_group(&self.commands, "XCLAIM", args).await? {
                entries.extend(claimed);
            }
        }
        Ok(Value::Array(vec![
            Value::BulkString(due.cursor.into_bytes()),
            Value::Array(entries),
            Value::Array(Vec::new()),
        ]))
    }

    /// The deliveries in the reply to the sweep step that started at `start`. Claimed entries
    /// that were trimmed or deleted from the stream cannot be applied: Redis 7 drops them from
    /// the pending list itself, Redis 6.2 leaves them pending under this consumer, so they are
    /// acked away here; either way they are logged, and never hold up the live ones.
    pub(super) async fn deliver_claimed(
        &mut self,
        start: &str,
        value: Value,
    ) -> Result<Vec<Delivery<RedisStreamAck>>> {
        let claimed = reply::autoclaim_reply(value)?;
        let s = &self.settings;
        if self.sweep.advance(&claimed.cursor) {
            // Sweep finished; the next one starts from the beginning after the interval.
            self.next_claim = Instant::now() + s.claim_interval;
        }
        if !claimed.entries.is_empty() {
            info!(consumer = %s.consumer, stream = %s.stream, entries = claimed.entries.len(), "claimed idle pending entries");
        }
        if !claimed.deleted.is_empty() {
            warn!(stream = %s.stream, group = %s.group, entries = claimed.deleted.len(), ids = ?claimed.deleted, "idle pending entries were trimmed or deleted from the stream before they were applied; Redis dropped them from the pending list");
        }
        if claimed.vanished > 0 {
            if let Err(e) = self
                .ack_vanished(start, &claimed.cursor, &claimed.entries, claimed.vanished)
                .await
            {
                warn!(stream = %self.settings.stream, error = %e, "could not ack claimed entries that were deleted from the stream; the next sweep tries again");
            }
        }
        self.deliver_pending(claimed.entries).await
    }

    /// Redis 6.2 answers each claimed entry that was trimmed or deleted with a bare nil: it is
    /// pending under this consumer now, but the reply has no ID for it. It is found among this
    /// consumer's pending entries in the range the sweep step covered (`start` up to the next
    /// cursor): those not in the reply and no longer in the stream. Other pending entries of
    /// ours in that range (nacked ones, not idle long enough to be claimed) are still in the
    /// stream and left alone.
    async fn ack_vanished(
        &mut self,
        start: &str,
        cursor: &str,
        live: &[Entry],
        vanished: usize,
    ) -> Result<()> {
        let end = if cursor == "0-0" {
            "+".to_owned()
        } else {
            format!("({cursor}")
        };
        let mut candidates: Vec<String> = self
            .delivery_counts(start, &end, None)
            .await?
            .into_keys()
            .filter(|id| live.iter().all(|e| &e.id != id))
            .collect();
        candidates.sort_by_key(|id| entry_id_key(id));
        let mut gone = Vec::with_capacity(vanished);
        for id in candidates {
            if gone.len() == vanished {
                break;
            }
            let fields = crate::ack::entry_fields(&self.commands, &self.settings, &id).await?;
            if fields.is_none() {
                gone.push(id);
            }
        }
        let s = &self.settings;
        if gone.len() < vanished {
            warn!(stream = %s.stream, group = %s.group, expected = vanished, found = gone.len(), "not every claimed entry reported as deleted was found in the pending list");
        }
        if !gone.is_empty() {
            warn!(stream = %s.stream, group = %s.group, entries = gone.len(), ids = ?gone, "idle pending entries were trimmed or deleted from the stream before they were applied; nothing to apply, acking them");
            crate::ack::xack(&self.commands, &self.settings, &gone).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use redis::aio::MultiplexedConnection;

    use super::*;

    async fn run<T: redis::FromRedisValue>(
        raw: &mut MultiplexedConnection,
        command: &str,
        args: impl redis::ToRedisArgs,
    ) -> T {
        let mut cmd = redis::cmd(command);
        cmd.arg(args).query_async(raw).await.expect(command)
    }

    /// Redis 6.2 answers `XAUTOCLAIM` for a claimed entry that was trimmed or deleted with a
    /// bare nil (Redis 7 drops it and lists its ID apart), so the entry stays in the claimer's
    /// pending list with no ID in the reply. The local Redis is 7, so the state is set up for
    /// real (three entries pending under `c1`, the middle one deleted) and the reply is the
    /// bytes 6.2 would send for that claim.
    #[tokio::test]
    async fn a_redis_6_2_claim_of_a_trimmed_entry_acks_it_and_delivers_the_rest() {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let stream = format!("inbox-test:claim-6.2:{}", uuid::Uuid::new_v4().simple());
        let mut raw = redis::Client::open(url.as_str())
            .expect("REDIS_URL parses")
            .get_multiplexed_async_connection()
            .await
            .expect("Redis is reachable at REDIS_URL");
        let mut ids: Vec<String> = Vec::new();
        for n in 1..=3 {
            let fields = ("event_id", format!("evt-{n}"), "payload", n);
            ids.push(run(&mut raw, "XADD", (&stream, "*", fields)).await);
        }
        let mut source = crate::RedisConnection::new(&url)
            .source(&stream, "g")
            .consumer_name("c1")
            .connect()
            .await
            .expect("source connects");
        let read = ("GROUP", "g", "c1", "STREAMS", &stream, ">");
        let _: Value = run(&mut raw, "XREADGROUP", read).await;
        let _: i64 = run(&mut raw, "XDEL", (&stream, &ids[1])).await;

        let entry = |id: &str, n: u8| {
            format!(
                "*2\r\n${}\r\n{id}\r\n*4\r\n$8\r\nevent_id\r\n$5\r\nevt-{n}\r\n\
                 $7\r\npayload\r\n$1\r\n{n}\r\n",
                id.len()
            )
        };
        let wire = format!(
            "*2\r\n$3\r\n0-0\r\n*3\r\n{}$-1\r\n{}",
            entry(&ids[0], 1),
            entry(&ids[2], 3)
        );
        let reply = redis::parse_redis_value(wire.as_bytes()).expect("valid RESP2");
        let deliveries = source
            .deliver_claimed("0-0", reply)
            .await
            .expect("the live entries are delivered");
        let positions: Vec<&str> = deliveries
            .iter()
            .map(|d| d.message.meta.position.as_str())
            .collect();
        assert_eq!(positions, [ids[0].as_str(), ids[2].as_str()]);

        let whole_list = (&stream, "g", "-", "+", 10);
        let pending = |value: Value| {
            let mut ids: Vec<String> = reply::pending_counts(value)
                .expect("parses")
                .into_keys()
                .collect();
            ids.sort();
            ids
        };
        assert_eq!(
            pending(run(&mut raw, "XPENDING", whole_list).await),
            [ids[0].clone(), ids[2].clone()],
            "the trimmed entry left the pending list"
        );
        inbox_core::Ack::ack_all(deliveries.into_iter().map(|d| d.ack).collect())
            .await
            .expect("ack");
        assert!(pending(run(&mut raw, "XPENDING", whole_list).await).is_empty());
        let _: i64 = run(&mut raw, "DEL", &stream).await;
    }
}
