//! The dead-letter queue read back for [`inbox_core::replay`]: received and held invisible while
//! the replay runs, deleted once replayed, made visible again at the end otherwise.

use std::collections::HashSet;
use std::time::Duration;

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, Message as SqsMessage, MessageSystemAttributeName,
};
use aws_sdk_sqs::Client;
use inbox_core::replay::{DeadLetter, DeadLetters};
use inbox_core::{MessageId, OperationError};

use super::check_id_attribute;
use crate::ack::delete_message_batch;
use crate::copy::attribute_bytes;
use crate::delivery::{replay_header, DEDUPLICATION_ID_HEADER, SCHEDULE_ATTRIBUTES};
use crate::source::{sent_at, system_attribute};
use crate::{Error, Result, SqsConnection, DEFAULT_ID_ATTRIBUTE};

/// SQS hands out at most this many messages per receive, and takes as many per batch call.
const SQS_BATCH: usize = 10;

/// The messages of an SQS dead-letter queue, as [`inbox_core::replay`] reads them: each message
/// keeps its body, attributes and ID attribute (`event_id`) and carries the
/// [`inbox_core::dead_letter`] attributes; its position is its SQS message ID, its time the
/// `SentTimestamp` (when it was parked) and its key the FIFO `MessageGroupId`.
///
/// Reading receives every message (long polls of 1 s until one returns nothing) and keeps it
/// invisible for [`visibility`](SqsDeadLettersBuilder::visibility) (default 5 minutes; raise it
/// for a queue that takes longer to go through). A replayed message is deleted; the others are
/// made visible again when the reading ends (or when the visibility runs out, after a crash).
/// A message seen twice in one reading (its visibility ran out) is passed over the second time.
pub struct SqsDeadLetters {
    client: Client,
    queue_url: String,
    id_attribute: String,
    visibility: Duration,
    /// Receipt handles read and neither deleted nor released.
    held: Vec<String>,
    seen: HashSet<String>,
    drained: bool,
}

impl std::fmt::Debug for SqsDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsDeadLetters")
            .field("queue_url", &self.queue_url)
            .field("id_attribute", &self.id_attribute)
            .field("visibility", &self.visibility)
            .field("held", &self.held.len())
            .finish_non_exhaustive()
    }
}

/// Builds an [`SqsDeadLetters`]; start with [`SqsConnection::dead_letters`] (or
/// [`SqsDeadLetters::builder`], through the environment's SQS).
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is awaited"]
pub struct SqsDeadLettersBuilder {
    connection: SqsConnection,
    queue_url: String,
    id_attribute: String,
    visibility: Duration,
}

impl SqsDeadLetters {
    /// Reads the dead-letter queue at `queue_url`, through the environment's SQS
    /// ([`SqsConnection::from_env`]).
    pub fn builder(queue_url: impl Into<String>) -> SqsDeadLettersBuilder {
        SqsConnection::from_env().dead_letters(queue_url)
    }
}

impl SqsDeadLettersBuilder {
    pub(crate) fn new(connection: SqsConnection, queue_url: String) -> Self {
        Self {
            connection,
            queue_url,
            id_attribute: DEFAULT_ID_ATTRIBUTE.to_owned(),
            visibility: Duration::from_secs(300),
        }
    }

    /// The message attribute holding the ID (default `event_id`).
    pub fn id_attribute(mut self, name: impl Into<String>) -> Self {
        self.id_attribute = name.into();
        self
    }

    /// How long a message read stays invisible to others (default 5 minutes, at most 12 h).
    pub fn visibility(mut self, visibility: Duration) -> Self {
        self.visibility = visibility;
        self
    }

    /// Builds the client unless the connection has one; makes no SQS call.
    pub async fn connect(self) -> Result<SqsDeadLetters> {
        if self.queue_url.is_empty() {
            return Err(Error::Config("the dead-letter queue URL is empty".into()));
        }
        check_id_attribute(&self.id_attribute, "SqsDeadLettersBuilder::id_attribute")?;
        Ok(SqsDeadLetters {
            client: self.connection.client().await,
            queue_url: self.queue_url,
            id_attribute: self.id_attribute,
            visibility: self.visibility,
            held: Vec::new(),
            seen: HashSet::new(),
            drained: false,
        })
    }
}

impl SqsDeadLetters {
    fn letter(&self, sqs: &SqsMessage) -> DeadLetter {
        let position = sqs.message_id().unwrap_or("?").to_owned();
        let mut letter = DeadLetter::new(position, sqs.body().unwrap_or_default().into());
        letter.handle = sqs.receipt_handle().unwrap_or_default().to_owned();
        let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
        for (name, value) in sqs.message_attributes().into_iter().flatten() {
            let bytes = attribute_bytes(value);
            if *name == self.id_attribute {
                letter.id = MessageId::from_bytes(&bytes).ok();
            } else if !SCHEDULE_ATTRIBUTES.contains(&name.as_str())
                && name != DEDUPLICATION_ID_HEADER
            {
                // A replay starts the redelivery schedule anew.
                headers.push((name.clone(), bytes));
            }
        }
        // Deduplicated on a FIFO source by this letter alone: never taken for a copy of the
        // first send, nor of an earlier letter of the same message.
        headers.push(replay_header(&letter.position));
        headers.sort();
        letter.take_metadata(headers);
        letter.key = system_attribute(sqs, MessageSystemAttributeName::MessageGroupId).cloned();
        letter.timestamp = sent_at(sqs);
        letter
    }

    /// Makes the held messages visible again, ten per call.
    async fn release(&mut self) -> Result<()> {
        for chunk in self.held.chunks(SQS_BATCH) {
            let entries = chunk.iter().enumerate().filter_map(|(i, handle)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(handle)
                    .visibility_timeout(0)
                    .build()
                    .ok()
            });
            self.client
                .change_message_visibility_batch()
                .queue_url(&self.queue_url)
                .set_entries(Some(entries.collect()))
                .send()
                .await
                .map_err(|e| Error::sdk("ChangeMessageVisibilityBatch", &self.queue_url, e))?;
        }
        self.held.clear();
        Ok(())
    }
}

impl DeadLetters for SqsDeadLetters {
    fn name(&self) -> &str {
        &self.queue_url
    }

    async fn next(&mut self, max: usize) -> std::result::Result<Vec<DeadLetter>, OperationError> {
        let mut letters = Vec::new();
        while !self.drained && letters.len() < max {
            let wanted = (max - letters.len()).min(SQS_BATCH);
            let out = self
                .client
                .receive_message()
                .queue_url(&self.queue_url)
                .max_number_of_messages(i32::try_from(wanted).unwrap_or(1))
                .wait_time_seconds(1)
                .visibility_timeout(i32::try_from(self.visibility.as_secs()).unwrap_or(i32::MAX))
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .map_err(|e| Error::sdk("ReceiveMessage (dead letters)", &self.queue_url, e))?;
            let messages = out.messages();
            if messages.is_empty() {
                self.drained = true;
            }
            for sqs in messages {
                let letter = self.letter(sqs);
                self.held.push(letter.handle.clone());
                if self.seen.insert(letter.position.clone()) {
                    letters.push(letter);
                }
            }
        }
        Ok(letters)
    }

    async fn remove(&mut self, letters: &[DeadLetter]) -> std::result::Result<(), OperationError> {
        for chunk in letters.chunks(SQS_BATCH) {
            let handles = chunk.iter().map(|letter| letter.handle.as_str());
            let operation = "DeleteMessageBatch (dead letters)";
            let failed =
                delete_message_batch(&self.client, &self.queue_url, handles, operation).await?;
            if let Some(failed) = failed.first() {
                return Err(Error::Config(format!(
                    "SQS did not delete replayed dead letter {} from {}: {} ({}); it stays, \
                     and a later replay publishes it again under the same ID",
                    chunk
                        .get(failed.id().parse::<usize>().unwrap_or(0))
                        .map_or("?", |l| l.position.as_str()),
                    self.queue_url,
                    failed.message().unwrap_or("no message"),
                    failed.code(),
                ))
                .into());
            }
            let removed: HashSet<&str> = chunk.iter().map(|l| l.handle.as_str()).collect();
            self.held.retain(|h| !removed.contains(h.as_str()));
        }
        Ok(())
    }

    async fn close(&mut self) -> std::result::Result<(), OperationError> {
        Ok(self.release().await?)
    }
}

#[cfg(test)]
mod tests {
    use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
    use inbox_core::OutgoingMessage;

    use super::*;
    use crate::producer::Queue;
    use crate::SqsProducer;

    /// A dead letter as the FIFO dead-letter queue hands it out: SQS message `dlq_message_id`.
    fn parked(dlq_message_id: &str, id: &MessageId) -> SqsMessage {
        let text = |value: &str| crate::copy::attribute("", value).unwrap();
        SqsMessage::builder()
            .message_id(dlq_message_id)
            .receipt_handle(format!("handle-of-{dlq_message_id}"))
            .body("{\"amount\":100}")
            .message_attributes("event_id", text(id.as_str()))
            .message_attributes(REASON, text("downstream down"))
            .message_attributes(ORIGINAL_SOURCE, text("http://localhost/0/payments.fifo"))
            .message_attributes(ORIGINAL_POSITION, text("message m-1"))
            .attributes(MessageSystemAttributeName::MessageGroupId, "account-1")
            .build()
    }

    /// The `MessageDeduplicationId` the producer sends for what `replay` publishes from the
    /// letter (`DeadLetter`'s own outgoing message: ID, payload, key, headers).
    fn replayed_dedup_id(
        reader: &SqsDeadLetters,
        producer: &SqsProducer,
        sqs: &SqsMessage,
    ) -> String {
        let letter = reader.letter(sqs);
        let mut message = OutgoingMessage::new(letter.id.clone().unwrap(), letter.payload.clone());
        message.key = letter.key.clone();
        message.headers = letter.headers.clone();
        dedup_id_sent(producer, &message)
    }

    fn dedup_id_sent(producer: &SqsProducer, message: &OutgoingMessage) -> String {
        let queue = Queue {
            url: "http://localhost/0/payments.fifo".into(),
            fifo: true,
        };
        let entry = producer.entry(0, &queue, message).unwrap();
        entry.message_deduplication_id().unwrap().to_owned()
    }

    /// SQS FIFO drops a send whose deduplication ID it saw in the last 5 minutes (moto only
    /// while the first copy is still queued, so this is pinned here): a replay must never
    /// carry the first send's ID, nor the ID of an earlier replay of the same message.
    #[tokio::test]
    async fn a_replay_into_a_fifo_queue_is_never_taken_for_a_copy_of_an_earlier_send() {
        let sqs = SqsConnection::new(crate::connection::offline_client());
        let reader = sqs.dead_letters("http://localhost/0/payments-dlq.fifo");
        let reader = reader.connect().await.unwrap();
        let producer = sqs.producer().connect().await.unwrap();
        let id = MessageId::generate();

        let first = dedup_id_sent(
            &producer,
            &OutgoingMessage::new(id.clone(), "{}").key("account-1"),
        );
        assert_eq!(
            first,
            id.as_str(),
            "a first send still deduplicates on the event ID"
        );

        let replay = replayed_dedup_id(&reader, &producer, &parked("dlq-1", &id));
        assert_ne!(
            replay, first,
            "the replay would be dropped as a copy of the first send"
        );
        // The replayed copy failed again, was parked again (a new dead letter), and is
        // replayed again within the 5 minutes.
        let again = replayed_dedup_id(&reader, &producer, &parked("dlq-2", &id));
        assert_ne!(again, first);
        assert_ne!(
            again, replay,
            "the second replay would be dropped as a copy of the first"
        );
        // The same dead letter replayed twice (a crash before its removal) is one message.
        assert_eq!(
            replayed_dedup_id(&reader, &producer, &parked("dlq-1", &id)),
            replay
        );
        assert!(crate::fifo::is_valid_id(&replay) && crate::fifo::is_valid_id(&again));
    }

    /// The reader finds dead letters' IDs in its ID attribute: with none named, every letter
    /// would replay without its ID. The producer and the source refuse it too.
    #[tokio::test]
    async fn an_empty_id_attribute_is_refused() {
        let sqs = SqsConnection::new(crate::connection::offline_client());
        let reader = sqs
            .dead_letters("http://localhost/0/payments-dlq")
            .id_attribute("");
        let Err(Error::Config(e)) = reader.connect().await else {
            panic!("an empty ID attribute was taken");
        };
        assert!(e.contains("ID attribute name is empty"), "{e}");
        assert!(e.contains("SqsDeadLettersBuilder::id_attribute"), "{e}");
    }
}
