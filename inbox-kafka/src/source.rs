//! The [`MessageSource`] over a Kafka consumer group.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::FutureExt;
use inbox_core::{
    Binding, Capabilities, Delivery, IdCarrier, IdFrom, Message, MessageSource, Recovery,
    SourceError,
};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedHeaders, BorrowedMessage, Headers};
use rdkafka::{Message as _, Offset};
use tokio::task::JoinHandle;
use tracing::warn;

use crate::ack::KafkaAck;
use crate::commit::{commit_task, OffsetCommits};
use crate::context::InboxContext;
use crate::dead_letter::{DeadLetterCheck, DeadLetterProducer};
use crate::failure::Failures;
use crate::redelivery;
use crate::shared_consumer::SharedConsumer;
use crate::{Error, KafkaConnection, KafkaSourceBuilder, Result};

/// How many immediate polls in a row may come back without a message (librdkafka served a
/// rebalance or error event instead) before a batch is closed.
const IDLE_POLLS: u32 = 3;

/// A Kafka consumer-group member as an inbox [`MessageSource`]. Build it with
/// [`KafkaSource::builder`].
///
/// Each [`receive`](MessageSource::receive) waits up to the poll timeout for a first message,
/// then takes whatever else is already fetched, up to the batch size, so that one transaction
/// covers the batch. See the crate docs for the ack semantics.
///
/// Dropping the source closes its consumer on tokio's blocking pool (outside a runtime: in
/// place): librdkafka revokes the partitions, which commits what was acked, waits for that
/// commit, and leaves the group. A runtime waits for its blocking pool when it shuts down.
pub struct KafkaSource {
    consumer: SharedConsumer,
    /// The dead-letter producer and topic, shared by every ack.
    dead_letters: Arc<DeadLetterProducer>,
    id_from: IdFrom,
    poll_timeout: Duration,
    operation_timeout: Duration,
    redelivery_window: Option<Duration>,
    /// Made by the first receive; kept until it passes.
    dead_letter_check: Option<DeadLetterCheck>,
    /// Started by the first receive, when commits are coalesced; aborted on drop.
    commit_task: Option<JoinHandle<()>>,
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        if let Some(task) = self.commit_task.take() {
            task.abort();
        }
    }
}

impl fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSource")
            .field("group", &self.consumer.context().group)
            .field("commit_interval", &self.consumer.context().commit_interval)
            .field("id_from", &self.id_from)
            .field("dead_letter_topic", &self.dead_letters.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Starts configuring a source that consumes `topics` (names, or `^`-prefixed patterns) as
    /// member of the consumer group `group`, on the brokers `KAFKA_BROKERS` names (another
    /// cluster, TLS, SASL or a token provider: [`KafkaConnection::source`]).
    ///
    /// ```no_run
    /// # async fn f() -> inbox_kafka::Result<()> {
    /// let source = inbox_kafka::KafkaSource::builder(["payments"], "wallet")
    ///     .dead_letter_topic("payments.parked")
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(
        topics: impl IntoIterator<Item = impl Into<String>>,
        group: impl Into<String>,
    ) -> KafkaSourceBuilder {
        KafkaConnection::from_env().source(topics, group)
    }

    pub(crate) fn new(config: &KafkaSourceBuilder) -> Result<Self> {
        let operation_timeout = config.connection.operation_timeout;
        let failures = Failures::default();
        let (consumer_config, context) = config.consumer_config(&failures)?;
        let consumer: StreamConsumer<InboxContext> = consumer_config
            .create_with_context(InboxContext {
                group: config.group_id.clone(),
                commit_interval: config.commit_interval,
                failures: failures.clone(),
                token: context.token.clone(),
                ..InboxContext::default()
            })
            .map_err(|e| Error::kafka("creating the Kafka consumer", e))?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| Error::kafka(format!("subscribing to {topics:?}"), e))?;

        // The admin client and the dead-letter producer share the consumer's context (its token
        // refresh, its connection failures). A dead letter is produced once per delivery: the
        // idempotent producer keeps its own retries from adding copies.
        let (admin_config, _) = config.connection.client(&failures)?;
        let (producer_config, _) = config.connection.producer_client(&failures)?;
        let producer = producer_config
            .create_with_context(context.clone())
            .map_err(|e| Error::kafka("creating the dead-letter producer", e))?;
        let dead_letter_check = DeadLetterCheck::new(config, admin_config, context);
        let dead_letters = Arc::new(DeadLetterProducer {
            producer,
            topic: config.dead_letter_topic.clone(),
            timeout: operation_timeout,
            failures,
        });

        Ok(Self {
            consumer: SharedConsumer::new(Arc::new(consumer)),
            dead_letters,
            id_from: config.id_from.clone(),
            poll_timeout: config.poll_timeout,
            operation_timeout,
            redelivery_window: None,
            dead_letter_check: Some(dead_letter_check),
            commit_task: None,
        })
    }

    /// Counters of this source's offset commit requests (how many acks one request covers, how
    /// many failed). Take them before handing the source to the consumer.
    pub fn offset_commits(&self) -> OffsetCommits {
        self.consumer.context().commits.clone()
    }

    /// Tells the consumer's start-up check how long the topic keeps records, as read with
    /// [`KafkaAdmin::retention`](crate::KafkaAdmin::retention): the consumer then warns when the
    /// inbox retention ([`Consumer::inbox_retention`](inbox_core::Consumer::inbox_retention)) is
    /// shorter. Unlimited retention and a compacted topic (which keeps each key's last record
    /// forever) are reported as the longest duration, so the consumer always warns.
    pub fn with_retention(mut self, retention: crate::Retention) -> Self {
        self.redelivery_window = match retention {
            crate::Retention::Limited(window) => Some(window),
            crate::Retention::Unlimited | crate::Retention::Compacted => Some(Duration::MAX),
            crate::Retention::NotReported => None,
        };
        self
    }

    /// The underlying rdkafka consumer, for what this adapter does not wrap (metadata, lag,
    /// pausing). Committing or seeking through it bypasses the offset tracking.
    pub fn consumer(&self) -> &StreamConsumer<impl rdkafka::consumer::ConsumerContext> {
        &self.consumer
    }

    /// Reads the redelivery marks of partitions assigned since the last receive (they wait,
    /// paused, until then) and resumes them: see [`redelivery::restore`].
    async fn restore_assigned(&self) {
        let awaiting = self.consumer.context().tracker().awaiting();
        if awaiting.is_empty() {
            return;
        }
        let consumer = self.consumer.clone();
        let timeout = self.operation_timeout;
        let runtime = tokio::runtime::Handle::current();
        let task = tokio::task::spawn_blocking(move || {
            redelivery::restore(&consumer, &awaiting, timeout, &runtime);
        });
        if let Err(e) = task.await {
            warn!(group = %self.consumer.context().group, error = %e, "reading redelivery counts failed; the next receive tries again");
        }
    }

    /// Whether `message` belongs to a partition whose redelivery marks are still to be read
    /// (fetched before the receive read them): then it is not handed out, and the partition
    /// is sought back to it, to be read again once the marks are known.
    fn awaiting(&self, message: &BorrowedMessage<'_>) -> bool {
        let (topic, partition, offset) = (message.topic(), message.partition(), message.offset());
        if !self
            .consumer
            .context()
            .tracker()
            .is_awaiting(topic, partition)
        {
            return false;
        }
        // Without a timeout the seek does not wait; its barrier keeps what was fetched before
        // it from being handed out.
        if let Err(e) = self
            .consumer
            .seek(topic, partition, Offset::Offset(offset), Duration::ZERO)
        {
            // Handed out then, rather than lost: its delayed redeliveries count from 0 again.
            warn!(topic, partition, offset, error = %e, "seeking back a record fetched before its partition's redelivery counts were read failed");
            return false;
        }
        true
    }

    /// The delivery of a record read, `None` for one read again only because a rewind went back
    /// past it, which was finished already or whose earlier copy is still out
    /// ([`Tracker::received`](crate::tracker::Tracker::received)).
    fn delivery(&self, record: &BorrowedMessage<'_>) -> Option<Delivery<KafkaAck>> {
        let topic = record.topic();
        let (partition, offset) = (record.partition(), record.offset());
        let tracked = self
            .consumer
            .context()
            .tracker()
            .received(topic, partition, offset)?;
        let id = self.id_from.read(&Record {
            headers: record.headers(),
            payload: record.payload().unwrap_or_default(),
            position: (topic, partition, offset),
        });
        let ack = KafkaAck {
            consumer: self.consumer.clone(),
            topic: topic.into(),
            partition,
            offset,
            generation: tracked.generation,
            timeout: self.operation_timeout,
            dead_letters: Arc::clone(&self.dead_letters),
        };
        let mut message = Message::new(id, record.payload().unwrap_or_default());
        message.key = record.key().map(<[u8]>::to_vec);
        message.headers = record_headers(record).collect();
        let meta = &mut message.meta;
        meta.source = topic.to_owned();
        meta.position = format!("partition {partition} offset {offset}");
        // Kafka does not count deliveries; this adapter counts its own nacks.
        let count = tracked.delivery_count;
        meta.delivery_count = (count > 1).then_some(count);
        meta.redelivered = count > 1;
        meta.redeliveries = tracked.redeliveries;
        meta.lane = Some(format!("{topic}[{partition}]"));
        meta.partition = Some(partition.to_string());
        meta.timestamp = timestamp(record);
        Some(Delivery { message, ack })
    }
}

/// A record's headers, in order; a null value reads as empty.
pub(crate) fn record_headers<'a>(
    record: &'a impl rdkafka::Message,
) -> impl Iterator<Item = (String, Vec<u8>)> + 'a {
    let headers = record.headers().into_iter().flat_map(|list| list.iter());
    headers.map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
}

/// When the record was produced (or appended), `None` when it carries no timestamp.
pub(crate) fn timestamp(record: &impl rdkafka::Message) -> Option<SystemTime> {
    let ms = u64::try_from(record.timestamp().to_millis()?).ok()?;
    Some(UNIX_EPOCH + Duration::from_millis(ms))
}

/// Where Kafka keeps what [`IdFrom`] reads: record headers, CloudEvents' binary mode as `ce_`
/// headers (the CloudEvents Kafka protocol binding), no message-ID property.
pub(crate) const ID_BINDING: Binding = Binding {
    broker: "Kafka",
    header: "header",
    property: None,
    position: Some("topic, partition and offset"),
    cloud_events_prefixes: &["ce_"],
};

/// A record as [`IdFrom::read`] sees it.
struct Record<'a> {
    headers: Option<&'a BorrowedHeaders>,
    payload: &'a [u8],
    /// Topic, partition and offset.
    position: (&'a str, i32, i64),
}

impl IdCarrier for Record<'_> {
    fn binding(&self) -> &Binding {
        &ID_BINDING
    }

    /// The first header of that name; one with a null value counts as absent.
    fn header(&self, name: &str) -> Option<Result<Cow<'_, [u8]>, String>> {
        let header = self.headers?.iter().find(|h| h.key == name)?;
        header.value.map(|v| Ok(Cow::Borrowed(v)))
    }

    /// `<topic>/<partition>/<offset>`: no topic name holds a `/`.
    fn position(&self) -> Option<Cow<'_, str>> {
        let (topic, partition, offset) = self.position;
        Some(Cow::Owned(format!("{topic}/{partition}/{offset}")))
    }

    fn payload(&self) -> &[u8] {
        self.payload
    }
}

impl MessageSource for KafkaSource {
    type Ack = KafkaAck;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<KafkaAck>>, SourceError> {
        if let Some(check) = &self.dead_letter_check {
            // Before the first poll, so a source that fails it never joins the group.
            check.run(&self.dead_letters).await?;
            self.dead_letter_check = None;
        }
        let interval = self.consumer.context().commit_interval;
        if self.commit_task.is_none() && !interval.is_zero() {
            // Here rather than in `build`, which may run outside a runtime.
            let consumer = self.consumer.downgrade();
            self.commit_task = Some(tokio::spawn(commit_task(consumer, interval)));
        }
        // `recv` is cancellation safe, and after it nothing awaits until the batch is returned,
        // so a dropped receive loses no message. Reading the redelivery marks of assigned
        // partitions happens before `recv`, and goes on without the receive if it is dropped.
        let deadline = tokio::time::Instant::now() + self.poll_timeout;
        let first = loop {
            self.restore_assigned().await;
            let assigned = self.consumer.context().assigned.notified();
            let received = tokio::select! {
                biased;
                // Partitions were assigned (in a rebalance served inside `recv`): they wait,
                // paused, for their marks.
                () = assigned => continue,
                received = tokio::time::timeout_at(deadline, self.consumer.recv()) => received,
            };
            match received {
                Err(_elapsed) => return Ok(Vec::new()),
                Ok(Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::PollExceeded) => {
                    // The batch before this poll took longer than max.poll.interval.ms: the
                    // group evicted this member and gave its partitions away. This poll
                    // rejoins; what the evicted batch wrote is harmless because the inbox
                    // already holds its IDs.
                    warn!(group = %self.consumer.context().group, "evicted for exceeding max.poll.interval.ms; rejoining the group");
                    return Ok(Vec::new());
                }
                Ok(Err(e)) => {
                    // A TLS handshake or a login the brokers refused: librdkafka would retry it
                    // forever in the background; the source says why instead.
                    if let Some(refusal) = self.consumer.context().failures.refusal_of(&e) {
                        return Err(refusal.into_source());
                    }
                    if !informational(&e) {
                        return Err(Error::kafka("receiving from Kafka", e).into_source());
                    }
                    // A broker down, all brokers down, a connection refused: librdkafka
                    // reconnects and rejoins by itself, but only while it is polled. Handing
                    // the error to the consumer would make it back off (up to 30 s) between
                    // polls, and after max.poll.interval.ms without one librdkafka leaves the
                    // group: the consumer would stay without partitions after the brokers
                    // came back.
                    warn!(group = %self.consumer.context().group, error = %e, "broker error; librdkafka reconnects by itself, polling on");
                }
                Ok(Ok(message)) if self.awaiting(&message) => {}
                Ok(Ok(message)) => {
                    if let Some(delivery) = self.delivery(&message) {
                        break delivery;
                    }
                }
            }
        };
        let mut batch = vec![first];
        let mut idle = 0;
        while batch.len() < max && idle < IDLE_POLLS {
            match self.consumer.recv().now_or_never() {
                Some(Ok(message)) if self.awaiting(&message) => break,
                Some(Ok(message)) => {
                    idle = 0;
                    batch.extend(self.delivery(&message));
                }
                Some(Err(e)) => {
                    // The messages already taken are handed out; the error is one-off.
                    warn!(group = %self.consumer.context().group, error = %e, "consumer error while filling a batch");
                    break;
                }
                None => idle += 1,
            }
        }
        Ok(batch)
    }

    fn system(&self) -> &'static str {
        "kafka"
    }

    fn consumer_group(&self) -> Option<&str> {
        Some(&self.consumer.context().group)
    }

    fn redelivery_window(&self) -> Option<Duration> {
        self.redelivery_window
    }

    /// Lanes (a message's partition) and delayed redelivery (see the crate docs, "Ack
    /// semantics"). No delivery count: the count this source keeps of its own nacks is lost
    /// with the process, so a message that kills its consumer is never counted. No delayed
    /// nack: a nack seeks back at once.
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE.with_lanes().with_delayed_redelivery()
    }
}

pub(crate) fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

/// Whether a consumer error is one librdkafka reports for information and recovers from by
/// itself (its documentation: consumer errors are informational, the consumer retries every
/// kind of error but the fatal ones).
fn informational(e: &KafkaError) -> bool {
    matches!(e, KafkaError::MessageConsumption(_)) && crate::error::recovery(e) != Recovery::Fatal
}
