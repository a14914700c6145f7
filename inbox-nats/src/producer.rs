//! [`NatsProducer`]: publishes to JetStream through [`Publish`], each message confirmed.

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, Context};
use async_nats::HeaderMap;
use inbox_core::{MessageId, OutgoingMessage, Publish, PublishError, Recovery, REPLAYED};

use crate::source::{ID_HEADER, NATS_MSG_ID};
use crate::{NatsConnection, Result};

/// Builds a [`NatsProducer`]: from [`NatsConnection::producer`] or [`NatsProducer::builder`].
#[derive(Debug)]
#[must_use]
pub struct NatsProducerBuilder {
    connection: NatsConnection,
    id_header: String,
    message_id: bool,
}

impl NatsProducerBuilder {
    pub(crate) fn new(connection: NatsConnection) -> Self {
        Self {
            connection,
            id_header: ID_HEADER.to_owned(),
            message_id: false,
        }
    }

    /// The header the ID is written to (default `event_id`, where the source reads it).
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Also sets JetStream's `Nats-Msg-Id` header to the ID (default off), so the stream drops
    /// a resend within its duplicate window (2 minutes by default) before any consumer sees it.
    /// A dead letter's replay (marked [`REPLAYED`]) is sent without it: the stream would drop
    /// a replay within the window of the original.
    pub fn message_id(mut self, on: bool) -> Self {
        self.message_id = on;
        self
    }

    /// Connects.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config) for an empty ID header,
    /// [`Error::Connect`](crate::Error::Connect) when the server cannot be reached.
    pub async fn connect(self) -> Result<NatsProducer> {
        if self.id_header.is_empty() {
            return Err(crate::Error::Config(
                "the producer's id_header is empty".into(),
            ));
        }
        let client = self.connection.open("the producer").await?;
        let js = jetstream::ContextBuilder::new()
            .timeout(self.connection.timeout())
            .build(client);
        Ok(NatsProducer {
            js,
            id_header: self.id_header,
            message_id: self.message_id,
        })
    }
}

/// Publishes to JetStream subjects: the ID in a header (`event_id`), optionally also as
/// `Nats-Msg-Id`, the headers as NATS headers; `Ok` once the stream confirmed every message.
/// A message's key is not sent (NATS has none; the subject orders).
pub struct NatsProducer {
    js: Context,
    id_header: String,
    message_id: bool,
}

impl std::fmt::Debug for NatsProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsProducer")
            .field("id_header", &self.id_header)
            .field("message_id", &self.message_id)
            .finish_non_exhaustive()
    }
}

impl NatsProducer {
    /// A producer on the server(s) `NATS_URL` names.
    pub fn builder() -> NatsProducerBuilder {
        NatsConnection::from_env().producer()
    }

    fn headers(&self, message: &OutgoingMessage) -> Result<HeaderMap, PublishError> {
        let mut headers = HeaderMap::new();
        headers.insert(self.id_header.as_str(), message.id.as_str());
        let replayed = message.headers.iter().any(|(name, _)| name == REPLAYED);
        if self.message_id && !replayed {
            headers.insert(NATS_MSG_ID, message.id.as_str());
        }
        for (name, value) in message.traced_headers() {
            if name == self.id_header {
                return Err(refused(
                    &message.id,
                    format!(
                        "header `{name}` is the producer's ID header; the ID is the message's `id`"
                    ),
                ));
            }
            let text = std::str::from_utf8(&value).map_err(|_| {
                refused(
                    &message.id,
                    format!("header `{name}` is not UTF-8 text, which NATS headers must be"),
                )
            })?;
            if text.contains(['\r', '\n'])
                || name.is_empty()
                || name.contains([':', ' ', '\r', '\n'])
            {
                return Err(refused(
                    &message.id,
                    format!("header `{name}` has a line break, or its name a colon or space"),
                ));
            }
            headers.append(name, text);
        }
        Ok(headers)
    }
}

fn refused(id: &MessageId, why: String) -> PublishError {
    PublishError::new(Recovery::Fatal, format!("publishing message {id}"), why)
}

impl Publish for NatsProducer {
    /// Publishes every message, then waits for every confirm.
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let failed = |e: jetstream::context::PublishError| {
            let recovery = match e.kind() {
                PublishErrorKind::StreamNotFound => {
                    return PublishError::new(
                        Recovery::Fatal,
                        format!("publishing to `{destination}`"),
                        format!(
                            "no JetStream stream stores the subject `{destination}`; add it to a \
                             stream's subjects"
                        ),
                    )
                }
                PublishErrorKind::MaxPayloadExceeded => Recovery::Fatal,
                _ => Recovery::Retry,
            };
            PublishError::new(recovery, format!("publishing to `{destination}`"), e)
        };
        let mut confirms = Vec::with_capacity(messages.len());
        for message in messages {
            let headers = self.headers(message)?;
            let confirm = self
                .js
                .publish_with_headers(
                    destination.to_owned(),
                    headers,
                    message.payload.clone().into(),
                )
                .await
                .map_err(failed)?;
            confirms.push(confirm);
        }
        for confirm in confirms {
            confirm.await.map_err(failed)?;
        }
        Ok(())
    }
}
