//! The message model every adapter fills in.

use std::fmt;

/// The producer-set identity of a message: what the inbox deduplicates on.
///
/// Any UTF-8 text of 1 to [`MessageId::MAX_LEN`] bytes without a NUL byte is accepted and kept
/// verbatim: `"evt-1"`, `" evt-1"` and `"evt-1 "` are three different IDs. Everything else is
/// refused with an [`InvalidId`], and the consumer dead-letters such a message instead of guessing.
/// NUL is refused because PostgreSQL `text` cannot hold it; the length bound keeps one ID well
/// inside a B-tree index entry.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(String);

impl MessageId {
    /// The longest accepted ID, in bytes.
    pub const MAX_LEN: usize = 1024;

    /// Checks and wraps a text ID.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidId> {
        let id = id.into();
        if id.is_empty() {
            return Err(InvalidId::Empty);
        }
        if id.len() > Self::MAX_LEN {
            return Err(InvalidId::TooLong { len: id.len() });
        }
        if id.contains('\0') {
            return Err(InvalidId::ContainsNul);
        }
        Ok(Self(id))
    }

    /// Checks and wraps an ID read as raw bytes (a header value, say).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, InvalidId> {
        let text = std::str::from_utf8(bytes).map_err(|_| InvalidId::NotUtf8)?;
        Self::new(text)
    }

    /// A fresh UUIDv7: time-ordered, so an inbox index on it grows at its right edge only.
    pub fn generate() -> Self {
        Self(uuid::Uuid::now_v7().to_string())
    }

    /// The ID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The ID as the logs and spans show it: escaped, so a newline or a control character in
    /// an ID cannot forge a log line.
    pub(crate) fn escaped(&self) -> std::str::EscapeDebug<'_> {
        self.0.escape_debug()
    }

    /// The idempotency key for a call `consumer` makes to a downstream provider because of this
    /// message (an `Idempotency-Key` header): `<consumer>:<id>`. It is the same on every
    /// redelivery and every retry, so the provider's deduplication catches a second call for a
    /// message whose first call landed; and it differs per consumer, so two consumers of one
    /// message (a mailer and a biller) do not swallow each other's calls.
    ///
    /// A key protects only while the provider remembers it, and providers forget sooner than
    /// brokers redeliver: Stripe may drop a key once it is 24 hours old, while SQS can hand a
    /// message out for up to 14 days, a Kafka topic keeps 7 by default, and a dead-letter replay
    /// reaches further still. [`Consumer::effects`](crate::Consumer::effects) covers the
    /// late copies with its done rows (keep them as long as the inbox rows); what the key alone
    /// cannot cover is a call whose outcome stayed unknown for longer than the provider keeps
    /// keys: [`Effect::since_first`](crate::effect::Effect::since_first) tells a handler how old
    /// its message's first attempt is.
    ///
    /// Providers bound the key's length (Stripe: 255 characters); a UUID ID plus a short
    /// consumer name stays far below.
    pub fn idempotency_key(&self, consumer: &str) -> String {
        format!("{consumer}:{}", self.0)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl TryFrom<&str> for MessageId {
    type Error = InvalidId;
    fn try_from(value: &str) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

/// Why a message ID was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidId {
    /// The ID is the empty string.
    #[error("the message ID is empty")]
    Empty,
    /// The ID is longer than [`MessageId::MAX_LEN`] bytes.
    #[error(
        "the message ID is {len} bytes long; at most {} are accepted",
        MessageId::MAX_LEN
    )]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The ID bytes are not UTF-8.
    #[error("the message ID is not UTF-8 text")]
    NotUtf8,
    /// The ID contains a NUL byte.
    #[error("the message ID contains a NUL byte")]
    ContainsNul,
    /// The store cannot keep this ID (for example, a uuid column and an ID that is no UUID).
    #[error("{0}")]
    RefusedByStore(String),
}

/// Why a message has no usable ID. The consumer dead-letters such a message with this reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The place the ID should be (a header, attribute or field) is absent.
    #[error("message has no ID: {field} is missing")]
    Missing {
        /// Where the adapter looked, e.g. `header event_id`.
        field: String,
    },
    /// The ID is there but refused.
    #[error("message ID in {field} is invalid: {reason}")]
    Invalid {
        /// Where the adapter looked.
        field: String,
        /// What is wrong with it.
        reason: InvalidId,
    },
}

impl IdError {
    /// Reads an ID from an optional raw value found at `field`.
    pub fn parse(field: &str, raw: Option<&[u8]>) -> Result<MessageId, IdError> {
        match raw {
            None => Err(IdError::Missing {
                field: field.to_owned(),
            }),
            Some(bytes) => MessageId::from_bytes(bytes).map_err(|reason| IdError::Invalid {
                field: field.to_owned(),
                reason,
            }),
        }
    }
}

/// Where a message came from and how often the broker has handed it out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metadata {
    /// The topic, queue or stream.
    pub source: String,
    /// The broker's position of this copy: `partition 3 offset 17`, a stream entry ID, a
    /// delivery tag. For logs; never used for deduplication.
    pub position: String,
    /// How many times the broker has delivered this message, this time included, where the
    /// broker counts (SQS `ApproximateReceiveCount`, Redis pending-entry delivery count,
    /// RabbitMQ quorum `x-delivery-count` + 1).
    pub delivery_count: Option<u32>,
    /// The broker says it delivered this message before.
    pub redelivered: bool,
    /// How many times the consumer has handed this message back under its redelivery schedule
    /// ([`RetryPolicy::redeliver_after`](crate::RetryPolicy::redeliver_after)), as the adapter
    /// carries it (a header, attribute or field on the delayed copy, a record's committed
    /// count);
    /// 0 on a first delivery and on a source without
    /// [`Capabilities::delayed_redelivery`](crate::Capabilities::delayed_redelivery).
    pub redeliveries: u32,
    /// The ordering lane: messages of one lane must be applied in the order received; messages
    /// of different lanes may be applied side by side
    /// ([`Consumer::parallel_lanes`](crate::Consumer::parallel_lanes)). Kafka sets the topic and
    /// partition; `None` is one lane for the whole source.
    pub lane: Option<String>,
    /// The partition the message came from, where the broker partitions its destinations
    /// (Kafka), for the spans' `messaging.destination.partition.id`.
    pub partition: Option<String>,
    /// When the broker says the message was sent or stored, where it says: Kafka's record
    /// timestamp, SQS `SentTimestamp`, the RabbitMQ `timestamp` property (whole seconds) or a
    /// `timestamp_in_ms` header, a Redis stream entry ID. For the end-to-end lag metric.
    pub timestamp: Option<std::time::SystemTime>,
}

/// One message as the consumer sees it. Made with [`Message::new`], its other fields set
/// after.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message {
    /// The producer-set ID, or why there is none.
    pub id: Result<MessageId, IdError>,
    /// The partition or routing key, if the broker has one.
    pub key: Option<Vec<u8>>,
    /// The body.
    pub payload: Vec<u8>,
    /// Headers or attributes, in broker order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Broker metadata.
    pub meta: Metadata,
}

impl Message {
    /// A message with a payload and an ID result, no key, headers or metadata.
    pub fn new(id: Result<MessageId, IdError>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            id,
            key: None,
            payload: payload.into(),
            headers: Vec::new(),
            meta: Metadata::default(),
        }
    }

    /// The first header named `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Parses the payload as JSON. A payload that does not parse is a permanent error: retrying
    /// cannot fix it, so the consumer dead-letters it with this message.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, crate::HandlerError> {
        serde_json::from_slice(&self.payload).map_err(|e| {
            crate::HandlerError::permanent(format!(
                "payload is not valid JSON for {}: {e}",
                std::any::type_name::<T>()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_kept_verbatim_and_bad_ones_refused() {
        assert_eq!(MessageId::new(" evt 1 ").unwrap().as_str(), " evt 1 ");
        assert_ne!(MessageId::new("a").unwrap(), MessageId::new("a ").unwrap());
        assert_eq!(MessageId::new("ünï✓").unwrap().as_str(), "ünï✓");
        assert_eq!(MessageId::new(""), Err(InvalidId::Empty));
        assert_eq!(MessageId::new("a\0b"), Err(InvalidId::ContainsNul));
        assert_eq!(
            MessageId::new("x".repeat(1025)),
            Err(InvalidId::TooLong { len: 1025 })
        );
        assert!(MessageId::new("x".repeat(1024)).is_ok());
        assert_eq!(
            MessageId::from_bytes(&[0xff, 0xfe]),
            Err(InvalidId::NotUtf8)
        );
    }

    #[test]
    fn idempotency_keys_are_stable_per_consumer() {
        let id = MessageId::new("evt-1").unwrap();
        let again = MessageId::new("evt-1").unwrap();
        assert_eq!(id.idempotency_key("mailer"), "mailer:evt-1");
        assert_eq!(
            id.idempotency_key("mailer"),
            again.idempotency_key("mailer")
        );
        assert_ne!(id.idempotency_key("mailer"), id.idempotency_key("biller"));
    }

    #[test]
    fn generated_ids_are_time_ordered_uuids() {
        let a = MessageId::generate();
        let b = MessageId::generate();
        assert!(a < b, "{a} should sort before {b}");
        assert_eq!(
            uuid::Uuid::parse_str(a.as_str()).unwrap().get_version_num(),
            7
        );
    }

    #[test]
    fn missing_and_invalid_ids_say_where() {
        let missing = IdError::parse("header event_id", None).unwrap_err();
        assert_eq!(
            missing.to_string(),
            "message has no ID: header event_id is missing"
        );
        let empty = IdError::parse("header event_id", Some(b"")).unwrap_err();
        assert_eq!(
            empty.to_string(),
            "message ID in header event_id is invalid: the message ID is empty"
        );
    }
}
