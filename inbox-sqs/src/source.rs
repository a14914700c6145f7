//! The SQS [`MessageSource`]: long-poll receives turned into inbox deliveries.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_sdk_sqs::types::{
    Message as SqsMessage, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use aws_sdk_sqs::Client;
use inbox_core::{Binding, Capabilities, Delivery, IdCarrier, Message, MessageSource, SourceError};
use tracing::{debug, warn};

use crate::ack::{Shared, SqsAck};
use crate::config::{queue_attributes, seconds_of, Settings, SqsSourceBuilder};
use crate::copy::attribute_bytes;
use crate::dead_letter::DeadLetterTarget;
use crate::delivery::{Arrival, Ownership, Redelivery, REDELIVERY_COUNT, REDELIVER_AT};
use crate::heartbeat::Heartbeat;
use crate::{Error, Result};

/// One SQS queue as a [`MessageSource`]. Build it with [`SqsSource::builder`].
///
/// See the crate docs for what ack, nack, the heartbeat and dead-lettering do on SQS.
#[derive(Debug)]
pub struct SqsSource {
    settings: Settings,
    /// What every ack shares: the client, the queue URL, the dead-letter queue.
    acks: Arc<Shared>,
}

impl SqsSource {
    /// Starts configuring a source on the queue at `queue_url`, through the environment's SQS
    /// ([`SqsConnection::from_env`](crate::SqsConnection::from_env)); finish with
    /// [`SqsSourceBuilder::connect`].
    pub fn builder(queue_url: impl Into<String>) -> SqsSourceBuilder {
        crate::SqsConnection::from_env().source(queue_url)
    }

    pub(crate) fn new(client: Client, settings: Settings, dead_letter: DeadLetterTarget) -> Self {
        let acks = Arc::new(Shared {
            client,
            queue_url: Arc::from(settings.queue_url.as_str()),
            // The one the source reads, else the default (the ID came from the deduplication
            // ID, a system attribute a send cannot copy, or from the body).
            id_attribute: Arc::from(
                settings
                    .id_from
                    .first_header()
                    .unwrap_or(crate::DEFAULT_ID_ATTRIBUTE),
            ),
            min_retry_delay: settings.min_retry_delay,
            dead_letter,
            fifo: settings.fifo,
        });
        Self { settings, acks }
    }

    /// The queue this source receives from.
    pub fn queue_url(&self) -> &str {
        &self.acks.queue_url
    }

    /// The dead-letter queue URL that dead letters are sent to: the configured one, or the
    /// queue's redrive-policy target. `None` when there is none, or when it could not be
    /// resolved and SQS's own redrive moves failed messages.
    pub fn dead_letter_queue(&self) -> Option<&str> {
        match &self.acks.dead_letter {
            DeadLetterTarget::Queue(url) => Some(url),
            _ => None,
        }
    }

    /// The visibility timeout in force for received messages.
    pub fn visibility_timeout(&self) -> Duration {
        self.settings.effective_visibility
    }

    /// How long the queue keeps a message (`MessageRetentionPeriod`). An inbox that forgets IDs
    /// sooner than this could apply a late redelivery twice.
    pub async fn queue_retention(&self) -> Result<Duration> {
        let retention = QueueAttributeName::MessageRetentionPeriod;
        let attributes =
            queue_attributes(&self.acks.client, &self.acks.queue_url, [retention.clone()]).await?;
        seconds_of(&attributes, &retention).ok_or_else(|| {
            Error::Config(format!(
                "queue {} reported no MessageRetentionPeriod",
                self.acks.queue_url
            ))
        })
    }

    /// One `ReceiveMessage`, waiting until `poll_until` at most: the deliveries to hand out, and
    /// how many copies it hid because they were not due yet.
    async fn receive_once(
        &mut self,
        max: usize,
        poll_until: tokio::time::Instant,
    ) -> Result<(Vec<Delivery<SqsAck>>, usize), SourceError> {
        let max = max.clamp(1, self.settings.max_messages);
        let left = poll_until.saturating_duration_since(tokio::time::Instant::now());
        // Rounded up: the first receive waits the whole poll time, not a second less.
        let wait = crate::delivery::whole_seconds(left).min(20);
        let mut request = self
            .acks
            .client
            .receive_message()
            .queue_url(&*self.acks.queue_url)
            .max_number_of_messages(i32::try_from(max).unwrap_or(10))
            .wait_time_seconds(wait)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp);
        if self.settings.id_from.reads_property() {
            request = request
                .message_system_attribute_names(MessageSystemAttributeName::MessageDeduplicationId);
        }
        if let Some(timeout) = self.settings.visibility_timeout {
            request = request.visibility_timeout(i32::try_from(timeout.as_secs()).unwrap_or(30));
        }
        // If the consumer drops this future mid-call, the messages SQS already handed out
        // simply become visible again after their visibility timeout: nothing is lost.
        let out = request
            .send()
            .await
            .map_err(|e| Error::sdk("ReceiveMessage", &self.acks.queue_url, e))?;

        let mut deliveries = Vec::new();
        let mut hidden = 0;
        let now = SystemTime::now();
        for mut sqs in out.messages.unwrap_or_default() {
            let Some(handle) = sqs.receipt_handle() else {
                warn!(queue_url = %self.acks.queue_url, message_id = ?sqs.message_id(), "received a message without a receipt handle; skipping it");
                continue;
            };
            if let Arrival::HideFor(left) = redelivery_of(sqs.message_attributes()).on_receive(now)
            {
                self.hide(handle, left).await;
                hidden += 1;
                continue;
            }
            let message = self.convert(&sqs);
            let handle: Arc<str> = Arc::from(handle);
            let ownership = Arc::new(Ownership::new());
            let heartbeat = self.settings.heartbeat.then(|| {
                Heartbeat::start(
                    Arc::clone(&self.acks),
                    Arc::clone(&handle),
                    self.settings.effective_visibility,
                    Arc::clone(&ownership),
                )
            });
            let ack = SqsAck {
                shared: Arc::clone(&self.acks),
                receipt_handle: handle,
                // Moved, not copied: kept for a dead letter or a redelivered copy only.
                attributes: sqs.message_attributes.take(),
                heartbeat,
                ownership,
            };
            deliveries.push(Delivery { message, ack });
        }
        Ok((deliveries, hidden))
    }

    /// Hides a redelivered copy received before it is due for the time `left`, handing it to no
    /// one. A failure is logged: the copy then comes back after its visibility timeout, and is
    /// hidden again.
    async fn hide(&self, receipt_handle: &str, left: Duration) {
        let seconds = crate::ack::visibility_seconds(left);
        let operation = "ChangeMessageVisibility (not due)";
        match self
            .acks
            .change_visibility(receipt_handle, seconds, operation)
            .await
        {
            Ok(()) => {
                debug!(queue_url = %self.acks.queue_url, ?left, "redelivered copy not due yet; hidden until it is")
            }
            Err(e) => {
                warn!(error = %e, "cannot hide a redelivered copy until it is due; it comes back after its visibility timeout");
            }
        }
    }

    /// Turns one received SQS message into an inbox message.
    fn convert(&self, sqs: &SqsMessage) -> Message {
        let attributes = sqs.message_attributes();
        let system_attr = |name| system_attribute(sqs, name);

        let mut headers: Vec<(String, Vec<u8>)> = attributes
            .into_iter()
            .flatten()
            .map(|(name, value)| (name.clone(), attribute_bytes(value)))
            .collect();
        // SQS returns attributes as an unordered map; sort them so headers are stable.
        headers.sort();

        let id = self.settings.id_from.read(&Received {
            attributes,
            dedup_id: system_attr(MessageSystemAttributeName::MessageDeduplicationId),
            body: sqs.body().unwrap_or_default().as_bytes(),
        });

        let delivery_count = system_attr(MessageSystemAttributeName::ApproximateReceiveCount)
            .and_then(|v| v.parse::<u32>().ok());
        let group = system_attr(MessageSystemAttributeName::MessageGroupId);
        let mut message = Message::new(id, sqs.body().unwrap_or_default());
        message.key = group.map(|g| g.as_bytes().to_vec());
        message.headers = headers;
        let meta = &mut message.meta;
        meta.source = self.acks.queue_url.to_string();
        meta.position = format!("message {}", sqs.message_id().unwrap_or("?"));
        // Only the consumer's own delayed redeliveries count, carried on the copy each one
        // sent; a hand-back or a crash leaves the message, and its count, as they were.
        let reported = redelivery_of(attributes).report(delivery_count);
        meta.delivery_count = reported.delivery_count;
        meta.redeliveries = reported.redeliveries;
        meta.redelivered = reported.redelivered;
        // FIFO queues keep order per message group; a standard queue keeps none, but one lane
        // keeps a batch in one transaction.
        meta.lane = group.cloned();
        meta.timestamp = sent_at(sqs);
        message
    }
}

impl MessageSource for SqsSource {
    type Ack = SqsAck;

    /// Receives until a receive returns something to hand out, or the poll time is over: a
    /// receive that returned only redelivered copies not due yet (hidden again) is not the
    /// end of the poll.
    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<SqsAck>>, SourceError> {
        let poll_until = tokio::time::Instant::now() + self.settings.poll_timeout;
        loop {
            let (deliveries, hidden) = self.receive_once(max, poll_until).await?;
            let now = tokio::time::Instant::now();
            if !deliveries.is_empty() || hidden == 0 || now + Duration::from_secs(1) > poll_until {
                return Ok(deliveries);
            }
        }
    }

    fn system(&self) -> &'static str {
        "aws_sqs"
    }

    /// Every delivery carries `ApproximateReceiveCount`, a nack sets the message's visibility
    /// to the delay, and a delayed redelivery sends a copy due after it (see the crate docs,
    /// "Ack semantics"); on a FIFO queue each delivery's lane is its message group.
    fn capabilities(&self) -> Capabilities {
        let capabilities = Capabilities::NONE
            .with_delivery_count()
            .with_delayed_nack()
            .with_delayed_redelivery();
        if self.settings.fifo {
            capabilities.with_lanes()
        } else {
            capabilities
        }
    }

    /// The queue's `MessageRetentionPeriod` as read at connect. A message redriven from a FIFO
    /// dead-letter queue restarts that clock, so leave the inbox a margin beyond it.
    fn redelivery_window(&self) -> Option<Duration> {
        self.settings.retention
    }
}

/// Where SQS keeps what [`IdFrom`](inbox_core::IdFrom) reads: message attributes, and on a FIFO queue the
/// `MessageDeduplicationId` as the message-ID property. CloudEvents defines no SQS binding, so
/// only structured-mode events (in the body) are read.
pub(crate) const ID_BINDING: Binding = Binding {
    broker: "SQS",
    header: "message attribute",
    property: Some("system attribute MessageDeduplicationId"),
    position: None,
    cloud_events_prefixes: &[],
};

/// A received message as [`IdFrom::read`](inbox_core::IdFrom::read) sees it.
struct Received<'a> {
    attributes: Option<&'a HashMap<String, MessageAttributeValue>>,
    dedup_id: Option<&'a String>,
    body: &'a [u8],
}

impl IdCarrier for Received<'_> {
    fn binding(&self) -> &Binding {
        &ID_BINDING
    }

    fn header(&self, name: &str) -> Option<Result<Cow<'_, [u8]>, String>> {
        let value = self.attributes?.get(name)?;
        Some(Ok(Cow::Owned(attribute_bytes(value))))
    }

    fn property(&self) -> Option<Cow<'_, [u8]>> {
        self.dedup_id.map(|id| Cow::Borrowed(id.as_bytes()))
    }

    fn payload(&self) -> &[u8] {
        self.body
    }
}

/// Where a received message stands on the redelivery schedule, from the attributes its delayed
/// redelivery wrote (none on a first delivery).
fn redelivery_of(attributes: Option<&HashMap<String, MessageAttributeValue>>) -> Redelivery {
    let text = |name: &str| attributes?.get(name)?.string_value();
    Redelivery::read(text(REDELIVERY_COUNT), text(REDELIVER_AT))
}

/// A system attribute of a received message.
pub(crate) fn system_attribute(
    sqs: &SqsMessage,
    name: MessageSystemAttributeName,
) -> Option<&String> {
    sqs.attributes()?.get(&name)
}

/// When a received message was sent (`SentTimestamp`).
pub(crate) fn sent_at(sqs: &SqsMessage) -> Option<SystemTime> {
    let ms = system_attribute(sqs, MessageSystemAttributeName::SentTimestamp)?;
    Some(std::time::UNIX_EPOCH + Duration::from_millis(ms.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use inbox_core::{IdFrom, MessageId};

    use super::*;
    use crate::copy::attribute;

    fn source(dedup_id_fallback: bool) -> SqsSource {
        let mut settings = Settings::new("http://localhost/q".into());
        if dedup_id_fallback {
            settings.id_from = settings.id_from.or(IdFrom::MessageIdProperty);
        }
        let client = crate::connection::offline_client();
        SqsSource::new(client, settings, DeadLetterTarget::None)
    }

    fn text(value: &str) -> MessageAttributeValue {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(value)
            .build()
            .unwrap()
    }

    #[test]
    fn id_and_metadata_come_from_attributes() {
        let sqs = SqsMessage::builder()
            .message_id("m-1")
            .body("{}")
            .message_attributes("event_id", text("evt-1"))
            .message_attributes("blob", attribute("blob", [0xff, 0]).unwrap())
            .attributes(MessageSystemAttributeName::ApproximateReceiveCount, "3")
            .build();
        let message = source(false).convert(&sqs);
        assert_eq!(message.id, Ok(MessageId::new("evt-1").unwrap()));
        assert_eq!(message.meta.delivery_count, Some(3));
        assert!(message.meta.redelivered);
        assert_eq!(message.meta.position, "message m-1");
        assert_eq!(message.header("blob"), Some(&[0xff, 0][..]));
        assert_eq!(message.payload, b"{}");
    }

    /// The ID attribute wins; the deduplication ID only where opted in; never the SQS message
    /// ID; an empty attribute is refused.
    #[test]
    fn where_the_id_comes_from() {
        let missing = Err("message has no ID: message attribute event_id is missing");
        for (attribute, dedup_id, fallback, expected) in [
            (None, None, false, missing),
            (None, Some("d-1"), false, missing),
            (None, Some("d-1"), true, Ok("d-1")),
            (Some("evt-9"), Some("d-1"), true, Ok("evt-9")),
            (Some(""), None, false, Err("empty")),
        ] {
            let mut sqs = SqsMessage::builder().message_id("m-1").body("x");
            if let Some(value) = attribute {
                sqs = sqs.message_attributes("event_id", text(value));
            }
            if let Some(value) = dedup_id {
                sqs = sqs.attributes(MessageSystemAttributeName::MessageDeduplicationId, value);
            }
            let id = source(fallback).convert(&sqs.build()).id;
            match expected {
                Ok(want) => assert_eq!(id, Ok(MessageId::new(want).unwrap())),
                Err(text) => assert!(id.unwrap_err().to_string().contains(text), "{text}"),
            }
        }
    }
}
