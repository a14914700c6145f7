//! What a source must tell the consumer's telemetry about a message: when it was sent and the
//! producer's trace parent.

use std::time::{Duration, SystemTime};

use inbox_core::{Message, TraceParent};

/// A W3C `traceparent` for a producer to attach and a test to find on the delivered message.
pub const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Asserts that `message` carries [`TRACEPARENT`] as its trace parent.
///
/// # Panics
/// When it carries another or none.
pub fn assert_traced(message: &Message) {
    assert_eq!(
        TraceParent::from_message(message).map(|p| p.to_string()),
        Some(TRACEPARENT.to_owned()),
        "the trace parent of {:?}",
        message.id
    );
}

/// Asserts that `message` has a send timestamp, no earlier than `earliest` and no later than
/// five seconds from now (the broker's clock may run a little ahead of this machine's).
///
/// # Panics
/// When it has none, or one out of that range.
pub fn assert_sent_since(message: &Message, earliest: SystemTime) {
    let sent = message
        .meta
        .timestamp
        .unwrap_or_else(|| panic!("{:?} has no send timestamp", message.id));
    assert!(sent >= earliest, "{sent:?} is before the send");
    assert!(
        sent <= SystemTime::now() + Duration::from_secs(5),
        "{sent:?} is in the future"
    );
}
