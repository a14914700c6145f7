//! A dead-letter stream read back for [`inbox_core::replay`]: `XRANGE` in pages, `XDEL` of what
//! was replayed.

use std::time::Duration;

use inbox_core::replay::{DeadLetter, DeadLetters};
use inbox_core::{MessageId, OperationError};

use crate::connection::Conn;
use crate::reply::{self, Entry};
use crate::source::{entry_time, split_fields};
use crate::{Error, RedisConnection, Result, DEFAULT_ID_FIELD};

/// The entries of a dead-letter stream (`<stream>:dlq`), oldest first, as
/// [`inbox_core::replay`] reads them: each entry's fields are the original entry's (the ID
/// field, `payload`, the headers) plus the [`inbox_core::dead_letter`] fields, its position the
/// entry ID and its time the entry ID's milliseconds (when it was parked).
///
/// Removing a replayed entry is `XDEL`: the dead-letter stream is then empty once every entry
/// was replayed. Built with [`RedisConnection::dead_letters`] (or [`RedisDeadLetters::builder`],
/// on the Redis `REDIS_URL` names).
#[derive(Debug)]
pub struct RedisDeadLetters {
    stream: String,
    id_field: String,
    conn: Conn,
    /// The last entry ID returned: the next page starts after it.
    after: Option<String>,
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

    fn letter(&self, entry: Entry) -> DeadLetter {
        let fields = entry.fields.unwrap_or_default();
        let (id, payload, headers) = split_fields(fields, Some(&self.id_field));
        let mut letter = DeadLetter::new(entry.id, payload);
        letter.id = id.and_then(|id| MessageId::from_bytes(&id).ok());
        letter.take_metadata(headers);
        letter.timestamp = entry_time(&letter.handle);
        letter
    }

    /// Runs `cmd` once; a failure names the command (`what`, as in `XDEL from`) and the stream.
    async fn run<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd, what: &str) -> Result<T> {
        let context = || format!("{what} dead-letter stream {}", self.stream);
        let reply = self.conn.query(cmd, Duration::ZERO).await;
        reply.map_err(|e| Error::redis(context(), e))
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
        xrange.arg((&self.stream, start, "+", "COUNT", max));
        let entries = reply::range_reply(self.run(&xrange, "XRANGE of").await?)?;
        if let Some(last) = entries.last() {
            self.after = Some(last.id.clone());
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
        let _: u64 = self.run(&xdel, "XDEL from").await?;
        Ok(())
    }
}
