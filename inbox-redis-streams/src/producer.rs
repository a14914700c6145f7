//! Adding entries in the layout [`RedisStreamSource`](crate::RedisStreamSource) reads.

use std::time::Duration;

use inbox_core::MessageId;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Client;

use crate::config::Conn;
use crate::{Error, Result, DEFAULT_ID_FIELD, PAYLOAD_FIELD};

/// Adds entries to a stream: `XADD <stream> * <ID field> <id> payload <bytes> [<header> <value>…]`.
///
/// The message ID is what the consumer deduplicates on, so a retry of a failed `XADD` must
/// reuse the same ID: use [`RedisStreamProducer::send_with_id`] with an ID you keep, and a retry
/// that did reach Redis twice is applied once.
#[derive(Debug, Clone)]
pub struct RedisStreamProducer {
    conn: Conn,
    stream: String,
    id_field: String,
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
        let client = Client::open(url)
            .map_err(|e| Error::Config(format!("Redis URL {url:?} does not parse: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_secs(5))
            .set_response_timeout(Duration::from_secs(10));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| Error::redis("connecting to Redis for the producer", e))?;
        Ok(Self::with_connection(conn, stream))
    }

    /// Writes to `stream` over a connection you made.
    pub fn with_connection(conn: ConnectionManager, stream: impl Into<String>) -> Self {
        Self {
            conn: Conn(conn),
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
        let entry_id: String = cmd
            .query_async(&mut self.conn.0.clone())
            .await
            .map_err(|e| Error::redis(format!("XADD to stream {}", self.stream), e))?;
        Ok(Sent {
            message_id: id.clone(),
            entry_id,
        })
    }
}
