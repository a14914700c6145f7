//! The consumer-group reader: own pending entries first, then reclaimed ones, then new ones.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{Binding, Capabilities, Delivery, IdCarrier, Message, MessageSource, SourceError};
use redis::Value;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::config::{RedisStreamSourceBuilder, Settings};
use crate::connection::Conn;
use crate::reply::{self, Entry, Fields};
use crate::sweep::{self, Reported, Sweep};
use crate::{Error, RedisStreamAck, Result, PAYLOAD_FIELD};

mod claim;

/// Reads one Redis stream through a consumer group, for an [`inbox_core::Consumer`].
///
/// Each [`receive`](MessageSource::receive) returns, in this order of preference:
/// 1. right after start, this consumer's own pending entries (`XREADGROUP … STREAMS key 0`,
///    then onwards from the last one read) until none are left: what this consumer name had
///    read but not acked when its previous process died;
/// 2. every `claim_interval`, entries idle in any consumer's pending list for longer than
///    `claim_idle`, taken over with `XAUTOCLAIM` (a full sweep of the pending list, one batch
///    per receive): the entries of consumers that died and never came back;
/// 3. new entries (`XREADGROUP … BLOCK … COUNT n STREAMS key >`).
///
/// The delivery count of pending and claimed entries comes from `XPENDING` (both paths raise
/// it); a new entry's is 1.
#[derive(Debug)]
pub struct RedisStreamSource {
    settings: Arc<Settings>,
    reader: Conn,
    commands: Conn,
    /// Where the reread of our own pending list goes on; `None` once it is drained.
    history: Option<String>,
    /// Where the sweep over the pending list goes on, and what it claims.
    sweep: Sweep,
    next_claim: Instant,
    /// Connections made so far, reads and commands: when it grows, one was lost.
    connections: u64,
}

impl RedisStreamSource {
    /// Starts configuring a source reading `stream` as consumer group `group`, on the Redis
    /// `REDIS_URL` names: [`RedisConnection::from_env`](crate::RedisConnection::from_env)`()`
    /// [`.source(stream, group)`](crate::RedisConnection::source).
    pub fn builder(
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> RedisStreamSourceBuilder {
        crate::RedisConnection::from_env().source(stream, group)
    }

    pub(crate) async fn start(settings: Settings, reader: Conn, commands: Conn) -> Result<Self> {
        let sweep = Sweep::new(settings.claim_idle);
        let mut source = Self {
            settings: Arc::new(settings),
            reader,
            commands,
            history: Some("0".to_owned()),
            sweep,
            next_claim: Instant::now(),
            connections: 0,
        };
        source.connections = source.connections_made();
        source.create_group().await?;
        Ok(source)
    }

    /// The stream key.
    pub fn stream(&self) -> &str {
        &self.settings.stream
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.settings.group
    }

    /// This consumer's name inside the group.
    pub fn consumer_name(&self) -> &str {
        &self.settings.consumer
    }

    /// Where dead-lettered entries go.
    pub fn dead_letter_stream(&self) -> &str {
        &self.settings.dead_letter_stream
    }

    /// `XGROUP CREATE … 0 MKSTREAM`, once, at start; see
    /// [A deleted consumer group](crate#a-deleted-consumer-group).
    async fn create_group(&mut self) -> Result<()> {
        let s = &self.settings;
        let create = ("CREATE", &s.stream, &s.group, "0", "MKSTREAM");
        let created: redis::RedisResult<Value> = self
            .commands
            .idempotent(redis::cmd("XGROUP").arg(create))
            .await;
        match created {
            Ok(_) => info!(stream = %s.stream, group = %s.group, "created consumer group"),
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => {
                let context = format!("XGROUP CREATE {} {}", s.stream, s.group);
                return Err(Error::redis(context, e));
            }
        }
        Ok(())
    }

    fn connections_made(&self) -> u64 {
        self.reader.made() + self.commands.made()
    }

    async fn read(&mut self, max: usize) -> Result<Vec<Delivery<RedisStreamAck>>> {
        let made = self.connections_made();
        if made != self.connections {
            // A lost connection may have taken with it the reply to a read (its entries are
            // pending under this name, unseen) or an ack: reread them now, not after
            // `claim_idle`. The inbox skips those already applied.
            self.connections = made;
            if self.history.is_none() {
                info!(consumer = %self.settings.consumer, "reconnected; rereading own pending entries");
                self.history = Some("0".to_owned());
            }
        }
        if let Some(after) = self.history.clone() {
            let entries = self.read_group(max, &after, None).await?;
            match entries.last() {
                Some(last) => {
                    self.history = Some(last.id.clone());
                    return self.deliver_pending(entries).await;
                }
                None => {
                    debug!(consumer = %self.settings.consumer, "own pending entries drained");
                    self.history = None;
                }
            }
        }
        if Instant::now() >= self.next_claim {
            let start = self.sweep.cursor().to_owned();
            let reply = if self.any_delayed().await? {
                self.claim_due(max).await?
            } else {
                self.autoclaim(max).await?
            };
            let deliveries = self.deliver_claimed(&start, reply).await?;
            if !deliveries.is_empty() {
                return Ok(deliveries);
            }
        }
        let entries = self
            .read_group(max, ">", Some(self.settings.poll_timeout))
            .await?;
        Ok(entries
            .into_iter()
            .filter_map(|entry| self.delivery(entry, Reported::new(Some(1), None)))
            .collect())
    }

    /// `XREADGROUP GROUP g c COUNT n [BLOCK ms] STREAMS key <after>`.
    async fn read_group(
        &mut self,
        max: usize,
        after: &str,
        block: Option<Duration>,
    ) -> Result<Vec<Entry>> {
        let s = &self.settings;
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg(("GROUP", &s.group, &s.consumer, "COUNT", max));
        if let Some(block) = block {
            cmd.arg(("BLOCK", block.as_millis().max(1) as u64));
        }
        cmd.arg(("STREAMS", &s.stream, after));
        // The blocking read has a connection of its own; the others use the command one.
        let value: redis::RedisResult<Value> = if let Some(block) = block {
            // Not repeated: the consumer loop backs off and reads again, and whatever a lost
            // reply had delivered is pending under this name, reread after the reconnect.
            self.reader.query(&cmd, block).await
        } else {
            self.commands.idempotent(&cmd).await
        };
        let value = value
            .map_err(|e| Error::redis(format!("XREADGROUP {} on stream {}", after, s.stream), e))?;
        reply::read_reply("XREADGROUP", value)
    }

    /// Deliveries for entries that were pending: with their delivery counts from `XPENDING`,
    /// and entries deleted from the stream meanwhile acked away.
    async fn deliver_pending(
        &mut self,
        entries: Vec<Entry>,
    ) -> Result<Vec<Delivery<RedisStreamAck>>> {
        let (live, deleted): (Vec<_>, Vec<_>) =
            entries.into_iter().partition(|e| e.fields.is_some());
        if !deleted.is_empty() {
            let ids: Vec<String> = deleted.into_iter().map(|e| e.id).collect();
            warn!(stream = %self.settings.stream, group = %self.settings.group, entries = ids.len(), ids = ?ids, "pending entries were trimmed or deleted from the stream; nothing to apply, acking them");
            // A failed XACK must not hold up the live entries: these come back and are acked
            // next time.
            if let Err(e) = crate::ack::xack(&self.commands, &self.settings, &ids).await {
                warn!(stream = %self.settings.stream, error = %e, "could not ack pending entries deleted from the stream");
            }
        }
        let ids: Vec<&str> = live.iter().map(|e| e.id.as_str()).collect();
        let counts = match sweep::id_range(ids.iter().copied()) {
            Some((first, last)) => self.delivery_counts(first, last, Some(&ids)).await?,
            None => HashMap::new(),
        };
        // Only entries that were pending can carry a redelivery mark.
        let marks = self.redelivery_marks(&ids).await?;
        Ok(live
            .into_iter()
            .zip(marks)
            .filter_map(|(entry, mark)| {
                let count = counts.get(&entry.id).copied();
                self.delivery(entry, Reported::new(count, mark.as_ref()))
            })
            .collect())
    }

    /// This consumer's pending entries from `first` to `last` with their delivery counts
    /// (`XPENDING key group start last n consumer`, a page at a time), until each of `wanted`
    /// is found (entries just read or claimed are all there) or, with `None`, to the range's
    /// end. Other entries of ours sit between them (in flight, or nacked and waiting for their
    /// idle time): one `XAUTOCLAIM` step scans ten times the entries it may claim, so more than
    /// a page of them where many are in flight.
    async fn delivery_counts(
        &self,
        first: &str,
        last: &str,
        wanted: Option<&[&str]>,
    ) -> Result<HashMap<String, u32>> {
        let s = &self.settings;
        let page = wanted.map_or(0, <[&str]>::len) + PENDING_PAGE;
        let mut counts = HashMap::new();
        let mut start = first.to_owned();
        loop {
            let args = (start.as_str(), last, page, &s.consumer);
            let rows = reply::pending_rows(s.on_group(&self.commands, "XPENDING", args).await?)?;
            let next = match rows.last() {
                Some(row) if rows.len() == page => format!("({}", row.id),
                _ => String::new(),
            };
            counts.extend(rows.into_iter().map(|row| (row.id, row.delivery_count)));
            let found = wanted.is_some_and(|ids| ids.iter().all(|id| counts.contains_key(*id)));
            if next.is_empty() || found {
                return Ok(counts);
            }
            start = next;
        }
    }

    fn delivery(&self, entry: Entry, reported: Reported) -> Option<Delivery<RedisStreamAck>> {
        let fields = entry.fields?;
        let message = to_message(&self.settings, &entry.id, fields, reported);
        let ack = RedisStreamAck::new(
            self.commands.clone(),
            Arc::clone(&self.settings),
            entry.id,
            reported,
        );
        Some(Delivery { message, ack })
    }
}

impl MessageSource for RedisStreamSource {
    type Ack = RedisStreamAck;

    fn system(&self) -> &'static str {
        "redis"
    }

    fn consumer_group(&self) -> Option<&str> {
        Some(&self.settings.group)
    }

    /// Delivery counts and delayed redelivery (see [`RedisStreamAck`]). No delayed nack: a
    /// nacked entry comes back after `claim_idle`. No lanes: one stream, one order.
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_delivery_count()
            .with_delayed_redelivery()
    }

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<Self::Ack>>, SourceError> {
        match self.read(max.max(1)).await {
            Ok(deliveries) => Ok(deliveries),
            Err(e) => {
                let s = &self.settings;
                let e = e.no_group(&s.stream, &s.group);
                if matches!(e, Error::GroupMissing { .. }) {
                    error!(stream = %s.stream, group = %s.group, error = %e, "consumer group is gone; stopping instead of re-creating it");
                }
                Err(e.into())
            }
        }
    }
}

/// Turns a stream entry into a [`Message`]: the ID field is the ID, `payload` the body, every
/// other field a header, in entry order.
fn to_message(settings: &Settings, entry_id: &str, fields: Fields, reported: Reported) -> Message {
    let id = settings.id_from.read(&EntryFields(&fields));
    // The ID field named as a header is not repeated among the headers; `rebuild_fields` puts
    // it back first.
    let (_, payload, headers) = split_fields(fields, settings.id_from.header_name());
    let mut message = Message::new(id, payload);
    message.headers = headers;
    let meta = &mut message.meta;
    meta.source = settings.stream.clone();
    meta.position = entry_id.to_owned();
    meta.delivery_count = reported.delivery_count;
    meta.redelivered = reported.redelivered;
    meta.redeliveries = reported.redeliveries;
    // One stream, one order: no lane.
    meta.timestamp = entry_time(entry_id);
    message
}

/// How many pending entries one `XPENDING` for delivery counts reads beyond those it looks for.
const PENDING_PAGE: usize = 1000;

/// Where a stream entry keeps what [`IdFrom`](inbox_core::IdFrom) reads: its fields (the `payload` field is the
/// body). Redis has no message-ID property, and CloudEvents defines no Redis binding, so only
/// structured-mode events (in the payload) are read.
pub(crate) const ID_BINDING: Binding = Binding {
    broker: "Redis Streams",
    header: "field",
    property: None,
    position: None,
    cloud_events_prefixes: &[],
};

/// A stream entry as [`IdFrom::read`](inbox_core::IdFrom::read) sees it.
struct EntryFields<'a>(&'a Fields);

impl IdCarrier for EntryFields<'_> {
    fn binding(&self) -> &Binding {
        &ID_BINDING
    }

    fn header(&self, name: &str) -> Option<Result<Cow<'_, [u8]>, String>> {
        self.field(name).map(|value| Ok(Cow::Borrowed(value)))
    }

    fn payload(&self) -> &[u8] {
        self.field(PAYLOAD_FIELD).unwrap_or_default()
    }
}

impl EntryFields<'_> {
    fn field(&self, name: &str) -> Option<&[u8]> {
        let (_, value) = self.0.iter().find(|(field, _)| field == name.as_bytes())?;
        Some(value)
    }
}

/// A message's headers: names and values, in entry order.
type Headers = Vec<(String, Vec<u8>)>;

/// An entry's fields as a message holds them: the value of the first field named `id_field`,
/// the body (the first `payload` field), and every other field as a header, in entry order.
pub(crate) fn split_fields(
    fields: Fields,
    id_field: Option<&str>,
) -> (Option<Vec<u8>>, Vec<u8>, Headers) {
    let (mut id, mut payload, mut headers) = (None, None, Vec::new());
    for (name, value) in fields {
        if id.is_none() && id_field.is_some_and(|field| name == field.as_bytes()) {
            id = Some(value);
        } else if payload.is_none() && name == PAYLOAD_FIELD.as_bytes() {
            payload = Some(value);
        } else {
            headers.push((String::from_utf8_lossy(&name).into_owned(), value));
        }
    }
    (id, payload.unwrap_or_default(), headers)
}

/// When Redis added the entry: the milliseconds part of its ID (`<ms>-<seq>`).
pub(crate) fn entry_time(entry_id: &str) -> Option<std::time::SystemTime> {
    let ms: u64 = entry_id.split_once('-')?.0.parse().ok()?;
    Some(std::time::UNIX_EPOCH + Duration::from_millis(ms))
}

/// The fields of a message that is no longer in the stream, as well as they can be rebuilt.
pub(crate) fn rebuild_fields(settings: &Settings, message: &Message) -> Fields {
    let mut fields = Vec::with_capacity(message.headers.len() + 2);
    if let (Ok(id), Some(id_field)) = (&message.id, settings.id_from.header_name()) {
        fields.push((
            id_field.as_bytes().to_vec(),
            id.as_str().as_bytes().to_vec(),
        ));
    }
    fields.push((PAYLOAD_FIELD.as_bytes().to_vec(), message.payload.clone()));
    for (name, value) in &message.headers {
        fields.push((name.clone().into_bytes(), value.clone()));
    }
    fields
}

#[cfg(test)]
mod tests {
    use inbox_core::IdFrom;

    use super::*;

    fn settings() -> Settings {
        Settings {
            stream: "s".into(),
            group: "g".into(),
            consumer: "c".into(),
            id_from: IdFrom::header("event_id"),
            dead_letter_stream: "s:dlq".into(),
            poll_timeout: Duration::from_millis(10),
            claim_idle: Duration::from_secs(1),
            claim_interval: Duration::from_secs(1),
        }
    }

    #[test]
    fn entries_become_messages() {
        let fields = vec![
            (b"trace".to_vec(), b"t1".to_vec()),
            (b"event_id".to_vec(), b"evt-1".to_vec()),
            (b"payload".to_vec(), b"{}".to_vec()),
        ];
        let m = to_message(&settings(), "5-0", fields, Reported::new(Some(3), None));
        assert_eq!(m.id.as_ref().map(|id| id.as_str()), Ok("evt-1"));
        assert_eq!(m.payload, b"{}");
        assert_eq!(m.header("trace"), Some(&b"t1"[..]));
        assert_eq!(m.meta.position, "5-0");
        assert_eq!(
            m.meta.timestamp,
            Some(std::time::UNIX_EPOCH + Duration::from_millis(5))
        );
        assert!(m.meta.redelivered);
        let rebuilt = rebuild_fields(&settings(), &m);
        assert_eq!(rebuilt[0], (b"event_id".to_vec(), b"evt-1".to_vec()));

        let no_id = to_message(
            &settings(),
            "6-0",
            vec![(b"payload".to_vec(), b"x".to_vec())],
            Reported::new(Some(1), None),
        );
        assert_eq!(
            no_id.id.expect_err("refused").to_string(),
            "message has no ID: field event_id is missing"
        );
    }
}
