//! Where a message that cannot be applied goes, and how it gets there.

use std::collections::HashMap;

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::operation::get_queue_url::GetQueueUrlError;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::MessageAttributeValue;
use aws_sdk_sqs::Client;
use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Message, MessageId, Recovery, SourceError};
use tracing::warn;

use crate::delivery::{self, DedupId};
use crate::{fifo, Error};

/// SQS accepts at most this many message attributes per message.
const MAX_ATTRIBUTES: usize = 10;
/// The attributes a dead letter adds: why, and where it was read from.
const ADDED: [&str; 3] = [REASON, ORIGINAL_SOURCE, ORIGINAL_POSITION];
/// A reason longer than this is cut: it is for a person reading the dead-letter queue.
const MAX_REASON_BYTES: usize = 4096;

/// The dead-letter destination a source resolved when it was built.
#[derive(Debug, Clone)]
pub(crate) enum DeadLetterTarget {
    /// Send the message here with a reason, then delete the original.
    Queue(String),
    /// The queue has a redrive policy whose dead-letter queue could not be resolved to a URL:
    /// hand the message back and let SQS move it after `max_receive_count` receives.
    Redrive {
        arn: String,
        max_receive_count: String,
    },
    /// Nowhere: dead-lettering is a configuration error.
    None,
}

impl DeadLetterTarget {
    /// Resolves a queue's `RedrivePolicy` to its dead-letter queue's URL, so dead letters
    /// carry a reason and go there at once. When the URL cannot be read (no permission for
    /// `GetQueueUrl`, say), falls back to letting SQS's own redrive move the message; when the
    /// dead-letter queue does not exist, fails with [`Error::Config`].
    pub(crate) async fn from_redrive_policy(
        client: &Client,
        queue_url: &str,
        policy: &str,
    ) -> Result<Self, Error> {
        let parsed: serde_json::Value = match serde_json::from_str(policy) {
            Ok(v) => v,
            Err(e) => {
                warn!(queue_url, error = %e, policy, "cannot parse the queue's RedrivePolicy; dead letters will fail until a dead-letter queue is configured");
                return Ok(DeadLetterTarget::None);
            }
        };
        let Some(arn) = parsed.get("deadLetterTargetArn").and_then(|v| v.as_str()) else {
            return Ok(DeadLetterTarget::None);
        };
        let max_receive_count = match parsed.get("maxReceiveCount") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => "?".to_owned(),
        };
        // arn:aws:sqs:<region>:<account>:<name>
        let parts: Vec<&str> = arn.splitn(6, ':').collect();
        if let [_, _, _, _, account, name] = parts.as_slice() {
            let mut request = client.get_queue_url().queue_name(*name);
            if !account.is_empty() {
                request = request.queue_owner_aws_account_id(*account);
            }
            match request.send().await {
                Ok(out) => {
                    if let Some(url) = out.queue_url() {
                        return Ok(DeadLetterTarget::Queue(url.to_owned()));
                    }
                }
                Err(e) if is_missing_queue(&e) => {
                    return Err(Error::Config(format!(
                        "queue {queue_url} has a RedrivePolicy to dead-letter queue {arn}, which \
                         does not exist: create it, fix the RedrivePolicy, or set \
                         SqsSourceBuilder::dead_letter_queue(url)"
                    )));
                }
                Err(e) => {
                    let e = Error::sdk("GetQueueUrl", name, e);
                    warn!(queue_url, dead_letter_arn = arn, error = %e, "cannot resolve the redrive dead-letter queue; failed messages are handed back until SQS moves them");
                }
            }
        }
        Ok(DeadLetterTarget::Redrive {
            arn: arn.to_owned(),
            max_receive_count,
        })
    }
}

/// Sends `message` to the dead-letter queue `dlq_url` with its body, its original attributes
/// (as received, when `original` has them) and the [`inbox_core::dead_letter`] attributes:
/// the reason, the source queue URL and the SQS message ID (`message <id>`). The message ID
/// always goes in the attribute `id_attribute`, the one the source reads, even when the
/// attributes must be cut or the ID came from the `MessageDeduplicationId`: a dead letter
/// replayed into the source then keeps its ID. `receipt_handle` is the handle of the receive
/// that returned this copy; on a FIFO queue it makes the deduplication ID.
pub(crate) async fn send(
    client: &Client,
    dlq_url: &str,
    id_attribute: &str,
    message: &Message,
    original: Option<&HashMap<String, MessageAttributeValue>>,
    receipt_handle: Option<&str>,
    reason: &str,
) -> Result<(), Error> {
    let body = String::from_utf8_lossy(&message.payload).into_owned();
    let mut attributes = original_attributes(original, message);
    let id = id_attribute_of(&mut attributes, id_attribute, message)?;
    // A dead letter's schedule is over: a replay starts a new one.
    attributes.retain(|(name, _)| {
        !ADDED.contains(&name.as_str()) && !delivery::SCHEDULE_ATTRIBUTES.contains(&name.as_str())
    });
    make_room(
        &mut attributes,
        ADDED.len() + usize::from(id.is_some()),
        dlq_url,
        "add the dead-letter attributes",
    );
    attributes.extend(id);
    let added = [
        (REASON, truncate(reason, MAX_REASON_BYTES)),
        (ORIGINAL_SOURCE, message.meta.source.clone()),
        (ORIGINAL_POSITION, message.meta.position.clone()),
    ];
    for (name, value) in added {
        if value.is_empty() {
            // SQS refuses an empty String attribute.
            continue;
        }
        attributes.push((name.to_owned(), text_attribute(name, &value)?));
    }

    let mut request = client.send_message().queue_url(dlq_url).message_body(body);
    for (name, value) in attributes {
        request = request.message_attributes(name, value);
    }
    if dlq_url.ends_with(".fifo") {
        // A FIFO queue needs a group; keep the original's so its order survives, and a
        // deduplication ID in case the queue has no content-based deduplication.
        request = request
            .message_group_id(fifo_group(message))
            .message_deduplication_id(fifo_dedup_id(receipt_handle));
    }
    request
        .send()
        .await
        .map_err(|e| Error::sdk("SendMessage (dead letter)", dlq_url, e))?;
    Ok(())
}

/// The attributes to send a copy of `message` with: those it was received with (`original`),
/// with their data types, else made from its headers.
pub(crate) fn original_attributes(
    original: Option<&HashMap<String, MessageAttributeValue>>,
    message: &Message,
) -> Vec<(String, MessageAttributeValue)> {
    match original {
        Some(original) => original
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        None => message
            .headers
            .iter()
            .filter_map(|(name, value)| Some((name.clone(), attribute(value)?)))
            .collect(),
    }
}

/// Cuts `attributes` so that `added` more fit in SQS's 10: the last by name give way, and are
/// logged, so nothing is dropped silently.
pub(crate) fn make_room(
    attributes: &mut Vec<(String, MessageAttributeValue)>,
    added: usize,
    queue_url: &str,
    why: &str,
) {
    attributes.sort_by(|a, b| a.0.cmp(&b.0));
    let room = MAX_ATTRIBUTES.saturating_sub(added);
    if attributes.len() > room {
        let dropped: Vec<String> = attributes.drain(room..).map(|(name, _)| name).collect();
        warn!(
            queue_url,
            ?dropped,
            "SQS allows 10 message attributes; dropped these to {why}"
        );
    }
}

/// A `String` attribute.
pub(crate) fn text_attribute(name: &str, value: &str) -> Result<MessageAttributeValue, Error> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| Error::Config(format!("cannot build the {name} attribute: {e}")))
}

/// Refuses an ID attribute (`who` sets it) that a dead letter or a delayed redelivery writes
/// itself: the ID would be overwritten on the way, and every letter of one reason replay under
/// one ID.
pub(crate) fn check_id_attribute(name: &str, who: &str) -> Result<(), Error> {
    if ADDED.contains(&name)
        || delivery::SCHEDULE_ATTRIBUTES.contains(&name)
        || name == delivery::DEDUPLICATION_ID_HEADER
    {
        return Err(Error::Config(format!(
            "the ID attribute `{name}` is one the adapter writes itself on a dead letter \
             ({REASON}, {ORIGINAL_SOURCE}, {ORIGINAL_POSITION}) or a delayed redelivery, so \
             it would overwrite the ID and a replay would lose messages: rename it in {who} \
             (and in the producers), `event_id` say"
        )));
    }
    Ok(())
}

/// Takes the ID attribute out of `attributes`, to be kept whatever else is cut: the one the
/// message was received with, else (the ID was the `MessageDeduplicationId`, a system attribute
/// a send cannot copy) one made from the message's ID. `None` when the message has no ID.
pub(crate) fn id_attribute_of(
    attributes: &mut Vec<(String, MessageAttributeValue)>,
    name: &str,
    message: &Message,
) -> Result<Option<(String, MessageAttributeValue)>, Error> {
    if let Some(i) = attributes.iter().position(|(n, _)| n == name) {
        return Ok(Some(attributes.swap_remove(i)));
    }
    let Ok(id) = &message.id else {
        return Ok(None);
    };
    let value = MessageAttributeValue::builder()
        .data_type("String")
        .string_value(id.as_str())
        .build()
        .map_err(|e| Error::Config(format!("cannot build the ID attribute {name}: {e}")))?;
    Ok(Some((name.to_owned(), value)))
}

/// The message group of a dead letter on a FIFO queue: the original's group, made valid for
/// SQS (hashed where it is not), so the group's order survives; `dead-letter` without one.
pub(crate) fn fifo_group(message: &Message) -> String {
    match message.key.as_deref() {
        Some(key) if !key.is_empty() => fifo::fifo_id(&String::from_utf8_lossy(key)),
        _ => "dead-letter".to_owned(),
    }
}

/// The deduplication ID of a dead letter on a FIFO queue: new for every delivery, never the
/// event ID.
///
/// With the event ID, a message redriven and dead-lettered again within SQS's 5-minute
/// deduplication window would be dropped by SQS as a copy of its first dead letter (the send
/// still succeeds) and then deleted from the source: lost. The receipt handle is new on every
/// receive, so each delivery's dead letter is its own, while a retry of the same delivery's
/// send (the SDK's, after a lost response) is still dropped as the duplicate it is. Without a
/// handle (not expected: every ack carries its own), a fresh UUID: a retried send can
/// then leave a second copy in the DLQ, which the inbox skips on replay; a duplicate dead
/// letter is recoverable, a dropped one is not. Both are hashed or generated into SQS's
/// alphabet, never built from the message ID, which may hold spaces or non-ASCII.
fn fifo_dedup_id(receipt_handle: Option<&str>) -> String {
    match receipt_handle {
        Some(handle) if !handle.is_empty() => DedupId::DeadLetter(handle).value(),
        _ => MessageId::generate().to_string(),
    }
}

/// Checks that the dead-letter queue at `dlq_url` exists (`GetQueueUrl` on its name and
/// account), so a wrong URL fails the build instead of every dead letter later.
///
/// Only a missing queue fails; where the check itself is not allowed (no `GetQueueUrl`
/// permission: dead-lettering needs only `SendMessage`), it logs and lets the build go on.
pub(crate) async fn check_queue(client: &Client, dlq_url: &str) -> Result<(), Error> {
    let (account, name) = queue_name(dlq_url).ok_or_else(|| {
        Error::Config(format!(
            "dead-letter queue URL {dlq_url} names no queue; expected \
             https://sqs.<region>.amazonaws.com/<account>/<name>"
        ))
    })?;
    let mut request = client.get_queue_url().queue_name(name);
    if let Some(account) = account {
        request = request.queue_owner_aws_account_id(account);
    }
    match request.send().await {
        Ok(_) => Ok(()),
        Err(e) if is_missing_queue(&e) => Err(Error::Config(format!(
            "dead-letter queue {dlq_url} does not exist: create it, or point \
             SqsSourceBuilder::dead_letter_queue(..) at an existing queue"
        ))),
        Err(e) => {
            let e = Error::sdk("GetQueueUrl (dead-letter queue)", dlq_url, e);
            if e.recovery() == Recovery::Fatal {
                warn!(dlq_url, error = %e, "cannot check that the dead-letter queue exists (no GetQueueUrl permission?); if it is missing, dead letters fail and their messages are handed back");
                Ok(())
            } else {
                Err(e)
            }
        }
    }
}

/// The account (when the URL has one) and the queue name of a queue URL
/// (`https://sqs.<region>.amazonaws.com/<account>/<name>`).
fn queue_name(url: &str) -> Option<(Option<&str>, &str)> {
    let path = url.split_once("://").map_or(url, |(_, rest)| rest);
    // Everything after the host.
    let segments: Vec<&str> = path.split('/').skip(1).filter(|s| !s.is_empty()).collect();
    match segments.as_slice() {
        [.., account, name] if account.bytes().all(|b| b.is_ascii_digit()) => {
            Some((Some(account), name))
        }
        [.., name] => Some((None, name)),
        [] => None,
    }
}

fn is_missing_queue<R>(err: &SdkError<GetQueueUrlError, R>) -> bool {
    err.as_service_error()
        .is_some_and(GetQueueUrlError::is_queue_does_not_exist)
        || err.code().is_some_and(|code| {
            matches!(
                code,
                "AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist"
            )
        })
}

/// The error `dead_letter` returns when the queue has a redrive policy but no dead-letter
/// queue URL could be resolved: the message is handed back for SQS to move.
pub(crate) fn handed_to_redrive(
    queue_url: &str,
    arn: &str,
    max: &str,
    reason: &str,
) -> SourceError {
    SourceError::new(
        Recovery::Retry,
        "dead letter",
        format!(
            "message on {queue_url} handed back: the queue's redrive policy moves it to {arn} after \
             {max} receives (reason here: {reason}); configure dead_letter_queue(..) to send it \
             there at once with its reason"
        ),
    )
}

/// The error `dead_letter` returns when there is nowhere to put the message.
pub(crate) fn nowhere(queue_url: &str, reason: &str) -> SourceError {
    SourceError::new(
        Recovery::Fatal,
        "dead letter",
        format!(
            "queue {queue_url} has no dead-letter queue, so a message that cannot be applied \
             ({reason}) has nowhere to go: set SqsSourceBuilder::dead_letter_queue(url) or a \
             RedrivePolicy on the queue"
        ),
    )
}

/// An attribute from a header's bytes: text stays text, anything else (empty text too, which
/// SQS refuses as a `String`) is binary; the source reads both back as the same bytes.
pub(crate) fn attribute(value: &[u8]) -> Option<MessageAttributeValue> {
    let builder = MessageAttributeValue::builder();
    let builder = match std::str::from_utf8(value) {
        Ok(text) if !text.is_empty() => builder.data_type("String").string_value(text),
        _ => builder
            .data_type("Binary")
            .binary_value(Blob::new(value.to_vec())),
    };
    builder.build().ok()
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_cut_on_a_char_boundary() {
        assert_eq!(truncate("abc", 10), "abc");
        assert_eq!(truncate("aé", 2), "a");
    }

    #[test]
    fn queue_names_come_from_the_url() {
        assert_eq!(
            queue_name("https://sqs.eu-west-1.amazonaws.com/123456789012/payments-dlq"),
            Some((Some("123456789012"), "payments-dlq"))
        );
        assert_eq!(
            queue_name("http://127.0.0.1:4566/000000000000/q.fifo/"),
            Some((Some("000000000000"), "q.fifo"))
        );
        assert_eq!(
            queue_name("http://localhost:9324/queue/q"),
            Some((None, "q"))
        );
        assert_eq!(queue_name("https://sqs.eu-west-1.amazonaws.com/"), None);
    }

    #[test]
    fn fifo_dead_letter_ids_are_valid_and_new_per_delivery() {
        let a = fifo_dedup_id(Some("AQEB+handle/one=="));
        assert!(fifo::is_valid_id(&a), "{a}");
        assert_eq!(
            a,
            fifo_dedup_id(Some("AQEB+handle/one==")),
            "a retried send is dropped"
        );
        assert_ne!(
            a,
            fifo_dedup_id(Some("AQEB+handle/two==")),
            "a redelivery is not"
        );
        let fresh = fifo_dedup_id(None);
        assert!(fifo::is_valid_id(&fresh), "{fresh}");
        assert_ne!(fresh, fifo_dedup_id(None));
    }

    #[test]
    fn headers_become_text_or_binary_attributes() {
        let text = attribute(b"42").expect("text");
        assert_eq!(
            (text.data_type(), text.string_value()),
            ("String", Some("42"))
        );
        let binary = attribute(&[0xff]).expect("binary");
        assert_eq!(binary.data_type(), "Binary");
    }
}
