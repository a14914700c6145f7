//! [`NatsDeadLetters`]: the dead letters on a subject read back, for [`inbox_core::replay`].

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::{self, stream::Stream};
use futures_util::StreamExt;
use inbox_core::replay::{DeadLetter, DeadLetters};
use inbox_core::{MessageId, OperationError, Recovery};

use crate::source::{is_jetstream_header, system_time, ID_HEADER};
use crate::{NatsConnection, Result};

/// Builds a [`NatsDeadLetters`]: from [`NatsConnection::dead_letters`] or
/// [`NatsDeadLetters::builder`].
#[derive(Debug)]
#[must_use]
pub struct NatsDeadLettersBuilder {
    connection: NatsConnection,
    subject: String,
    id_header: String,
}

impl NatsDeadLettersBuilder {
    pub(crate) fn new(connection: NatsConnection, subject: String) -> Self {
        Self {
            connection,
            subject,
            id_header: ID_HEADER.to_owned(),
        }
    }

    /// The header the message ID is in (default `event_id`).
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Connects and finds the stream that stores the subject.
    ///
    /// # Errors
    /// [`Error::DeadLetterSubjectMissing`](crate::Error::DeadLetterSubjectMissing) when no stream stores it;
    /// [`Error::Connect`](crate::Error::Connect) or
    /// [`Error::Nats`](crate::Error::Nats) when the server cannot be reached.
    pub async fn connect(self) -> Result<NatsDeadLetters> {
        let client = self.connection.open("the dead-letter reader").await?;
        let js = jetstream::ContextBuilder::new()
            .timeout(self.connection.timeout())
            .build(client);
        let name = crate::stream_storing(&js, &self.subject).await?;
        let stream = crate::get_stream(&js, &name).await?;
        Ok(NatsDeadLetters {
            stream,
            subject: self.subject,
            id_header: self.id_header,
            reader: None,
            done: false,
            timeout: self.connection.timeout(),
        })
    }
}

/// Reads the dead letters on one subject, oldest first, through an ephemeral consumer of the
/// stream that stores it (no acks: reading changes nothing), and removes replayed ones by their
/// stream sequence (`delete_message`). A dead letter's position is its stream sequence; its
/// time is when the stream stored it.
pub struct NatsDeadLetters {
    stream: Stream,
    subject: String,
    id_header: String,
    reader: Option<PullConsumer>,
    done: bool,
    timeout: std::time::Duration,
}

impl std::fmt::Debug for NatsDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsDeadLetters")
            .field("subject", &self.subject)
            .field("id_header", &self.id_header)
            .finish_non_exhaustive()
    }
}

impl NatsDeadLetters {
    /// A reader of `subject` on the server(s) `NATS_URL` names.
    pub fn builder(subject: impl Into<String>) -> NatsDeadLettersBuilder {
        NatsConnection::from_env().dead_letters(subject)
    }

    fn failed(&self, what: &str, e: impl std::fmt::Display) -> OperationError {
        OperationError::new(
            Recovery::Retry,
            format!("{what} the dead letters on `{}`", self.subject),
            e.to_string(),
        )
    }

    async fn reader(&mut self) -> Result<&PullConsumer, OperationError> {
        if self.reader.is_none() {
            let config = pull::Config {
                ack_policy: AckPolicy::None,
                deliver_policy: DeliverPolicy::All,
                filter_subject: self.subject.clone(),
                inactive_threshold: std::time::Duration::from_secs(300),
                ..Default::default()
            };
            let consumer = self
                .stream
                .create_consumer(config)
                .await
                .map_err(|e| self.failed("reading", e))?;
            self.reader = Some(consumer);
        }
        self.reader
            .as_ref()
            .ok_or_else(|| self.failed("reading", "no reader"))
    }

    fn letter(&self, message: jetstream::Message) -> Result<DeadLetter, OperationError> {
        let info = message.info().map_err(|e| self.failed("reading", e))?;
        let sequence = info.stream_sequence;
        let time = system_time(info.published.unix_timestamp_nanos());
        let mut letter = DeadLetter::new(sequence.to_string(), message.payload.to_vec());
        letter.timestamp = time;
        let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
        for (name, values) in message.headers.iter().flat_map(|map| map.iter()) {
            let name = name.to_string();
            for value in values {
                let value = value.as_str().as_bytes().to_vec();
                if name == self.id_header {
                    letter.id = MessageId::from_bytes(&value).ok();
                } else if !is_jetstream_header(&name) {
                    headers.push((name.clone(), value));
                }
            }
        }
        headers.sort();
        letter.take_metadata(headers);
        Ok(letter)
    }
}

impl DeadLetters for NatsDeadLetters {
    fn name(&self) -> &str {
        &self.subject
    }

    async fn next(&mut self, max: usize) -> Result<Vec<DeadLetter>, OperationError> {
        if self.done {
            return Ok(Vec::new());
        }
        let timeout = self.timeout;
        let reader = self.reader().await?;
        let read = async {
            let batch = reader.fetch().max_messages(max.max(1)).messages().await?;
            let mut batch = std::pin::pin!(batch);
            let mut messages = Vec::new();
            while let Some(next) = batch.next().await {
                messages.push(next?);
            }
            Ok::<_, async_nats::Error>(messages)
        };
        let messages = tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| self.failed("reading", format!("no answer within {timeout:?}")))?
            .map_err(|e| self.failed("reading", e))?;
        if messages.is_empty() {
            self.done = true;
        }
        messages.into_iter().map(|m| self.letter(m)).collect()
    }

    async fn remove(&mut self, letters: &[DeadLetter]) -> Result<(), OperationError> {
        for letter in letters {
            let sequence: u64 = letter.handle.parse().map_err(|_| {
                OperationError::new(
                    Recovery::Fatal,
                    format!("removing a dead letter from `{}`", self.subject),
                    format!(
                        "`{}` is not a stream sequence of this reader",
                        letter.handle
                    ),
                )
            })?;
            match self.stream.delete_message(sequence).await {
                Ok(_) => {}
                // Gone already (removed by an earlier replay): what removing wants.
                Err(e) if e.to_string().contains("no message found") => {}
                Err(e) => return Err(self.failed("removing", e)),
            }
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<(), OperationError> {
        if let Some(reader) = self.reader.take() {
            let name = reader.cached_info().name.clone();
            self.stream
                .delete_consumer(&name)
                .await
                .map_err(|e| self.failed("closing the reader of", e))?;
        }
        Ok(())
    }
}
