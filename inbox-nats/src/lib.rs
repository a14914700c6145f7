//! Effectively-once NATS JetStream consumers on the transactional inbox: a durable pull consumer
//! as the [`MessageSource`](inbox_core::MessageSource), a producer through
//! [`Publish`](inbox_core::Publish), and a dead-letter subject read back by [`NatsDeadLetters`].
//!
//! ```no_run
//! use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId, Publish};
//! use inbox_nats::NatsConnection;
//! use inbox_postgres::{PgInbox, PgTx};
//!
//! struct Credit;
//!
//! impl Handler<PgTx> for Credit {
//!     async fn handle(&self, tx: &mut PgTx, _id: &MessageId, m: &Message) -> Result<(), HandlerError> {
//!         let (account, amount): (i64, i64) = m.json()?;
//!         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!             .bind(amount)
//!             .bind(account)
//!             .execute(&mut **tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! // The stream CREDITS stores `credits` and `credits.dlq`; the source's consumer reads only
//! // `credits`, and parks what cannot be applied on `credits.dlq`.
//! let nats = NatsConnection::from_env(); // NATS_URL; or NatsConnection::new(url), TLS, a login
//! let producer = nats.producer().connect().await?;
//! let id = producer.send("credits", br#"[1, 100]"#).await?;
//! producer.send_with_id("credits", &id, br#"[1, 100]"#).await?; // a resend: skipped
//!
//! let source = nats
//!     .source("CREDITS", "wallet") // stream, durable consumer (created if missing)
//!     .filter_subject("credits")
//!     .dead_letter_subject("credits.dlq")
//!     .connect()
//!     .await?;
//! let inbox = PgInbox::new(sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?);
//! Consumer::new("wallet-credits", source, inbox, Credit).run().await?;
//! # Ok(()) }
//! ```
//!
//! # Connection
//!
//! One [`NatsConnection`] says where the servers are (`NATS_URL`, or [`NatsConnection::new`];
//! there is no local default) and how to reach them: TLS (`tls://`, a private CA with
//! [`root_certificates`](NatsConnection::root_certificates), a client certificate), a login (a
//! user and password, a token, an NKey seed, a creds file), the operation timeout and the ping
//! interval. The source, the producer and the dead-letter reader are built from it. Each opens
//! its own client, which reconnects by itself for as long as it lives; an operation that fails
//! meanwhile returns a [`Recovery::Retry`](inbox_core::Recovery) error and the consumer tries
//! again after a backoff.
//!
//! # Ack semantics
//!
//! - **Ack** is `+ACK` sent as a request: it returns once the server confirmed it. One that
//!   fails (a connection cut) is sent again for up to the operation timeout; past it, the error
//!   is one the consumer logs and counts (the message comes back and the inbox skips it).
//!   JetStream has no batch ack; a batch's acks go out concurrently.
//! - **A lost connection** fails the receive in flight at once
//!   ([`Recovery::Reconnect`](inbox_core::Recovery)); the client connects again by itself.
//! - **A delivery never acked** (the process died, the connection broke) is handed out again by
//!   the server once the consumer's `ack_wait` (30 s by default) has passed, to any member of
//!   the durable consumer.
//! - **While a handler runs**, the source sends `+WPI` ("in progress") for every delivery it
//!   holds every third of `ack_wait`, so a long handler keeps its message
//!   ([`progress`](NatsSourceBuilder::progress)).
//! - **Nack** is `-NAK` with the delay: the server delivers the message again once it has
//!   passed. A delayed redelivery ([`RetryPolicy::redeliver_after`](inbox_core::RetryPolicy))
//!   is the same `-NAK`; its count ([`Metadata::redeliveries`](inbox_core::Metadata)) is kept
//!   by the source in memory, by stream sequence, so a message that comes back to another
//!   member or after a restart starts the schedule again, unless the source keeps the counts
//!   in a key-value bucket too ([`redelivery_bucket`](NatsSourceBuilder::redelivery_bucket)).
//!   The server's own count, `num_delivered`, is the delivery count and never starts again:
//!   keep [`Consumer::max_deliveries`](inbox_core::Consumer::max_deliveries) as the bound.
//! - **A dead letter** is published to the dead-letter subject (by default `<stream>.dlq`) with
//!   the payload, the headers and `reason`, `original_source` (the subject) and
//!   `original_position` (`sequence N`), confirmed by the stream that stores it, then acked.
//!   JetStream's own headers (`Nats-Msg-Id`, `Nats-Expected-…`, `Nats-Rollup`: any `Nats-`
//!   header) stay behind, on the dead letter and on its replay: the server would act on them
//!   again and drop, refuse or roll up the copy.
//!   When the publish fails the delivery is nacked for
//!   [`RETRY_AFTER`](inbox_core::dead_letter::RETRY_AFTER) and comes back.
//! - **`max_deliver`**: past a consumer's `max_deliver` the server stops delivering a message
//!   and writes no dead letter. The source creates its consumer without one; with one, keep
//!   `Consumer::max_deliveries` below it, so the inbox parks the message with its reason
//!   first.
//!
//! The ID is read from the header `event_id` by default; [`IdFrom`](inbox_core::IdFrom) reads
//! others: any header, `Nats-Msg-Id` ([`IdFrom::MessageIdProperty`](inbox_core::IdFrom)),
//! CloudEvents (binary mode `ce-` headers, or a structured-mode JSON payload), the Debezium `id`
//! header, a JSON field, or the stream and sequence ([`IdFrom::Position`](inbox_core::IdFrom)).
//!
//! A message's headers reach the handler sorted by name (NATS keeps no order between names).
//! NATS has no message key: an [`OutgoingMessage`](inbox_core::OutgoingMessage)'s key is not
//! sent; the subject orders. With [`lanes_by_subject`](NatsSourceBuilder::lanes_by_subject)
//! each subject is a lane.

mod ack;
mod connection;
mod dead_letters;
mod error;
mod producer;
mod source;

pub use ack::NatsAck;
pub use async_nats;
pub use connection::{NatsConnection, NATS_URL};
pub use dead_letters::{NatsDeadLetters, NatsDeadLettersBuilder};
pub use error::{Error, Result};
pub use producer::{NatsProducer, NatsProducerBuilder};
pub use source::{NatsSource, NatsSourceBuilder, BINDING, ID_HEADER, NATS_MSG_ID};

use async_nats::jetstream::{self, context::GetStreamErrorKind, ErrorCode};
use inbox_core::Recovery;

/// The stream `name`, or [`Error::StreamMissing`].
async fn get_stream(js: &jetstream::Context, name: &str) -> Result<jetstream::stream::Stream> {
    match js.get_stream(name).await {
        Ok(stream) => Ok(stream),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(inner)
                if inner.error_code() == ErrorCode::STREAM_NOT_FOUND =>
            {
                Err(Error::StreamMissing {
                    stream: name.to_owned(),
                })
            }
            GetStreamErrorKind::EmptyName | GetStreamErrorKind::InvalidStreamName => Err(
                Error::Config(format!("`{name}` is not a JetStream stream name")),
            ),
            _ => Err(Error::nats(
                format!("looking up the stream `{name}`"),
                Recovery::Retry,
                e,
            )),
        },
    }
}

/// The name of the stream that stores `subject`, or [`Error::DeadLetterSubjectMissing`].
async fn stream_storing(js: &jetstream::Context, subject: &str) -> Result<String> {
    use async_nats::jetstream::context::GetStreamByNameErrorKind as Kind;
    js.stream_by_subject(subject)
        .await
        .map_err(|e| match e.kind() {
            Kind::NotFound => Error::DeadLetterSubjectMissing {
                subject: subject.to_owned(),
            },
            Kind::InvalidSubject => Error::Config(format!("`{subject}` is not a NATS subject")),
            _ => Error::nats(
                format!("looking for the stream that stores `{subject}`"),
                Recovery::Retry,
                e,
            ),
        })
}

/// The key-value bucket `name`, created (one value per key, kept 7 days) where missing.
async fn redelivery_bucket(js: &jetstream::Context, name: &str) -> Result<jetstream::kv::Store> {
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    // The bucket's stream as a key-value bucket is made (`KV_<name>`, one value per key):
    // async-nats's `create_key_value` cannot read a 2.9 server's answer.
    let config = jetstream::stream::Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        max_age: std::time::Duration::from_secs(7 * 24 * 3600),
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    let failed = |e: inbox_core::BoxError| {
        Error::nats(
            format!("creating the redelivery bucket `{name}`"),
            Recovery::Retry,
            e,
        )
    };
    js.get_or_create_stream(config)
        .await
        .map_err(|e| failed(Box::new(e)))?;
    js.get_key_value(name)
        .await
        .map_err(|e| failed(Box::new(e)))
}

/// `name` as one token of a key in a key-value bucket: each byte a key cannot hold (anything
/// but letters, digits, `-`, `_` and `/`) written `=` and two hex digits, `=` itself too. A
/// stream or consumer name may hold `:` or `@`, which a key may not.
fn key_token(name: &str) -> String {
    use std::fmt::Write as _;
    let mut token = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'/') {
            token.push(char::from(byte));
        } else {
            let _ = write!(token, "={byte:02X}");
        }
    }
    token
}

/// Whether `subject` matches the subject filter `filter` (`*` one token, `>` the rest).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for part in filter.split('.') {
        match (part, tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (part, Some(token)) if part == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::{key_token, subject_matches};

    #[test]
    fn names_become_key_tokens_unchanged_where_a_key_can_hold_them() {
        assert_eq!(key_token("CREDITS_v-2/x"), "CREDITS_v-2/x");
        assert_eq!(key_token("orders:v2"), "orders=3Av2");
        assert_eq!(key_token("a=b"), "a=3Db");
        assert_eq!(key_token("é"), "=C3=A9");
    }

    #[test]
    fn subject_filters_match_as_nats_does() {
        assert!(subject_matches("credits", "credits"));
        assert!(!subject_matches("credits", "credits.dlq"));
        assert!(subject_matches("credits.>", "credits.dlq"));
        assert!(subject_matches("credits.*", "credits.dlq"));
        assert!(!subject_matches("credits.*", "credits.dlq.x"));
        assert!(!subject_matches("credits.>", "credits"));
        assert!(subject_matches(">", "credits"));
    }
}
