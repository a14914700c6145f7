//! One producer, every way [`Publish`] sends: what a test sent, to compare with what arrived.

use std::collections::BTreeSet;

use inbox_core::{Message, MessageId, OutgoingMessage, Publish};

/// A message as sent or received: its destination (on receipt, the source it came from), its ID
/// and its payload.
pub type Sent = (String, String, String);

/// Sends to `a` and `b` through each method of [`Publish`]: `a1` to `a` with
/// [`send`](Publish::send), `b1` to `b` with [`send_with_id`](Publish::send_with_id), then `a2`,
/// `a3` to `a` and `b2`, `b3` to `b` with [`send_batch`](Publish::send_batch); returns the six.
///
/// # Panics
/// When a send fails.
pub async fn send_each_way<P: Publish + ?Sized>(producer: &P, a: &str, b: &str) -> BTreeSet<Sent> {
    let mut sent = BTreeSet::new();
    let generated = producer
        .send(a, b"a1")
        .await
        .unwrap_or_else(|e| panic!("send: {e}"));
    sent.insert((a.to_owned(), generated.to_string(), "a1".to_owned()));
    let given = MessageId::generate();
    producer
        .send_with_id(b, &given, b"b1")
        .await
        .unwrap_or_else(|e| panic!("send_with_id: {e}"));
    sent.insert((b.to_owned(), given.to_string(), "b1".to_owned()));
    for (destination, payloads) in [(a, ["a2", "a3"]), (b, ["b2", "b3"])] {
        let batch: Vec<OutgoingMessage> = payloads
            .iter()
            .map(|p| OutgoingMessage::new(MessageId::generate(), p.as_bytes()))
            .collect();
        producer
            .send_batch(destination, &batch)
            .await
            .unwrap_or_else(|e| panic!("send_batch: {e}"));
        for (message, payload) in batch.iter().zip(payloads) {
            sent.insert((
                destination.to_owned(),
                message.id.to_string(),
                payload.to_owned(),
            ));
        }
    }
    sent
}

/// A received message as [`send_each_way`] lists it.
///
/// # Panics
/// When it has no ID or its payload is not UTF-8.
pub fn as_sent(message: &Message) -> Sent {
    let id = message
        .id
        .as_ref()
        .unwrap_or_else(|e| panic!("no ID: {e}"))
        .to_string();
    let payload = String::from_utf8(message.payload.clone())
        .unwrap_or_else(|e| panic!("the payload is not UTF-8: {e}"));
    (message.meta.source.clone(), id, payload)
}
