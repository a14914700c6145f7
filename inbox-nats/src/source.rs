//! [`NatsSource`]: a durable JetStream pull consumer as a [`MessageSource`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use futures_util::StreamExt;
use inbox_core::{
    Binding, Capabilities, Delivery, IdCarrier, IdFrom, Message, MessageSource, Metadata,
    OperationError, Recovery, SourceError,
};
use tracing::warn;

use crate::ack::{InFlight, NatsAck, Shared};
use crate::{Error, NatsConnection, Result};

/// The header the source reads the ID from and the producer writes it to, by default.
pub const ID_HEADER: &str = "event_id";

/// JetStream's own deduplication header, which a producer may set to the message ID
/// ([`NatsProducerBuilder::message_id`](crate::NatsProducerBuilder::message_id)) and a source
/// reads with [`IdFrom::MessageIdProperty`].
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";

/// Whether `name` is one of JetStream's own headers (`Nats-Msg-Id`, `Nats-Expected-…`,
/// `Nats-Rollup`, …), which the server acts on when a message is published and stores with it:
/// carried onto a dead letter or its replay they would have the copy dropped as a duplicate,
/// refused (the expected sequence has moved on) or made a rollup of its subject.
pub(crate) fn is_jetstream_header(name: &str) -> bool {
    name.get(..5)
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case("nats-"))
}

/// What NATS calls the places an ID can be.
pub const BINDING: Binding = Binding {
    broker: "NATS JetStream",
    header: "header",
    property: Some("header Nats-Msg-Id"),
    position: Some("stream and sequence"),
    // The CloudEvents NATS binding puts the attributes in `ce-` headers.
    cloud_events_prefixes: &["ce-"],
};

/// Builds a [`NatsSource`]: from [`NatsConnection::source`] or [`NatsSource::builder`].
#[derive(Debug)]
#[must_use]
pub struct NatsSourceBuilder {
    connection: NatsConnection,
    stream: String,
    consumer: String,
    filter_subject: Option<String>,
    dead_letter_subject: Option<String>,
    id_from: IdFrom,
    poll_timeout: Duration,
    ack_wait: Duration,
    max_deliver: Option<i64>,
    create_consumer: bool,
    progress: bool,
    redelivery_bucket: Option<String>,
    lanes_by_subject: bool,
}

impl NatsSourceBuilder {
    pub(crate) fn new(connection: NatsConnection, stream: String, consumer: String) -> Self {
        Self {
            connection,
            stream,
            consumer,
            filter_subject: None,
            dead_letter_subject: None,
            id_from: IdFrom::header(ID_HEADER),
            poll_timeout: Duration::from_secs(1),
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            create_consumer: true,
            progress: true,
            redelivery_bucket: None,
            lanes_by_subject: false,
        }
    }

    /// Only the stream's messages on this subject (wildcards allowed) go to the consumer it
    /// creates. Needed when the dead-letter subject is on the same stream.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// Where dead letters are published (default `<stream>.dlq`): a subject a JetStream stream
    /// stores, checked at `connect`. On the source's own stream, the consumer's filter must
    /// leave it out.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Where each message's ID is read (default: the header `event_id`).
    pub fn id_from(mut self, from: IdFrom) -> Self {
        self.id_from = from;
        self
    }

    /// Shorthand for `id_from(IdFrom::header(name))`.
    pub fn id_header(self, name: impl Into<String>) -> Self {
        self.id_from(IdFrom::header(name))
    }

    /// How long one receive waits for a first message (default 1 s).
    pub fn poll_timeout(mut self, wait: Duration) -> Self {
        self.poll_timeout = wait;
        self
    }

    /// The consumer's `ack_wait` when the source creates it (default 30 s): how long a
    /// delivery not acked stays with its member before the server hands it out again. An
    /// existing consumer keeps its own.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// The consumer's `max_deliver` when the source creates it (default: unlimited). Past it
    /// the server stops delivering a message and no dead letter is written: set
    /// [`Consumer::max_deliveries`](inbox_core::Consumer::max_deliveries) below it, so the
    /// consumer parks the message with a reason first.
    pub fn max_deliver(mut self, deliveries: i64) -> Self {
        self.max_deliver = Some(deliveries);
        self
    }

    /// Whether `connect` creates the durable consumer when it does not exist (default `true`).
    /// With `false` a missing consumer fails `connect`.
    pub fn create_consumer(mut self, create: bool) -> Self {
        self.create_consumer = create;
        self
    }

    /// Whether the source tells the server a delivery is still being worked on (`+WPI`,
    /// "in progress") every third of `ack_wait` until it is settled (default `true`), so a
    /// handler that runs longer than `ack_wait` keeps its message. With `false` a delivery held
    /// longer than `ack_wait` goes to another member.
    pub fn progress(mut self, on: bool) -> Self {
        self.progress = on;
        self
    }

    /// Makes each message's subject its ordering lane
    /// ([`Metadata::lane`](inbox_core::Metadata::lane)), for a consumer reading several
    /// subjects (`orders.>`): [`Consumer::parallel_lanes`](inbox_core::Consumer::parallel_lanes)
    /// then applies different subjects side by side, each in stream order. Default: off, one
    /// lane for the whole consumer.
    pub fn lanes_by_subject(mut self, on: bool) -> Self {
        self.lanes_by_subject = on;
        self
    }

    /// Keeps the delayed-redelivery counts in this JetStream key-value bucket (created at
    /// `connect` if missing, entries kept 7 days), not only in this process: a message handed
    /// back by one member or before a restart comes back to any member with its count, so the
    /// schedule ([`RetryPolicy::redeliver_after`](inbox_core::RetryPolicy::redeliver_after))
    /// goes on instead of starting again. Costs a write per hand-back and a read per redelivered
    /// message. Default: none, counts in this process only.
    pub fn redelivery_bucket(mut self, bucket: impl Into<String>) -> Self {
        self.redelivery_bucket = Some(bucket.into());
        self
    }

    /// Connects, finds the stream, creates or finds the consumer, and checks that a stream
    /// stores the dead-letter subject.
    ///
    /// # Errors
    /// [`Error::StreamMissing`], [`Error::DeadLetterSubjectMissing`], [`Error::Config`] for a
    /// push consumer, one without explicit acks or one that would read its own dead letters, and
    /// [`Error::Connect`] or [`Error::Nats`] when the server cannot be reached.
    pub async fn connect(self) -> Result<NatsSource> {
        self.id_from.check(&BINDING).map_err(Error::Config)?;
        if self.poll_timeout < Duration::from_millis(10) {
            return Err(Error::Config("poll_timeout is under 10 ms".into()));
        }
        let (client, lost) = self.connection.open_watched("the source").await?;
        let js = jetstream::ContextBuilder::new()
            .timeout(self.connection.timeout())
            .build(client.clone());
        let stream = crate::get_stream(&js, &self.stream).await?;
        let consumer = self.consumer(&stream).await?;
        let config = consumer.cached_info().config.clone();
        if config.ack_policy != AckPolicy::Explicit {
            return Err(Error::Config(format!(
                "the consumer `{}` of stream `{}` acks {:?}; the inbox needs explicit acks \
                 (ack_policy explicit)",
                self.consumer, self.stream, config.ack_policy
            )));
        }
        let dead_letter_subject = self
            .dead_letter_subject
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.stream));
        let dead_letter_stream = crate::stream_storing(&js, &dead_letter_subject).await?;
        if dead_letter_stream == self.stream
            && (config.filter_subject.is_empty()
                || crate::subject_matches(&config.filter_subject, &dead_letter_subject))
        {
            return Err(Error::Config(format!(
                "the consumer `{}` would read its own dead letters: the dead-letter subject \
                 `{dead_letter_subject}` is on its stream `{}` and its filter `{}` takes it; \
                 give the consumer a filter_subject that leaves it out, or dead-letter to \
                 another stream",
                self.consumer,
                self.stream,
                if config.filter_subject.is_empty() {
                    "(none)"
                } else {
                    &config.filter_subject
                }
            )));
        }
        if config.max_deliver > 0 {
            warn!(
                consumer = %self.consumer,
                max_deliver = config.max_deliver,
                "the consumer has a max_deliver: past it the server drops a message without a \
                 dead letter; keep Consumer::max_deliveries below it"
            );
        }
        let bucket = match &self.redelivery_bucket {
            None => None,
            Some(name) => Some((
                crate::redelivery_bucket(&js, name).await?,
                format!(
                    "{}.{}",
                    crate::key_token(&self.stream),
                    crate::key_token(&self.consumer)
                ),
            )),
        };
        let shared = Arc::new(Shared {
            client,
            js,
            stream: self.stream.clone(),
            dead_letter_subject,
            in_flight: Mutex::new(HashMap::new()),
            handing_back: tokio::sync::Mutex::new(()),
            marks: Mutex::new(HashMap::new()),
            bucket,
            timeout: self.connection.timeout(),
            failed_acks: Mutex::new(Vec::new()),
            next: std::sync::atomic::AtomicU64::new(0),
        });
        let heartbeat = self
            .progress
            .then(|| crate::ack::spawn_progress(&shared, config.ack_wait / 3));
        Ok(NatsSource {
            consumer,
            shared,
            id_from: self.id_from,
            poll_timeout: self.poll_timeout,
            operation_timeout: self.connection.timeout(),
            lost,
            lanes: self.lanes_by_subject,
            name: self.consumer,
            heartbeat,
        })
    }

    async fn consumer(&self, stream: &jetstream::stream::Stream) -> Result<PullConsumer> {
        use async_nats::jetstream::context::ConsumerInfoErrorKind;
        let found = match stream.consumer_info(&self.consumer).await {
            Ok(info) => match &info.config.deliver_subject {
                // Pulling from it fails for good: a setting to fix, not a request to retry.
                Some(subject) => {
                    return Err(Error::Config(format!(
                        "the consumer `{}` of stream `{}` is a push consumer (it delivers to \
                         `{subject}`); the source pulls: name a pull consumer, or a new durable \
                         name for the source to create",
                        self.consumer, self.stream
                    )))
                }
                None => true,
            },
            Err(e) if matches!(e.kind(), ConsumerInfoErrorKind::NotFound) => false,
            Err(e) if matches!(e.kind(), ConsumerInfoErrorKind::JetStream(inner) if inner.error_code() == async_nats::jetstream::ErrorCode::CONSUMER_NOT_FOUND) => {
                false
            }
            Err(e) => {
                return Err(Error::nats(
                    format!(
                        "looking up the consumer `{}` of stream `{}`",
                        self.consumer, self.stream
                    ),
                    Recovery::Retry,
                    e,
                ))
            }
        };
        if found {
            return stream
                .get_consumer::<pull::Config>(&self.consumer)
                .await
                .map_err(|e| {
                    Error::nats(
                        format!(
                            "opening the consumer `{}` of stream `{}`",
                            self.consumer, self.stream
                        ),
                        Recovery::Retry,
                        e,
                    )
                });
        }
        if !self.create_consumer {
            return Err(Error::Config(format!(
                "the consumer `{}` of stream `{}` does not exist; create it (durable, ack \
                 explicit) or let the source create it (create_consumer(true))",
                self.consumer, self.stream
            )));
        }
        let config = pull::Config {
            durable_name: Some(self.consumer.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver.unwrap_or(-1),
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        };
        stream.create_consumer(config).await.map_err(|e| {
            Error::nats(
                format!(
                    "creating the consumer `{}` of stream `{}`",
                    self.consumer, self.stream
                ),
                Recovery::Retry,
                e,
            )
        })
    }
}

/// A durable JetStream pull consumer with explicit acks, as a [`MessageSource`]. See the
/// [crate docs](crate#ack-semantics) for what ack, nack and a dead letter are.
pub struct NatsSource {
    consumer: PullConsumer,
    shared: Arc<Shared>,
    id_from: IdFrom,
    poll_timeout: Duration,
    operation_timeout: Duration,
    /// Counts the connections lost: a pull in flight then is never answered.
    lost: tokio::sync::watch::Receiver<u64>,
    lanes: bool,
    name: String,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSource")
            .field("stream", &self.shared.stream)
            .field("consumer", &self.name)
            .field("dead_letter_subject", &self.shared.dead_letter_subject)
            .field("id_from", &self.id_from)
            .finish_non_exhaustive()
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.abort();
        }
        // Acks that failed are sent again for a few seconds more, while the runtime lives.
        if self.shared.acks_failed() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let shared = Arc::clone(&self.shared);
                runtime.spawn(async move {
                    for _ in 0..20 {
                        shared.flush_acks().await;
                        if !shared.acks_failed() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                });
            }
        }
    }
}

impl NatsSource {
    /// A source reading `stream` through the durable consumer `consumer`, on the server(s)
    /// `NATS_URL` names; the same as `NatsConnection::from_env().source(stream, consumer)`.
    pub fn builder(stream: impl Into<String>, consumer: impl Into<String>) -> NatsSourceBuilder {
        NatsConnection::from_env().source(stream, consumer)
    }

    /// The dead-letter subject this source parks messages on.
    pub fn dead_letter_subject(&self) -> &str {
        &self.shared.dead_letter_subject
    }

    async fn take(&self, max: usize) -> Result<Vec<Delivery<NatsAck>>, SourceError> {
        if self.shared.acks_failed() {
            self.shared.flush_acks().await;
        }
        let max = max.max(1);
        let mut messages = self.pull(max, None).await?;
        if messages.is_empty() {
            messages = self.pull(1, Some(self.poll_timeout)).await?;
            if !messages.is_empty() && max > 1 {
                // What else is waiting; on an error, what arrived goes out and the next
                // receive reports it.
                if let Ok(more) = self.pull(max - 1, None).await {
                    messages.extend(more);
                }
            }
        }
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in messages {
            deliveries.push(self.delivery(message).await?);
        }
        Ok(deliveries)
    }

    async fn pull(
        &self,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Vec<jetstream::Message>, SourceError> {
        let failed = |e: &dyn std::fmt::Display| {
            OperationError::new(
                Recovery::Retry,
                format!(
                    "fetching from the consumer `{}` of stream `{}`",
                    self.name, self.shared.stream
                ),
                e.to_string(),
            )
        };
        // A pull request lost with its connection is never answered: bounded here, the next
        // receive asks again (what the lost one delivered comes back after ack_wait).
        let bound = wait.unwrap_or_default() + self.operation_timeout;
        let deadline = tokio::time::Instant::now() + bound;
        let request = async {
            match wait {
                None => self.consumer.fetch().max_messages(max).messages().await,
                Some(wait) => {
                    self.consumer
                        .batch()
                        .max_messages(max)
                        .expires(wait)
                        .messages()
                        .await
                }
            }
        };
        let lost = || {
            failed(&format!(
                "no answer within {bound:?}; the connection may be lost"
            ))
        };
        let batch = tokio::time::timeout_at(deadline, request)
            .await
            .map_err(|_| lost())?
            .map_err(|e| failed(&e))?;
        let mut batch = std::pin::pin!(batch);
        let mut messages = Vec::new();
        loop {
            let next = match tokio::time::timeout_at(deadline, batch.next()).await {
                Ok(Some(next)) => next,
                Ok(None) => break,
                Err(_) if !messages.is_empty() => break,
                Err(_) => return Err(lost()),
            };
            match next {
                Ok(message) => messages.push(message),
                // Taken from the broker already: hand them out; the error comes again.
                Err(_) if !messages.is_empty() => break,
                Err(e) => {
                    let text = e.to_string();
                    let recovery = if text.contains("consumer deleted") {
                        Recovery::Fatal
                    } else {
                        Recovery::Retry
                    };
                    return Err(OperationError::new(
                        recovery,
                        format!(
                            "fetching from the consumer `{}` of stream `{}`",
                            self.name, self.shared.stream
                        ),
                        text,
                    ));
                }
            }
        }
        Ok(messages)
    }

    async fn delivery(
        &self,
        message: jetstream::Message,
    ) -> Result<Delivery<NatsAck>, SourceError> {
        let (sequence, delivered, published) = {
            let info = message.info().map_err(|e| {
                OperationError::new(
                    Recovery::Retry,
                    "reading a JetStream delivery's metadata",
                    e,
                )
            })?;
            (
                info.stream_sequence,
                u64::try_from(info.delivered).unwrap_or(1),
                info.published.unix_timestamp_nanos(),
            )
        };
        // Kept before `split`, which moves it into the acker.
        let reply = message.message.reply.clone();
        let (message, acker) = message.split();
        let mut headers: Vec<(String, Vec<u8>)> = message
            .headers
            .iter()
            .flat_map(|map| map.iter())
            .flat_map(|(name, values)| {
                values
                    .iter()
                    .map(move |v| (name.to_string(), v.as_str().as_bytes().to_vec()))
            })
            .collect();
        headers.sort();
        let carrier = Carrier {
            headers: &headers,
            payload: &message.payload,
            position: format!("{}/{sequence}", self.shared.stream),
        };
        let id = self.id_from.read(&carrier);
        let mut meta = Metadata::default();
        meta.source = message.subject.to_string();
        meta.lane = self.lanes.then(|| meta.source.clone());
        meta.position = format!("sequence {sequence}");
        meta.delivery_count = Some(u32::try_from(delivered).unwrap_or(u32::MAX));
        meta.redelivered = delivered > 1;
        meta.redeliveries = self.shared.redeliveries(sequence, delivered).await;
        meta.timestamp = system_time(published);
        let mut inbox_message = Message::new(id, message.payload.to_vec());
        inbox_message.headers = headers;
        inbox_message.meta = meta;
        let in_flight = InFlight::register(&self.shared, reply.clone());
        Ok(Delivery {
            message: inbox_message,
            ack: NatsAck::new(
                acker,
                reply,
                sequence,
                delivered,
                Arc::clone(&self.shared),
                in_flight,
            ),
        })
    }
}

impl MessageSource for NatsSource {
    type Ack = NatsAck;

    /// Pulls what is waiting at once; with nothing there, waits up to the poll timeout for a
    /// first message, then takes what else is waiting. A future dropped while a pull is
    /// outstanding leaves its messages with this member until `ack_wait` runs out.
    ///
    /// A connection lost before or during the pull fails it at once with
    /// [`Recovery::Reconnect`] (the client connects again by itself): a pull request lost with
    /// its connection is never answered, and what it delivered comes back after `ack_wait`.
    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<NatsAck>>, SourceError> {
        let lost = || {
            OperationError::new(
                Recovery::Reconnect,
                format!(
                    "fetching from the consumer `{}` of stream `{}`",
                    self.name, self.shared.stream
                ),
                "the connection to NATS was lost; the client connects again by itself",
            )
        };
        if self.lost.has_changed().unwrap_or(false) {
            self.lost.borrow_and_update();
            return Err(lost());
        }
        let mut watch = self.lost.clone();
        let gone = std::pin::pin!(async move {
            if watch.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        });
        let outcome = {
            let take = std::pin::pin!(self.take(max));
            match futures_util::future::select(take, gone).await {
                futures_util::future::Either::Left((taken, _)) => Some(taken),
                futures_util::future::Either::Right(_) => None,
            }
        };
        outcome.unwrap_or_else(|| {
            self.lost.borrow_and_update();
            Err(lost())
        })
    }

    fn system(&self) -> &'static str {
        "nats"
    }

    fn consumer_group(&self) -> Option<&str> {
        Some(&self.name)
    }

    fn capabilities(&self) -> Capabilities {
        let capabilities = Capabilities::NONE
            .with_delivery_count()
            .with_delayed_nack()
            .with_delayed_redelivery();
        if self.lanes {
            capabilities.with_lanes()
        } else {
            capabilities
        }
    }
}

/// One received message as [`IdFrom::read`] sees it.
struct Carrier<'a> {
    headers: &'a [(String, Vec<u8>)],
    payload: &'a [u8],
    position: String,
}

impl IdCarrier for Carrier<'_> {
    fn binding(&self) -> &Binding {
        &BINDING
    }

    fn header(&self, name: &str) -> Option<std::result::Result<Cow<'_, [u8]>, String>> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| Ok(Cow::Borrowed(v.as_slice())))
    }

    fn property(&self) -> Option<Cow<'_, [u8]>> {
        self.header(NATS_MSG_ID).and_then(std::result::Result::ok)
    }

    fn position(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(&self.position))
    }

    fn payload(&self) -> &[u8] {
        self.payload
    }
}

/// When the message was stored, for a dead letter's time.
pub(crate) fn system_time(nanos: i128) -> Option<SystemTime> {
    u64::try_from(nanos)
        .ok()
        .map(|nanos| UNIX_EPOCH + Duration::from_nanos(nanos))
}
