//! Topic administration the inbox needs: creating topics (tests, setup) and reading retention.

use std::fmt;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::ClientConfig;

use crate::context::ProducerContext;
use crate::{Error, Result};

/// A small admin client; made by [`KafkaConnection::admin`](crate::KafkaConnection::admin).
pub struct KafkaAdmin {
    client: AdminClient<ProducerContext>,
    options: AdminOptions,
}

impl fmt::Debug for KafkaAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaAdmin").finish_non_exhaustive()
    }
}

impl KafkaAdmin {
    /// An admin client made like a source's other clients: its configuration, and its context
    /// (the token provider, where connection failures are kept).
    pub(crate) fn with_config(config: &ClientConfig, context: ProducerContext) -> Result<Self> {
        let client = config
            .create_with_context(context)
            .map_err(|e| Error::kafka("creating the Kafka admin client", e))?;
        let timeout = Some(Duration::from_secs(30));
        Ok(Self {
            client,
            options: AdminOptions::new()
                .request_timeout(timeout)
                .operation_timeout(timeout),
        })
    }

    /// Creates `topic` with `partitions` partitions (replication factor: the broker's default).
    /// A topic that already exists is fine.
    pub async fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        self.create_topic_with(topic, partitions, &[]).await
    }

    /// Creates `topic` with `partitions` partitions and topic properties (`retention.ms`,
    /// `cleanup.policy`, ...). A topic that already exists is fine (its properties are left).
    pub async fn create_topic_with(
        &self,
        topic: &str,
        partitions: i32,
        properties: &[(&str, &str)],
    ) -> Result<()> {
        let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(-1));
        for (key, value) in properties {
            new = new.set(key, value);
        }
        let results = self
            .client
            .create_topics([&new], &self.options)
            .await
            .map_err(|e| Error::kafka(format!("creating topic `{topic}`"), e))?;
        for (name, code) in results.into_iter().filter_map(Result::err) {
            if code != RDKafkaErrorCode::TopicAlreadyExists {
                let e = KafkaError::AdminOp(code);
                return Err(Error::kafka(format!("creating topic `{name}`"), e));
            }
        }
        Ok(())
    }

    /// How long the broker keeps a record of `topic` readable, from its `cleanup.policy`,
    /// `retention.ms` and `segment.ms` (see [`Retention`]). An inbox that forgets IDs sooner
    /// can apply an old replayed record twice, so keep inbox rows at least this long.
    pub async fn retention(&self, topic: &str) -> Result<Retention> {
        let context = || format!("reading the retention settings of topic `{topic}`");
        let results = self
            .client
            .describe_configs([&ResourceSpecifier::Topic(topic)], &self.options)
            .await
            .map_err(|e| Error::kafka(context(), e))?;
        let resource = results
            .into_iter()
            .next()
            .ok_or_else(|| Error::Config(format!("{}: the broker returned nothing", context())))?
            .map_err(|code| Error::kafka(context(), KafkaError::AdminOp(code)))?;
        let value = |name: &str| resource.get(name).and_then(|entry| entry.value.clone());
        Retention::from_settings(
            topic,
            value("cleanup.policy").as_deref(),
            value("retention.ms").as_deref(),
            value("segment.ms").as_deref(),
        )
    }
}

/// Kafka's `segment.ms` (`log.roll.ms`) when the broker does not report it: 7 days.
const DEFAULT_SEGMENT: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// How long a topic keeps a record readable, and so how late the broker can hand it out again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retention {
    /// A record can still be read up to this long after it was written: `retention.ms` plus
    /// `segment.ms`. The broker deletes a whole segment only once its newest record is older
    /// than `retention.ms`, and a segment takes records for up to `segment.ms` before it rolls,
    /// so its first record outlives `retention.ms` by that much. `segment.ms` counts as Kafka's
    /// default, 7 days, where the broker does not report it.
    Limited(Duration),
    /// `retention.ms=-1`: records are kept forever.
    Unlimited,
    /// `cleanup.policy=compact` without `delete`: the last record of every key is kept
    /// forever, so a replay can hand out a key's last record however old it is.
    Compacted,
    /// The broker does not report `retention.ms` for the topic (some Kafka-compatible brokers
    /// report only the properties set on the topic).
    NotReported,
}

impl Retention {
    /// The retention of `topic` with these settings, each as the broker reports it (`None`
    /// when it does not). An error names the setting that is not a number.
    fn from_settings(
        topic: &str,
        cleanup_policy: Option<&str>,
        retention_ms: Option<&str>,
        segment_ms: Option<&str>,
    ) -> Result<Self> {
        // Kafka's default policy is `delete`; `compact,delete` compacts and deletes by time.
        let policies: Vec<&str> = cleanup_policy
            .unwrap_or("delete")
            .split(',')
            .map(str::trim)
            .collect();
        if policies.contains(&"compact") && !policies.contains(&"delete") {
            return Ok(Retention::Compacted);
        }
        let Some(retention_ms) = retention_ms else {
            return Ok(Retention::NotReported);
        };
        let Ok(retention) = u64::try_from(millis(topic, "retention.ms", retention_ms)?) else {
            return Ok(Retention::Unlimited);
        };
        let segment = match segment_ms {
            Some(ms) => u64::try_from(millis(topic, "segment.ms", ms)?)
                .map(Duration::from_millis)
                .map_err(|_| {
                    Error::Config(format!(
                        "topic `{topic}` reports a negative segment.ms `{ms}`"
                    ))
                })?,
            None => DEFAULT_SEGMENT,
        };
        Ok(Retention::Limited(
            Duration::from_millis(retention).saturating_add(segment),
        ))
    }
}

/// A setting of `topic` in milliseconds, as the broker reports it.
fn millis(topic: &str, name: &str, value: &str) -> Result<i64> {
    value.trim().parse().map_err(|_| {
        Error::Config(format!(
            "topic `{topic}` reports {name} `{value}`, which is not a number of milliseconds"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_from_the_topic_settings() {
        let limited = |ms| Retention::Limited(Duration::from_millis(ms));
        let week = DEFAULT_SEGMENT.as_secs() * 1000;
        // cleanup.policy, retention.ms and segment.ms as reported ("": not reported), and the
        // retention.
        let cases = [
            // A record is readable for retention plus segment time.
            ("delete", "3600000", "600000", limited(4_200_000)),
            // Kafka's default policy and segment time where the broker reports neither.
            ("", "3600000", "", limited(3_600_000 + week)),
            // A compacted topic keeps records for ever unless it also deletes.
            ("compact", "3600000", "600000", Retention::Compacted),
            (" compact ", "3600000", "600000", Retention::Compacted),
            ("compact", "", "", Retention::Compacted),
            ("compact,delete", "3600000", "600000", limited(4_200_000)),
            ("delete", "-1", "600000", Retention::Unlimited),
            ("delete", "", "600000", Retention::NotReported),
        ];
        let reported = |value: &'static str| (!value.is_empty()).then_some(value);
        for (policy, retention, segment, expected) in cases {
            let (p, r, s) = (reported(policy), reported(retention), reported(segment));
            let found = Retention::from_settings("t", p, r, s).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(found, expected, "{policy:?} {retention:?} {segment:?}");
        }
    }

    #[test]
    fn a_setting_that_is_not_a_number_is_named() {
        let e = Retention::from_settings("t", None, Some("3600000"), Some("soon")).unwrap_err();
        assert!(e.to_string().contains("segment.ms `soon`"), "{e}");
        let e = Retention::from_settings("t", None, Some("1h"), None).unwrap_err();
        assert!(e.to_string().contains("retention.ms `1h`"), "{e}");
    }
}
