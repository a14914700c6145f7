//! Adding entries in the layout [`RedisStreamSource`](crate::RedisStreamSource) reads.

use std::time::Duration;

use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{async_trait, MessageId, OutgoingMessage, Publish, PublishError};
use redis::aio::ConnectionManager;
use redis::Client;

use crate::connection::Conn;
use crate::{Error, Result, DEFAULT_ID_FIELD, PAYLOAD_FIELD};

/// Adds entries to a stream: `XADD <stream> * <ID field> <id> payload <bytes> [<header> <value>…]`.
///
/// The message ID is what the consumer deduplicates on, so a retry of a failed `XADD` must
/// reuse the same ID: use [`RedisStreamProducer::send_with_id`] with an ID you keep, and a retry
/// that did reach Redis twice is applied once.
#[derive(Clone)]
pub struct RedisStreamProducer {
    conn: Connection,
    stream: String,
    id_field: String,
}

#[derive(Clone)]
enum Connection {
    /// From [`RedisStreamProducer::connect`]: bounded commands, replaced when it fails.
    Own(Conn),
    /// The caller's.
    Manager(ConnectionManager),
}

// Not derived: the stream and the ID field say which producer this is; a caller's connection
// manager would add its whole client configuration.
impl std::fmt::Debug for RedisStreamProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamProducer")
            .field("stream", &self.stream)
            .field("id_field", &self.id_field)
            .finish_non_exhaustive()
    }
}

/// What one `XADD` produced.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sent {
    /// The message ID written to the ID field.
    pub message_id: MessageId,
    /// The stream entry ID Redis assigned.
    pub entry_id: String,
}

impl RedisStreamProducer {
    /// Connects to `url` and writes to `stream`.
    pub async fn connect(url: &str, stream: impl Into<String>) -> Result<Self> {
        let client = Client::open(url).map_err(|e| {
            Error::Config(format!(
                "Redis URL {} does not parse: {e}",
                inbox_core::redact_url(url)
            ))
        })?;
        // A command gets 10 s; a connection that failed or went silent is replaced by the next
        // send (a redis-rs `ConnectionManager` keeps one whose reply timed out, and its
        // reconnect could hang a send for good after a server restart).
        let conn = Conn::connect(client, "producer", Duration::from_secs(10))
            .await
            .map_err(|e| Error::redis("connecting to Redis for the producer", e))?;
        Ok(Self {
            conn: Connection::Own(conn),
            stream: stream.into(),
            id_field: DEFAULT_ID_FIELD.to_owned(),
        })
    }

    /// Writes to `stream` over a connection you made.
    ///
    /// Its timeouts and reconnects are redis-rs's: a `ConnectionManager` does not reconnect
    /// after a reply timed out, so a connection that went silent fails every later send. Prefer
    /// [`RedisStreamProducer::connect`] where that matters.
    pub fn with_connection(conn: ConnectionManager, stream: impl Into<String>) -> Self {
        Self {
            conn: Connection::Manager(conn),
            stream: stream.into(),
            id_field: DEFAULT_ID_FIELD.to_owned(),
        }
    }

    /// The field the ID goes in (default `event_id`); must match the consumer's.
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// Adds `payload` under a fresh UUIDv7 ID.
    pub async fn send(&self, payload: impl AsRef<[u8]>) -> Result<Sent> {
        self.send_with(&MessageId::generate(), payload, &[]).await
    }

    /// Adds `payload` under `id`.
    pub async fn send_with_id(&self, id: &MessageId, payload: impl AsRef<[u8]>) -> Result<Sent> {
        self.send_with(id, payload, &[]).await
    }

    /// Adds `payload` under `id`, with extra fields that the consumer sees as headers.
    pub async fn send_with(
        &self,
        id: &MessageId,
        payload: impl AsRef<[u8]>,
        headers: &[(&str, &[u8])],
    ) -> Result<Sent> {
        for (name, _) in headers {
            if *name == self.id_field || *name == PAYLOAD_FIELD {
                return Err(Error::Config(format!(
                    "header `{name}` would shadow the ID or payload field; rename it"
                )));
            }
        }
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream)
            .arg("*")
            .arg(&self.id_field)
            .arg(id.as_str())
            .arg(PAYLOAD_FIELD)
            .arg(payload.as_ref());
        for (name, value) in headers {
            cmd.arg(*name).arg(*value);
        }
        // The current span's trace context (feature `opentelemetry` of inbox-core), unless the
        // caller passed one.
        if let Some(parent) = inbox_core::TraceParent::current() {
            if !headers.iter().any(|(name, _)| *name == TRACEPARENT_HEADER) {
                cmd.arg(TRACEPARENT_HEADER).arg(parent.to_string());
            }
        }
        // Not repeated on a new connection: only the caller can retry under the same ID.
        let sent = match &self.conn {
            Connection::Own(conn) => conn.query(&cmd, Duration::ZERO).await,
            Connection::Manager(conn) => cmd.query_async(&mut conn.clone()).await,
        };
        let entry_id: String =
            sent.map_err(|e| Error::redis(format!("XADD to stream {}", self.stream), e))?;
        Ok(Sent {
            message_id: id.clone(),
            entry_id,
        })
    }
}

/// `destination` must be the stream this producer writes to: a producer refuses any other with
/// a [`Recovery::Fatal`](inbox_core::Recovery::Fatal) error ([`Error::Config`]); make one per
/// stream and route them with [`Destinations`](inbox_core::Destinations). Keys are ignored: a
/// stream has one order for all its entries.
///
/// The whole batch is one command, an `EVAL` of a script that runs one `XADD` per message in
/// slice order (one round-trip, and Redis runs it without interleaving other clients'
/// commands); `Ok` once Redis answered that it added them all. The script needs `EVAL`
/// permission.
#[async_trait]
impl Publish for RedisStreamProducer {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        /// `XADD` per (ID, payload) pair after the ID and payload field names.
        const XADD_ALL: &str = "local n = 0
            for i = 3, #ARGV, 2 do
                redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i], ARGV[2], ARGV[i + 1])
                n = n + 1
            end
            return n";
        let failed = |e: Error| {
            PublishError::new(
                e.recovery(),
                format!("adding to Redis stream `{destination}`"),
                e,
            )
        };
        if destination != self.stream {
            return Err(failed(Error::Config(format!(
                "this RedisStreamProducer writes to stream `{}`, not `{destination}`; make one \
                 producer per stream and route them with inbox_core::Destinations",
                self.stream
            ))));
        }
        if messages.is_empty() {
            return Ok(());
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(XADD_ALL)
            .arg(1)
            .arg(&self.stream)
            .arg(&self.id_field)
            .arg(PAYLOAD_FIELD);
        for message in messages {
            cmd.arg(message.id.as_str()).arg(message.payload.as_slice());
        }
        // Not repeated on a new connection here: the relay retries under the same IDs.
        let added = match &self.conn {
            Connection::Own(conn) => conn.query(&cmd, Duration::ZERO).await,
            Connection::Manager(conn) => cmd.query_async(&mut conn.clone()).await,
        };
        let added: usize = added.map_err(|e| {
            failed(Error::redis(
                format!("EVAL of XADDs to stream {}", self.stream),
                e,
            ))
        })?;
        if added != messages.len() {
            return Err(failed(Error::reply(
                "EVAL",
                format!("added {added} of {} entries", messages.len()),
            )));
        }
        Ok(())
    }
}
