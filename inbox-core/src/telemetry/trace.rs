//! W3C trace context (`traceparent`) and the consumer's spans.

use std::fmt;
use std::future::Future;

use tracing::field::{display, Empty};
use tracing::{info_span, Instrument, Span};

use crate::{Message, MessageId, PublishError};

/// The header (Kafka, RabbitMQ), message attribute (SQS) or field (Redis Streams) that carries a
/// message's [`TraceParent`].
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A W3C Trace Context `traceparent` value: the trace and the span a message was produced in.
///
/// [`TraceParent::parse`] accepts what the Trace Context recommendation (level 1) accepts:
/// `00-<32 hex trace ID>-<16 hex parent ID>-<2 hex flags>` in lowercase, neither ID all zeros,
/// and from a later version than `00` the same four fields followed by nothing or by `-…`;
/// version `ff` is invalid. [`Display`](fmt::Display) writes version `00`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

/// Why a `traceparent` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid traceparent: {0}")]
pub struct InvalidTraceParent(&'static str);

impl TraceParent {
    /// A trace parent from its parts; `None` when either ID is all zeros (invalid in W3C).
    pub fn new(trace_id: [u8; 16], parent_id: [u8; 8], flags: u8) -> Option<Self> {
        (trace_id != [0; 16] && parent_id != [0; 8]).then_some(Self {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// Parses a header value (surrounding spaces and tabs allowed).
    pub fn parse(value: &str) -> Result<Self, InvalidTraceParent> {
        let value = value.trim_matches([' ', '\t']);
        let bytes = value.as_bytes();
        if bytes.len() < 55 {
            return Err(InvalidTraceParent("shorter than 55 characters"));
        }
        let mut version = [0u8; 1];
        hex(&bytes[0..2], &mut version)?;
        match version[0] {
            0xff => return Err(InvalidTraceParent("version ff")),
            0 if bytes.len() != 55 => {
                return Err(InvalidTraceParent("version 00 is exactly 55 characters"))
            }
            _ if bytes.len() > 55 && bytes[55] != b'-' => {
                return Err(InvalidTraceParent("no `-` after the flags"))
            }
            _ => {}
        }
        if bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
            return Err(InvalidTraceParent("fields not separated by `-`"));
        }
        let mut trace_id = [0u8; 16];
        hex(&bytes[3..35], &mut trace_id)?;
        let mut parent_id = [0u8; 8];
        hex(&bytes[36..52], &mut parent_id)?;
        let mut flags = [0u8; 1];
        hex(&bytes[53..55], &mut flags)?;
        Self::new(trace_id, parent_id, flags[0]).ok_or(InvalidTraceParent("an all-zero ID"))
    }

    /// The valid `traceparent` header of `message`, if it has one; an invalid one is ignored,
    /// as the recommendation says.
    pub fn from_message(message: &Message) -> Option<Self> {
        let raw = message.header(TRACEPARENT_HEADER)?;
        Self::parse(std::str::from_utf8(raw).ok()?).ok()
    }

    /// The trace parent of the current span: its OpenTelemetry context through
    /// `tracing-opentelemetry`, with the crate feature `opentelemetry`; `None` without the
    /// feature, outside a span, or when no OpenTelemetry layer is installed. The producer
    /// helpers of the adapters put it on every message they send.
    pub fn current() -> Option<Self> {
        #[cfg(feature = "opentelemetry")]
        {
            otel::current()
        }
        #[cfg(not(feature = "opentelemetry"))]
        {
            None
        }
    }

    /// The trace ID.
    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The ID of the span the message was produced in.
    pub fn parent_id(&self) -> [u8; 8] {
        self.parent_id
    }

    /// The trace flags.
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The `sampled` flag.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.parent_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceParent({self})")
    }
}

/// Lowercase hex only: the recommendation refuses uppercase.
fn hex(text: &[u8], out: &mut [u8]) -> Result<(), InvalidTraceParent> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(InvalidTraceParent("not lowercase hex")),
    };
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Ok(())
}

/// The span of one store transaction over `messages` (`messaging.operation.type = process`):
/// with one message, its ID and `traceparent`, which (with the `opentelemetry` feature) becomes
/// the span's parent; with several, their count, and (same feature) a link to each one's
/// producer span.
pub(crate) fn process_span<'a>(
    names: &SpanNames,
    messages: impl ExactSizeIterator<Item = (&'a MessageId, &'a Message)> + Clone,
) -> Span {
    let n = messages.len();
    let destination = messages
        .clone()
        .next()
        .map_or("", |(_, m)| m.meta.source.as_str());
    let span = info_span!(
        "inbox.process",
        otel.name = %format_args!("process {destination}"),
        otel.kind = "consumer",
        "messaging.system" = names.system,
        "messaging.operation.type" = "process",
        "messaging.operation.name" = "process",
        "messaging.destination.name" = %destination,
        "messaging.destination.partition.id" = Empty,
        "messaging.consumer.group.name" = %names.group(),
        "inbox.consumer" = %names.consumer,
        "messaging.message.id" = Empty,
        "messaging.batch.message_count" = Empty,
        "error.type" = Empty,
        traceparent = Empty,
    );
    if span.is_disabled() {
        return span;
    }
    // The partition, where every message of the transaction comes from the same one.
    let mut partitions = messages.clone().map(|(_, m)| m.meta.partition.as_deref());
    if let Some(Some(first)) = partitions.next() {
        if partitions.all(|p| p == Some(first)) {
            span.record("messaging.destination.partition.id", first);
        }
    }
    if n == 1 {
        if let Some((id, message)) = messages.clone().next() {
            record_message(&span, Some(id), message);
        }
    } else {
        span.record("messaging.batch.message_count", n);
        #[cfg(feature = "opentelemetry")]
        for (_, message) in messages {
            if let Some(parent) = TraceParent::from_message(message) {
                otel::add_link(&span, &parent);
            }
        }
    }
    span
}

/// The span of one ack or nack of `count` messages (`messaging.operation.type = settle`).
/// A CLIENT span, as the messaging conventions give settlement: the consumer calls the broker.
pub(crate) fn settle_span(names: &SpanNames, operation: &'static str, count: usize) -> Span {
    info_span!(
        "inbox.settle",
        otel.name = operation,
        otel.kind = "client",
        "messaging.system" = names.system,
        "messaging.operation.type" = "settle",
        "messaging.operation.name" = operation,
        "messaging.consumer.group.name" = %names.group(),
        "inbox.consumer" = %names.consumer,
        "messaging.batch.message_count" = count,
        "error.type" = Empty,
    )
}

/// The span of one publish of `count` messages to `destination` by a producer of `system`
/// (`messaging.operation.type = send`, a PRODUCER span): each adapter's `send_batch` runs in
/// one, and records [`record_error`] when it fails.
pub fn send_span(system: &'static str, destination: &str, count: usize) -> Span {
    info_span!(
        "inbox.send",
        otel.name = %format_args!("send {destination}"),
        otel.kind = "producer",
        "messaging.system" = system,
        "messaging.operation.type" = "send",
        "messaging.operation.name" = "send",
        "messaging.destination.name" = %destination,
        "messaging.batch.message_count" = count,
        "error.type" = Empty,
    )
}

/// Records `error.type` on `span`: a short, low-cardinality class of the failure.
pub fn record_error(span: &Span, error_type: &str) {
    span.record("error.type", error_type);
}

/// Runs `send`, one publish of `count` messages to `destination`, in its [`send_span`], and
/// records `error.type` (what the publisher does next: `retry`, `reconnect`, `fatal`) when it
/// fails. Each adapter's `Publish::send_batch` is one.
pub async fn traced_send(
    system: &'static str,
    destination: &str,
    count: usize,
    send: impl Future<Output = Result<(), PublishError>>,
) -> Result<(), PublishError> {
    let span = send_span(system, destination, count);
    let sent = send.instrument(span.clone()).await;
    if let Err(e) = &sent {
        record_error(&span, crate::consumer::common::recovery_type(e.recovery()));
    }
    sent
}

/// The names a consumer's spans carry: the consumer's, the broker's own group where it has one
/// (else the consumer's name stands for it), and the broker's `messaging.system`.
#[derive(Debug, Clone)]
pub(crate) struct SpanNames {
    pub(crate) consumer: String,
    pub(crate) group: Option<String>,
    pub(crate) system: &'static str,
}

impl SpanNames {
    /// `messaging.consumer.group.name`.
    pub(crate) fn group(&self) -> &str {
        self.group.as_deref().unwrap_or(&self.consumer)
    }
}

/// The span of one dead letter (`messaging.operation.type = settle`, name `dead_letter`), a
/// child of the message's producer span with the `opentelemetry` feature.
pub(crate) fn dead_letter_span(
    names: &SpanNames,
    id: Option<&MessageId>,
    message: &Message,
) -> Span {
    let destination = message.meta.source.as_str();
    let span = info_span!(
        "inbox.settle",
        otel.name = %format_args!("dead_letter {destination}"),
        otel.kind = "client",
        "messaging.system" = names.system,
        "messaging.operation.type" = "settle",
        "messaging.operation.name" = "dead_letter",
        "messaging.destination.name" = %destination,
        "messaging.destination.partition.id" = Empty,
        "messaging.consumer.group.name" = %names.group(),
        "inbox.consumer" = %names.consumer,
        "messaging.message.id" = Empty,
        "error.type" = Empty,
        traceparent = Empty,
    );
    if span.is_disabled() {
        return span;
    }
    if let Some(partition) = &message.meta.partition {
        span.record("messaging.destination.partition.id", partition.as_str());
    }
    record_message(&span, id, message);
    span
}

/// Records one message's ID and `traceparent` on `span`, and (feature `opentelemetry`) makes
/// its producer span the parent.
fn record_message(span: &Span, id: Option<&MessageId>, message: &Message) {
    if let Some(id) = id {
        span.record("messaging.message.id", display(id.escaped()));
    }
    if let Some(parent) = TraceParent::from_message(message) {
        span.record("traceparent", display(parent));
        #[cfg(feature = "opentelemetry")]
        otel::set_parent(span, &parent);
    }
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use opentelemetry::Context;
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TraceParent;

    fn remote(parent: &TraceParent) -> SpanContext {
        SpanContext::new(
            TraceId::from_bytes(parent.trace_id),
            SpanId::from_bytes(parent.parent_id),
            TraceFlags::new(parent.flags),
            true,
            TraceState::default(),
        )
    }

    pub(super) fn current() -> Option<TraceParent> {
        let context = Span::current().context();
        let span = context.span();
        let span = span.span_context();
        if !span.is_valid() {
            return None;
        }
        TraceParent::new(
            span.trace_id().to_bytes(),
            span.span_id().to_bytes(),
            span.trace_flags().to_u8(),
        )
    }

    pub(super) fn set_parent(span: &Span, parent: &TraceParent) {
        // Fails only for a span already started in OpenTelemetry: then it keeps its parent.
        let _ = span.set_parent(Context::new().with_remote_span_context(remote(parent)));
    }

    pub(super) fn add_link(span: &Span, parent: &TraceParent) {
        span.add_link(remote(parent));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let parent = TraceParent::parse(VALID).expect("valid");
        assert_eq!(parent.to_string(), VALID);
        assert_eq!(parent.trace_id()[0], 0x4b);
        assert_eq!(parent.parent_id()[7], 0xb7);
        assert!(parent.sampled());
        assert_eq!(TraceParent::parse(&format!(" {VALID}\t")), Ok(parent));
    }

    #[test]
    fn invalid_traceparents_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            // Uppercase hex.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            // All-zero trace ID and parent ID.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Version ff, and version 00 with more after it.
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            // Wrong separators, non-hex, a later version without `-` after the flags.
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            assert!(TraceParent::parse(bad).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_for_its_first_four_fields() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        let parent = TraceParent::parse(later).expect("a later version parses");
        assert_eq!(parent.to_string(), VALID);
    }

    #[test]
    fn a_message_header_is_read_and_a_bad_one_ignored() {
        let mut message = Message::new(Ok(MessageId::new("m").unwrap()), "{}");
        assert_eq!(TraceParent::from_message(&message), None);
        message
            .headers
            .push((TRACEPARENT_HEADER.into(), b"nonsense".to_vec()));
        assert_eq!(TraceParent::from_message(&message), None);
        message.headers[0].1 = VALID.as_bytes().to_vec();
        assert_eq!(
            TraceParent::from_message(&message).map(|p| p.to_string()),
            Some(VALID.to_owned())
        );
    }
}
