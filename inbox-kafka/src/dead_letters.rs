//! A dead-letter topic read back for [`inbox_core::replay`]: a log cannot delete, so a consumer
//! group of its own ([`DEFAULT_REPLAY_GROUP`]) remembers what was replayed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_core::replay::{DeadLetter, DeadLetters};
use inbox_core::{MessageId, OperationError};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};

use crate::commit::offset_list;
use crate::context::ProducerContext;
use crate::failure::Failures;
use crate::source::{record_headers, timestamp};
use crate::tracker::Tracker;
use crate::{Error, KafkaConnection, KafkaSourceBuilder, Result};

/// The reader's client: its context logs, notes connection failures and hands out tokens.
type Reader = BaseConsumer<ProducerContext>;

/// The consumer group whose committed offsets mark a dead-letter topic's records as replayed.
pub const DEFAULT_REPLAY_GROUP: &str = "inbox-admin-replay";

/// The records of a Kafka dead-letter topic (`<topic>.dlq`) not yet replayed, as
/// [`inbox_core::replay`] reads them: each keeps its key, payload and headers (the ID in
/// `event_id`) and carries the [`inbox_core::dead_letter`] headers; its position is
/// `partition P offset O` and its time the record's timestamp (when it was parked).
///
/// A topic cannot delete a record, so "removed" means committed by the consumer group
/// [`group`](KafkaDeadLettersBuilder::group) (default [`DEFAULT_REPLAY_GROUP`]): a reading
/// starts at the group's committed offset of each partition (the beginning when it has none)
/// and goes up to the end as it was when the reading started; removing commits past every
/// record replayed, as far as every earlier record of the partition was replayed too. A
/// record a selection left out therefore holds back the commit of the later ones, which a
/// later reading shows (and a later replay publishes) again; the inbox skips those copies.
/// "Empty" is: the group's committed offset is the end of every partition.
pub struct KafkaDeadLetters {
    topic: String,
    id_header: String,
    consumer: Arc<Reader>,
    timeout: Duration,
    partitions: BTreeMap<i32, Partition>,
    /// The records read, and which were replayed: a removal commits each partition's replayed
    /// prefix, as a source commits its finished one.
    tracker: Tracker,
}

/// How far one partition is read.
#[derive(Debug, Clone, Default)]
struct Partition {
    /// The end of the partition when the reading started.
    end: i64,
    /// The next offset to read.
    next: i64,
}

impl std::fmt::Debug for KafkaDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaDeadLetters")
            .field("topic", &self.topic)
            .field("id_header", &self.id_header)
            .field("partitions", &self.partitions)
            .field("tracker", &self.tracker)
            .finish_non_exhaustive()
    }
}

/// Builds a [`KafkaDeadLetters`]; start with [`KafkaConnection::dead_letters`] (or
/// [`KafkaDeadLetters::builder`], on the brokers `KAFKA_BROKERS` names).
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct KafkaDeadLettersBuilder {
    connection: KafkaConnection,
    topic: String,
    group: String,
    id_header: String,
}

impl KafkaDeadLetters {
    /// Reads the dead-letter topic `topic` (like `payments.dlq`) on the brokers `KAFKA_BROKERS`
    /// names (another cluster, TLS, SASL or a token provider: [`KafkaConnection::dead_letters`]).
    pub fn builder(topic: impl Into<String>) -> KafkaDeadLettersBuilder {
        KafkaConnection::from_env().dead_letters(topic)
    }

    fn done(&self) -> bool {
        self.partitions.values().all(|p| p.next >= p.end)
    }
}

impl KafkaDeadLettersBuilder {
    pub(crate) fn new(connection: KafkaConnection, topic: impl Into<String>) -> Self {
        Self {
            connection,
            topic: topic.into(),
            group: DEFAULT_REPLAY_GROUP.to_owned(),
            id_header: KafkaSourceBuilder::DEFAULT_ID_HEADER.to_owned(),
        }
    }

    /// The consumer group that remembers what was replayed (default [`DEFAULT_REPLAY_GROUP`]).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// The header holding the message ID (default `event_id`).
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Connects, and finds where each partition's reading starts and ends.
    pub async fn connect(self) -> Result<KafkaDeadLetters> {
        let timeout = self.connection.operation_timeout;
        let failures = Failures::default();
        let (mut config, context) = self.connection.client(&failures)?;
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest");
        let consumer: Reader = config
            .create_with_context(context)
            .map_err(|e| Error::kafka("creating the dead-letter reader", e))?;
        let consumer = Arc::new(consumer);
        let topic = self.topic.clone();
        let reader = Arc::clone(&consumer);
        // A TLS handshake or a login the brokers refuse fails the connect at once, saying why
        // (librdkafka's own error would be a transport failure at the timeout).
        let started = tokio::select! {
            refused = failures.refused() => return Err(refused),
            started = blocking(move || starts(&reader, &topic, timeout)) => started?,
        };
        let partitions = match started {
            Ok(partitions) => partitions,
            Err(e) => {
                // A reader's callbacks run in its polls: the refusal behind a failed metadata
                // request may still be queued. Served, it says why.
                let reader = Arc::clone(&consumer);
                let _ = blocking(move || reader.poll(Duration::from_millis(200)).is_some()).await;
                return Err(failures.take_refusal().unwrap_or(e));
            }
        };
        let assign = || {
            let mut assignment = TopicPartitionList::new();
            for (partition, p) in &partitions {
                assignment.add_partition_offset(&self.topic, *partition, Offset::Offset(p.next))?;
            }
            consumer.assign(&assignment)
        };
        assign().map_err(|e| Error::kafka("assigning the dead-letter partitions", e))?;
        Ok(KafkaDeadLetters {
            topic: self.topic,
            id_header: self.id_header,
            consumer,
            timeout,
            partitions,
            tracker: Tracker::default(),
        })
    }
}

/// Each partition of `topic` with the group's committed offset (else the low watermark) and
/// the high watermark.
fn starts(consumer: &Reader, topic: &str, timeout: Duration) -> Result<BTreeMap<i32, Partition>> {
    // Serves what librdkafka queued for the application as the client started (a token
    // request among them) before the first request waits on a login.
    let _ = consumer.poll(Duration::from_millis(100));
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| Error::kafka(format!("reading the metadata of `{topic}`"), e))?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Err(Error::Config(format!(
            "dead-letter topic `{topic}` does not exist"
        )));
    };
    if found.partitions().is_empty() {
        return Err(Error::Config(format!(
            "dead-letter topic `{topic}` does not exist (no partitions)"
        )));
    }
    let mut list = TopicPartitionList::new();
    for p in found.partitions() {
        list.add_partition(topic, p.id());
    }
    let committed = consumer
        .committed_offsets(list, timeout)
        .map_err(|e| Error::kafka(format!("reading the committed offsets of `{topic}`"), e))?;
    let mut partitions = BTreeMap::new();
    for p in found.partitions() {
        let (low, high) = consumer
            .fetch_watermarks(topic, p.id(), timeout)
            .map_err(|e| Error::kafka(format!("reading the offsets of `{topic}`"), e))?;
        let committed = committed
            .find_partition(topic, p.id())
            .and_then(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            });
        let next = committed.unwrap_or(low).max(low);
        partitions.insert(p.id(), Partition { end: high, next });
    }
    Ok(partitions)
}

/// `f` on the blocking pool. A call that panicked or was cancelled (the runtime shutting down)
/// is a transient failure of that call, as on the consumer's ack and commit paths, not a
/// setting to fix.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        Error::kafka(
            format!("a blocking Kafka call did not finish ({e})"),
            KafkaError::Canceled,
        )
    })
}

impl DeadLetters for KafkaDeadLetters {
    fn name(&self) -> &str {
        &self.topic
    }

    async fn next(&mut self, max: usize) -> std::result::Result<Vec<DeadLetter>, OperationError> {
        let mut letters = Vec::new();
        let mut idle_since = Instant::now();
        while letters.len() < max && !self.done() {
            let consumer = Arc::clone(&self.consumer);
            let id_header = self.id_header.clone();
            let polled = blocking(move || {
                consumer.poll(Duration::from_millis(200)).map(|r| {
                    r.map(|m| {
                        let (partition, offset) = (m.partition(), m.offset());
                        let mut letter = DeadLetter::new(
                            format!("partition {partition} offset {offset}"),
                            m.payload().unwrap_or_default().to_vec(),
                        );
                        letter.key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
                        let mut headers = Vec::new();
                        for (key, value) in record_headers(&m) {
                            if letter.id.is_none() && key == id_header {
                                letter.id = MessageId::from_bytes(&value).ok();
                            } else {
                                headers.push((key, value));
                            }
                        }
                        letter.take_metadata(headers);
                        letter.timestamp = timestamp(&m);
                        (partition, offset, letter)
                    })
                })
            })
            .await?;
            match polled {
                None => {
                    if idle_since.elapsed() > self.timeout {
                        return Err(Error::Config(format!(
                            "no record of dead-letter topic `{}` arrived within {:?} although \
                             its partitions are not read to their end",
                            self.topic, self.timeout
                        ))
                        .into_source());
                    }
                }
                Some(Err(e)) => {
                    return Err(Error::kafka(format!("reading `{}`", self.topic), e).into_source())
                }
                Some(Ok((partition, offset, mut letter))) => {
                    idle_since = Instant::now();
                    let Some(p) = self.partitions.get_mut(&partition) else {
                        continue;
                    };
                    // Past the end as it was at the start: left for a later reading.
                    if offset < p.next || offset >= p.end {
                        p.next = p.next.max(offset + 1);
                        continue;
                    }
                    p.next = offset + 1;
                    let Some(read) = self.tracker.received(&self.topic, partition, offset) else {
                        continue;
                    };
                    letter.handle = format!("{partition}:{offset}:{}", read.generation);
                    letters.push(letter);
                }
            }
        }
        Ok(letters)
    }

    async fn remove(&mut self, letters: &[DeadLetter]) -> std::result::Result<(), OperationError> {
        for (partition, offset, generation) in letters.iter().filter_map(parse_handle) {
            self.tracker
                .finish(&self.topic, partition, generation, offset);
        }
        let commits = self.tracker.take_dirty();
        if commits.is_empty() {
            return Ok(());
        }
        let context = format!("committing replayed dead letters of `{}`", self.topic);
        let consumer = Arc::clone(&self.consumer);
        blocking(move || offset_list(&commits).and_then(|l| consumer.commit(&l, CommitMode::Sync)))
            .await?
            .map_err(|e| Error::kafka(context, e))?;
        Ok(())
    }
}

/// The partition, offset and generation in a handle `next` made.
fn parse_handle(letter: &DeadLetter) -> Option<(i32, i64, u64)> {
    let mut parts = letter.handle.split(':');
    let partition = parts.next()?.parse().ok()?;
    let offset = parts.next()?.parse().ok()?;
    Some((partition, offset, parts.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_blocking_call_that_panicked_is_a_failure_to_retry_not_a_configuration_error() {
        let e = blocking(|| panic!("inside librdkafka")).await.unwrap_err();
        assert_eq!(e.recovery(), inbox_core::Recovery::Retry, "{e}");
        assert!(!e.to_string().contains("configuration"), "{e}");
    }

    #[test]
    fn the_builders_debug_output_hides_secret_properties() {
        let builder = KafkaConnection::new("b:9092")
            .set("sasl.password", "hunter2")
            .dead_letters("payments.dlq");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains(r#""sasl.password": "***""#), "{shown}");
    }
}
