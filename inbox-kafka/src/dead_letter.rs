//! Dead letters: producing them ([`DeadLetterProducer`], shared by every ack of a source), and the
//! start-up check that every dead-letter topic exists. Without the check the first record that
//! must be parked fails to produce, is handed back, fails again, and its partition stalls behind
//! it while the consumer looks healthy.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use inbox_core::{dead_letter, Message, Recovery, SourceError};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientConfig;
use tracing::{debug, info};

use crate::context::ProducerContext;
use crate::failure::Failures;
use crate::producer::record_headers;
use crate::{Error, KafkaAdmin, KafkaSourceBuilder};

/// What a [`KafkaAck`](crate::KafkaAck) needs to park its record: the source's dead-letter
/// producer and topic, shared by all its acks.
pub(crate) struct DeadLetterProducer {
    pub(crate) producer: FutureProducer<ProducerContext>,
    /// `None`: `<original topic>.dlq`.
    pub(crate) topic: Option<String>,
    pub(crate) timeout: Duration,
    /// The connection failures of the producer (and of the source's consumer).
    pub(crate) failures: Failures,
}

impl DeadLetterProducer {
    /// Produces `message` to its dead-letter topic with its key, payload and headers plus the
    /// [`inbox_core::dead_letter`] headers, and waits for the delivery report.
    pub(crate) async fn publish(&self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let topic = match &self.topic {
            Some(topic) => topic.clone(),
            None => format!("{}.dlq", message.meta.source),
        };
        let added = [
            (dead_letter::REASON, reason),
            (dead_letter::ORIGINAL_SOURCE, &message.meta.source),
            (dead_letter::ORIGINAL_POSITION, &message.meta.position),
        ];
        let own = message
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()));
        let headers = record_headers(own.chain(added.map(|(k, v)| (k, v.as_bytes()))));
        let mut record = FutureRecord::<[u8], [u8]>::to(&topic)
            .payload(&message.payload)
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key);
        }
        // Waits for the delivery report: the ack follows only once the copy is stored.
        match self.producer.send(record, self.timeout).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(
                Error::kafka(format!("producing the dead letter to `{topic}`"), e).into_source(),
            ),
        }
    }
}

/// The dead-letter topics a source can write to, and what to do when one is missing.
pub(crate) struct DeadLetterCheck {
    /// Each dead-letter topic with the subscribed topics whose records go there.
    topics: BTreeMap<String, Vec<String>>,
    create: bool,
    /// For an admin client that creates missing topics: the source's client settings (TLS,
    /// SASL, the brokers) and context (its token provider).
    admin: (ClientConfig, ProducerContext),
}

impl DeadLetterCheck {
    pub(crate) fn new(
        config: &KafkaSourceBuilder,
        admin: ClientConfig,
        context: ProducerContext,
    ) -> Self {
        let mut topics: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for topic in &config.topics {
            let dead_letter_topic = match &config.dead_letter_topic {
                Some(dlq) => dlq.clone(),
                // A pattern subscription's topics are only known at run time.
                None if topic.starts_with('^') => {
                    debug!(pattern = %topic, "the dead-letter topics of a pattern subscription are not checked at start");
                    continue;
                }
                None => format!("{topic}.dlq"),
            };
            topics
                .entry(dead_letter_topic)
                .or_default()
                .push(topic.clone());
        }
        Self {
            topics,
            create: config.create_dead_letter_topics,
            admin: (admin, context),
        }
    }

    /// Finds the missing dead-letter topics with a metadata request for all topics (one that
    /// names a topic makes a broker with `auto.create.topics.enable` create it, and the check
    /// would pass by accident), then fails naming them, or creates them when allowed.
    pub(crate) async fn run(&self, producer: &DeadLetterProducer) -> Result<(), SourceError> {
        if self.topics.is_empty() {
            return Ok(());
        }
        let existing = self.existing_topics(producer).await?;
        let missing: Vec<(&String, &Vec<String>)> = self
            .topics
            .iter()
            .filter(|(topic, _)| !existing.contains(*topic))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if !self.create {
            let list = missing
                .iter()
                .map(|(dlq, from)| format!("`{dlq}` (for records of {})", quoted(from)))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Error::Config(format!(
                "dead-letter topic {list} does not exist, so a record that cannot be applied \
                 could not be parked and would stall its partition: create it, point \
                 KafkaSourceBuilder::dead_letter_topic at an existing topic, or let the source \
                 create it with KafkaSourceBuilder::create_dead_letter_topics(true)"
            ))
            .into_source());
        }
        let (admin_config, context) = &self.admin;
        let admin = KafkaAdmin::with_config(admin_config, context.clone())?;
        for (topic, from) in missing {
            admin.create_topic(topic, 1).await?;
            info!(%topic, for_topics = ?from, "created the missing dead-letter topic");
        }
        Ok(())
    }

    async fn existing_topics(
        &self,
        dead_letters: &DeadLetterProducer,
    ) -> Result<BTreeSet<String>, SourceError> {
        let (producer, timeout) = (dead_letters.producer.clone(), dead_letters.timeout);
        let failures = &dead_letters.failures;
        let brokers = self.admin.0.get("bootstrap.servers").unwrap_or_default();
        // A blocking request: off the async workers. A TLS handshake or a login the brokers
        // refuse fails the check at once, saying why, rather than at the timeout.
        let fetch =
            tokio::task::spawn_blocking(move || producer.client().fetch_metadata(None, timeout));
        let metadata = tokio::select! {
            refused = failures.refused() => return Err(refused.into_source()),
            fetched = fetch => fetched,
        };
        let metadata = metadata
            .map_err(|join| {
                SourceError::new(Recovery::Retry, "dead-letter topic check failed", join)
            })?
            .map_err(|e| {
                let last = failures
                    .take_reason()
                    .map(|reason| format!("; the last connection failure: {reason}"))
                    .unwrap_or_default();
                let context = format!(
                    "listing the topics of the brokers {brokers} (KAFKA_BROKERS or \
                     KafkaConnection::new) to check the dead-letter topics{last}"
                );
                Error::kafka(context, e).into_source()
            })?;
        // A listed topic exists even if it reports an error (a leader being elected), unless
        // the error says it does not.
        Ok(metadata
            .topics()
            .iter()
            .filter(|t| t.error() != Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART))
            .map(|t| t.name().to_owned())
            .collect())
    }
}

fn quoted(topics: &[String]) -> String {
    topics
        .iter()
        .map(|t| format!("`{t}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_subscribed_topic_has_its_dead_letter_topic_and_patterns_are_skipped() {
        let config = crate::KafkaConnection::new("b:9092").source(["a", "b", "^c.*"], "g");
        let check = |config: &KafkaSourceBuilder| {
            DeadLetterCheck::new(config, ClientConfig::new(), ProducerContext::default())
        };
        let topics: Vec<String> = check(&config).topics.into_keys().collect();
        assert_eq!(topics, ["a.dlq", "b.dlq"]);
        let shared = check(&config.dead_letter_topic("parked"));
        assert_eq!(shared.topics["parked"], ["a", "b", "^c.*"]);
    }
}
