//! How an [`SqsSource`](crate::SqsSource) receives, acknowledges and dead-letters.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::types::QueueAttributeName;
use aws_sdk_sqs::Client;
use inbox_core::IdFrom;
use tracing::warn;

use crate::dead_letter::{self, DeadLetterTarget};
use crate::delivery::MAX_HIDE;
use crate::{fifo, Error, Result, SqsConnection, SqsSource};

/// The message attribute a producer puts the event ID in, unless configured otherwise.
pub const DEFAULT_ID_ATTRIBUTE: &str = "event_id";

/// SQS's longest long-poll wait.
const MAX_WAIT: Duration = Duration::from_secs(20);

/// Refuses client timeouts that would cut every long-poll receive short, and warns when the
/// client has none (a stalled connection then hangs the consumer).
fn check_timeouts(client: &Client, queue_url: &str, poll: Duration) -> Result<()> {
    let timeouts = client.config().timeout_config();
    let attempt = timeouts.and_then(|t| t.operation_attempt_timeout());
    let operation = timeouts.and_then(|t| t.operation_timeout());
    for (name, timeout) in [
        ("operation_attempt_timeout", attempt),
        ("operation_timeout", operation),
    ] {
        if let Some(timeout) = timeout.filter(|t| *t <= poll) {
            return Err(Error::Config(format!(
                "the SQS client's {name} is {timeout:?}, not longer than poll_timeout {poll:?}, \
                 so every long-poll receive would time out; raise it (timeout_config on \
                 inbox_sqs::config_loader()) or shorten poll_timeout(..)"
            )));
        }
    }
    if attempt.is_none() && operation.is_none() {
        warn!(
            queue_url,
            "the SQS client has no operation timeout, so a stalled connection can hang the \
             consumer; build it from inbox_sqs::config_loader() or set timeout_config"
        );
    }
    Ok(())
}

/// The attributes `names` of the queue at `queue_url` (`GetQueueAttributes`).
pub(crate) async fn queue_attributes(
    client: &Client,
    queue_url: &str,
    names: impl IntoIterator<Item = QueueAttributeName>,
) -> Result<HashMap<QueueAttributeName, String>> {
    let out = client
        .get_queue_attributes()
        .queue_url(queue_url)
        .set_attribute_names(Some(names.into_iter().collect()))
        .send()
        .await
        .map_err(|e| Error::sdk("GetQueueAttributes", queue_url, e))?;
    Ok(out.attributes.unwrap_or_default())
}

/// A queue attribute that counts seconds.
pub(crate) fn seconds_of(
    attributes: &HashMap<QueueAttributeName, String>,
    name: &QueueAttributeName,
) -> Option<Duration> {
    attributes.get(name)?.parse().ok().map(Duration::from_secs)
}

/// Every message attribute `from` reads the ID from.
fn header_names(from: &IdFrom) -> Vec<&str> {
    match from {
        IdFrom::Header(name) => vec![name.as_str()],
        IdFrom::FirstOf(all) => all.iter().flat_map(header_names).collect(),
        _ => Vec::new(),
    }
}

/// A source's settings: those of its builder, and at connect what the queue says.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) queue_url: String,
    pub(crate) id_from: IdFrom,
    pub(crate) poll_timeout: Duration,
    pub(crate) max_messages: usize,
    /// Passed on every receive when set; otherwise the queue's own timeout applies.
    pub(crate) visibility_timeout: Option<Duration>,
    /// The timeout in force for received messages: the heartbeat extends to this.
    pub(crate) effective_visibility: Duration,
    pub(crate) heartbeat: bool,
    pub(crate) min_retry_delay: Duration,
    /// The queue's `MessageRetentionPeriod`, read at connect.
    pub(crate) retention: Option<Duration>,
    /// A FIFO queue (its name ends in `.fifo`): deliveries carry their message group as lane.
    pub(crate) fifo: bool,
}

impl Settings {
    /// The defaults; what the queue says is filled in at connect.
    pub(crate) fn new(queue_url: String) -> Self {
        Self {
            queue_url,
            id_from: IdFrom::Header(DEFAULT_ID_ATTRIBUTE.to_owned()),
            poll_timeout: MAX_WAIT,
            max_messages: 10,
            visibility_timeout: None,
            effective_visibility: Duration::ZERO,
            heartbeat: true,
            min_retry_delay: Duration::ZERO,
            retention: None,
            fifo: false,
        }
    }
}

/// Configures an [`SqsSource`]; made by [`SqsConnection::source`] (or [`SqsSource::builder`],
/// through the environment's SQS), finished by [`connect`](Self::connect).
///
/// ```no_run
/// # async fn run() -> Result<(), inbox_sqs::Error> {
/// use std::time::Duration;
/// use inbox_sqs::SqsSource;
///
/// // SQS as the environment describes it (see `inbox_sqs::connect`); `SqsConnection` says otherwise.
/// let source = SqsSource::builder("https://sqs.eu-west-1.amazonaws.com/123456789012/payments")
///     .poll_timeout(Duration::from_secs(5))
///     .dead_letter_queue("https://sqs.eu-west-1.amazonaws.com/123456789012/payments-dlq")
///     .connect()
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct SqsSourceBuilder {
    connection: SqsConnection,
    settings: Settings,
    dedup_id_fallback: bool,
    dead_letter_queue: Option<String>,
}

impl SqsSourceBuilder {
    pub(crate) fn new(connection: SqsConnection, queue_url: String) -> Self {
        Self {
            connection,
            settings: Settings::new(queue_url),
            dedup_id_fallback: false,
            dead_letter_queue: None,
        }
    }

    /// The message attribute that holds the message ID (default [`DEFAULT_ID_ATTRIBUTE`],
    /// `event_id`). String, Number and Binary attributes are all read as the ID's bytes.
    ///
    /// The SQS `MessageId` is never used: the queue assigns a new one to every send, so a
    /// producer's resend would look like a new message.
    ///
    /// Shorthand for [`id_from`](Self::id_from)`(IdFrom::Header(name))`.
    pub fn id_attribute(mut self, name: impl Into<String>) -> Self {
        self.settings.id_from = IdFrom::Header(name.into());
        self
    }

    /// Where the message ID is read from (default: the message attribute `event_id`): a
    /// message attribute ([`IdFrom::Header`]), on a FIFO queue the `MessageDeduplicationId`
    /// ([`IdFrom::MessageIdProperty`]; see [`dedup_id_fallback`](Self::dedup_id_fallback) for
    /// when that is sound), a structured-mode CloudEvent in the body (SQS has no CloudEvents
    /// binding for attributes), or a JSON field of the body.
    pub fn id_from(mut self, from: IdFrom) -> Self {
        self.settings.id_from = from;
        self
    }

    /// On a FIFO queue, use the `MessageDeduplicationId` as the ID of a message that has no ID
    /// attribute (off by default).
    ///
    /// Only opt in when producers set a stable deduplication ID per event (not content-based
    /// deduplication over a body that may change between resends). SQS itself deduplicates on
    /// it for only 5 minutes; the inbox keeps it for as long as its retention, so a resend
    /// after those 5 minutes is still skipped here. A standard queue has no such ID.
    ///
    /// At `connect` it makes the ID source `<id_from>.or(IdFrom::MessageIdProperty)`; to read
    /// the deduplication ID alone, use [`id_from`](Self::id_from)`(IdFrom::MessageIdProperty)`.
    pub fn dedup_id_fallback(mut self, enabled: bool) -> Self {
        self.dedup_id_fallback = enabled;
        self
    }

    /// How long one receive waits for messages (long polling; default and maximum 20 s,
    /// rounded down to whole seconds). Shorter waits make an idle consumer stop sooner and
    /// cost more empty receives.
    pub fn poll_timeout(mut self, wait: Duration) -> Self {
        self.settings.poll_timeout = wait;
        self
    }

    /// The most messages one receive asks for (1 to 10, default 10). The consumer's
    /// `batch_size` asks for fewer where it is smaller.
    pub fn max_messages(mut self, n: usize) -> Self {
        self.settings.max_messages = n;
        self
    }

    /// The visibility timeout asked for on every receive (whole seconds, 1 s to 12 h). Without
    /// it the queue's own `VisibilityTimeout` applies, read once by [`connect`](Self::connect).
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        self.settings.visibility_timeout = Some(timeout);
        self
    }

    /// Extend the visibility of each message while it is being handled (default on), so a
    /// handler slower than the visibility timeout does not see its message handed to another
    /// consumer under it. Turning it off is safe with the inbox (the second copy is skipped)
    /// but wastes the second consumer's work.
    pub fn heartbeat(mut self, enabled: bool) -> Self {
        self.settings.heartbeat = enabled;
        self
    }

    /// Send dead-lettered messages to this queue, with the attributes named in
    /// [`inbox_core::dead_letter`] (`reason`, `original_source`, `original_position`), instead of the
    /// queue's redrive-policy dead-letter queue. See the crate docs, "Dead letters".
    pub fn dead_letter_queue(mut self, queue_url: impl Into<String>) -> Self {
        self.dead_letter_queue = Some(queue_url.into());
        self
    }

    /// The shortest delay before a handed-back (nacked) message is visible again (default 0:
    /// the consumer's own backoff decides). SQS takes whole seconds: a delay with a fraction is
    /// rounded up (300 ms becomes 1 s), so a short delay never makes the message visible at once.
    pub fn retry_backoff(mut self, min_delay: Duration) -> Self {
        self.settings.min_retry_delay = min_delay;
        self
    }

    /// Builds the client unless the connection has one, checks the settings, reads the queue's attributes (its visibility timeout and redrive
    /// policy), checks that the dead-letter queue exists, and returns the source.
    ///
    /// Fails with [`Error::Config`] on a bad setting, when the dead-letter queue (configured or
    /// from the redrive policy) does not exist, or when the client's timeout per attempt is not
    /// longer than [`poll_timeout`](Self::poll_timeout); with [`Error::Sqs`] when the queue
    /// cannot be read (wrong URL, unreachable endpoint, no permission).
    pub async fn connect(self) -> Result<SqsSource> {
        let mut settings = self.settings;
        if settings.queue_url.is_empty() {
            return Err(Error::Config("the queue URL is empty".into()));
        }
        settings
            .id_from
            .check(&crate::source::ID_BINDING)
            .map_err(Error::Config)?;
        for name in header_names(&settings.id_from) {
            dead_letter::check_id_attribute(name, "SqsSourceBuilder::id_attribute")?;
        }
        settings.fifo = fifo::is_fifo_queue(&settings.queue_url);
        if settings.id_from == IdFrom::MessageIdProperty && !settings.fifo {
            return Err(Error::Config(format!(
                "queue {} is a standard queue, whose messages have no MessageDeduplicationId; \
                 read the ID from a message attribute or the body instead",
                settings.queue_url
            )));
        }
        if !(1..=10).contains(&settings.max_messages) {
            return Err(Error::Config(format!(
                "max_messages is {}; SQS returns 1 to 10 messages per receive",
                settings.max_messages
            )));
        }
        if settings.poll_timeout > MAX_WAIT {
            return Err(Error::Config(format!(
                "poll_timeout is {:?}; SQS long-polls for at most 20 s",
                settings.poll_timeout
            )));
        }
        let client = self.connection.client().await;
        check_timeouts(&client, &settings.queue_url, settings.poll_timeout)?;
        if let Some(timeout) = settings.visibility_timeout {
            if timeout < Duration::from_secs(1) || timeout > MAX_HIDE {
                return Err(Error::Config(format!(
                    "visibility_timeout is {timeout:?}; use 1 s to 12 h (whole seconds)"
                )));
            }
        }

        use QueueAttributeName::{MessageRetentionPeriod, RedrivePolicy, VisibilityTimeout};
        let attrs = queue_attributes(
            &client,
            &settings.queue_url,
            [VisibilityTimeout, RedrivePolicy, MessageRetentionPeriod],
        )
        .await?;
        settings.effective_visibility = settings
            .visibility_timeout
            .or_else(|| seconds_of(&attrs, &VisibilityTimeout))
            // SQS's documented default when a queue reports none.
            .unwrap_or(Duration::from_secs(30));
        if settings.heartbeat && settings.effective_visibility < Duration::from_secs(1) {
            return Err(Error::Config(format!(
                "queue {} has a visibility timeout of 0 s, which no heartbeat can extend in time; \
                 set visibility_timeout(..) or turn the heartbeat off",
                settings.queue_url
            )));
        }

        let dead_letter = match self.dead_letter_queue {
            Some(url) if url.is_empty() => {
                return Err(Error::Config("the dead-letter queue URL is empty".into()))
            }
            Some(url) => {
                dead_letter::check_queue(&client, &url).await?;
                DeadLetterTarget::Queue(url)
            }
            None => match attrs.get(&RedrivePolicy) {
                Some(policy) => {
                    DeadLetterTarget::from_redrive_policy(&client, &settings.queue_url, policy)
                        .await?
                }
                None => DeadLetterTarget::None,
            },
        };

        if self.dedup_id_fallback {
            settings.id_from = settings.id_from.or(IdFrom::MessageIdProperty);
        }
        settings.retention = seconds_of(&attrs, &MessageRetentionPeriod);
        Ok(SqsSource::new(client, settings, dead_letter))
    }
}

#[cfg(test)]
mod tests {
    use aws_config::timeout::TimeoutConfig;

    use super::*;

    #[tokio::test]
    async fn a_client_timeout_shorter_than_the_long_poll_is_refused() {
        // Nothing listens here: the check must fail before any call.
        let config = crate::connection::test_loader("http://127.0.0.1:9")
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_attempt_timeout(Duration::from_secs(5))
                    .build(),
            )
            .load()
            .await;
        let built = SqsConnection::new(Client::new(&config))
            .source("http://127.0.0.1:9/0/q")
            .poll_timeout(Duration::from_secs(20))
            .connect()
            .await;
        let Err(Error::Config(text)) = built else {
            panic!("expected a configuration error, got {built:?}");
        };
        assert!(text.contains("operation_attempt_timeout"), "{text}");
        assert!(text.contains("poll_timeout"), "{text}");
    }
}
