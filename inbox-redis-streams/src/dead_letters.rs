//! A dead-letter stream read back for [`inbox_core::replay`]: `XRANGE` in pages, `XDEL` of what
//! was replayed.

use std::time::Duration;

use inbox_core::replay::{DeadLetter, DeadLetters};
use inbox_core::{MessageId, OperationError};
use redis::aio::MultiplexedConnection;
use redis::Client;

use crate::{url_from_env, Error, Result, DEFAULT_ID_FIELD, PAYLOAD_FIELD};

/// The entries of a dead-letter stream (`<stream>:dlq`), oldest first, as
/// [`inbox_core::replay`] reads them: each entry's fields are the original entry's (the ID
/// field, `payload`, the headers) plus the [`inbox_core::dead_letter`] fields, its position the
/// entry ID and its time the entry ID's milliseconds (when it was parked).
///
/// Removing a replayed entry is `XDEL`: the dead-letter stream is then empty once every entry
/// was replayed. Built with [`RedisDeadLetters::builder`]; Redis is reached at `REDIS_URL`
/// unless [`url`](RedisDeadLettersBuilder::url) says otherwise.
pub struct RedisDeadLetters {
    stream: String,
    id_field: String,
    conn: MultiplexedConnection,
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

/// Builds a [`RedisDeadLetters`]; start with [`RedisDeadLetters::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisDeadLettersBuilder {
    stream: String,
    url: Option<String>,
    id_field: String,
    operation_timeout: Duration,
}

impl RedisDeadLetters {
    /// Reads the dead-letter stream `stream` (like `orders:dlq`).
    pub fn builder(stream: impl Into<String>) -> RedisDeadLettersBuilder {
        RedisDeadLettersBuilder {
            stream: stream.into(),
            url: None,
            id_field: DEFAULT_ID_FIELD.to_owned(),
            operation_timeout: Duration::from_secs(5),
        }
    }
}

impl RedisDeadLettersBuilder {
    /// Connects to `url` instead of `REDIS_URL`.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// The field holding the message ID, as the source read it (default `event_id`).
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// How long one command may take (default 5 s).
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// Connects.
    pub async fn connect(self) -> Result<RedisDeadLetters> {
        let url = match self.url {
            Some(url) => url,
            None => url_from_env()?,
        };
        let context = || {
            format!(
                "connecting to Redis to read dead-letter stream {}",
                self.stream
            )
        };
        let client = Client::open(url).map_err(|source| Error::Redis {
            context: context(),
            source,
        })?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.operation_timeout))
            .set_response_timeout(Some(self.operation_timeout));
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|source| Error::Redis {
                context: context(),
                source,
            })?;
        Ok(RedisDeadLetters {
            stream: self.stream,
            id_field: self.id_field,
            conn,
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
        let entries: Vec<RawEntry> = redis::cmd("XRANGE")
            .arg(&self.stream)
            .arg(start)
            .arg("+")
            .arg("COUNT")
            .arg(max)
            .query_async(&mut self.conn)
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
        let _: u64 = xdel
            .query_async(&mut self.conn)
            .await
            .map_err(|source| Error::Redis {
                context: format!("XDEL from dead-letter stream {}", self.stream),
                source,
            })?;
        Ok(())
    }
}
