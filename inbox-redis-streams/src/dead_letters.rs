//! A dead-letter stream read back for [`inbox_core::replay`]: `XRANGE` in pages, `XDEL` of what
//! was replayed.

use std::time::Duration;

use inbox_core::replay::{DeadLetter, DeadLetters};
use inbox_core::{MessageId, OperationError};

use crate::connection::Conn;
use crate::{Error, RedisConnection, Result, DEFAULT_ID_FIELD, PAYLOAD_FIELD};

/// The entries of a dead-letter stream (`<stream>:dlq`), oldest first, as
/// [`inbox_core::replay`] reads them: each entry's fields are the original entry's (the ID
/// field, `payload`, the headers) plus the [`inbox_core::dead_letter`] fields, its position the
/// entry ID and its time the entry ID's milliseconds (when it was parked).
///
/// Removing a replayed entry is `XDEL`: the dead-letter stream is then empty once every entry
/// was replayed. Built with [`RedisConnection::dead_letters`], so it reaches Redis as the source
/// and the producer built from the same connection do (or with [`RedisDeadLetters::builder`],
/// on the Redis `REDIS_URL` names). Each command is bounded by the connection's
/// [`operation_timeout`](RedisConnection::operation_timeout), and a connection that failed is
/// replaced by the next command.
pub struct RedisDeadLetters {
    stream: String,
    id_field: String,
    conn: Conn,
    /// The last entry ID returned: the next page starts after it.
    after: Option<String>,
}

impl std::fmt::Debug for RedisDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisDeadLetters")
            .field("stream", &self.stream)
            .field("id_field", &self.id_field)
            .field("after", &self.after)
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisDeadLetters`]; start with [`RedisConnection::dead_letters`] (or
/// [`RedisDeadLetters::builder`], on the Redis `REDIS_URL` names).
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisDeadLettersBuilder {
    connection: RedisConnection,
    stream: String,
    id_field: String,
}

impl RedisDeadLetters {
    /// Reads the dead-letter stream `stream` (like `orders:dlq`) on the Redis `REDIS_URL` names
    /// ([`RedisConnection::from_env`]).
    pub fn builder(stream: impl Into<String>) -> RedisDeadLettersBuilder {
        RedisConnection::from_env().dead_letters(stream)
    }
}

impl RedisDeadLettersBuilder {
    pub(crate) fn new(connection: RedisConnection, stream: String) -> Self {
        Self {
            connection,
            stream,
            id_field: DEFAULT_ID_FIELD.to_owned(),
        }
    }

    /// The field holding the message ID, as the source read it (default `event_id`).
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// Connects.
    pub async fn connect(self) -> Result<RedisDeadLetters> {
        Ok(RedisDeadLetters {
            conn: self.connection.open("the dead-letter reader").await?,
            stream: self.stream,
            id_field: self.id_field,
            after: None,
        })
    }
}

/// One `XRANGE` entry: its ID and its fields as a flat list.
type RawEntry = (String, Vec<Vec<u8>>);

impl RedisDeadLetters {
    fn letter(&self, (entry_id, flat): RawEntry) -> DeadLetter {
        let mut letter = DeadLetter::new(entry_id.clone(), Vec::new());
        let mut headers = Vec::new();
        let mut payload = None;
        let mut fields = flat.into_iter();
        while let (Some(name), Some(value)) = (fields.next(), fields.next()) {
            if letter.id.is_none() && name == self.id_field.as_bytes() {
                letter.id = MessageId::from_bytes(&value).ok();
            } else if payload.is_none() && name == PAYLOAD_FIELD.as_bytes() {
                payload = Some(value);
            } else {
                headers.push((String::from_utf8_lossy(&name).into_owned(), value));
            }
        }
        letter.payload = payload.unwrap_or_default();
        letter.take_metadata(headers);
        letter.timestamp = entry_id
            .split_once('-')
            .and_then(|(ms, _)| ms.parse().ok())
            .map(|ms| std::time::UNIX_EPOCH + Duration::from_millis(ms));
        letter
    }
}

impl DeadLetters for RedisDeadLetters {
    fn name(&self) -> &str {
        &self.stream
    }

    async fn next(&mut self, max: usize) -> std::result::Result<Vec<DeadLetter>, OperationError> {
        let start = match &self.after {
            Some(id) => format!("({id}"),
            None => "-".to_owned(),
        };
        let mut xrange = redis::cmd("XRANGE");
        xrange
            .arg(&self.stream)
            .arg(start)
            .arg("+")
            .arg("COUNT")
            .arg(max);
        let entries: Vec<RawEntry> =
            self.conn
                .query(&xrange, Duration::ZERO)
                .await
                .map_err(|source| Error::Redis {
                    context: format!("XRANGE of dead-letter stream {}", self.stream),
                    source,
                })?;
        if let Some((last, _)) = entries.last() {
            self.after = Some(last.clone());
        }
        Ok(entries.into_iter().map(|e| self.letter(e)).collect())
    }

    async fn remove(&mut self, letters: &[DeadLetter]) -> std::result::Result<(), OperationError> {
        if letters.is_empty() {
            return Ok(());
        }
        let mut xdel = redis::cmd("XDEL");
        xdel.arg(&self.stream);
        for letter in letters {
            xdel.arg(&letter.handle);
        }
        let _: u64 = self
            .conn
            .query(&xdel, Duration::ZERO)
            .await
            .map_err(|source| Error::Redis {
                context: format!("XDEL from dead-letter stream {}", self.stream),
                source,
            })?;
        Ok(())
    }
}
