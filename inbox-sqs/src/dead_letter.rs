//! Where a message that cannot be applied goes, and how it gets there. The dead-letter queue
//! read back for replay is [`reader`]'s.

mod reader;

pub use reader::{SqsDeadLetters, SqsDeadLettersBuilder};

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::operation::get_queue_url::builders::GetQueueUrlFluentBuilder;
use aws_sdk_sqs::operation::get_queue_url::GetQueueUrlError;
use aws_sdk_sqs::Client;
use inbox_core::dead_letter::{ORIGINAL_POSITION, ORIGINAL_SOURCE, REASON};
use inbox_core::{Message, MessageId, Recovery, SourceError};
use tracing::warn;

use crate::copy::Copy;
use crate::delivery::{DedupId, DEDUPLICATION_ID_HEADER, SCHEDULE_ATTRIBUTES};
use crate::{fifo, Error, Result};

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
        if let [_, _, _, _, account, name] = arn.splitn(6, ':').collect::<Vec<_>>()[..] {
            let account = Some(account).filter(|a| !a.is_empty());
            match get_queue_url(client, account, name).send().await {
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

    /// Why `message` (failing for `reason`) cannot be dead-lettered from `queue_url` here: a
    /// redrive policy hands it back (a retry) for SQS to move; with no dead-letter queue at
    /// all it has nowhere to go (fatal).
    pub(crate) fn refusal(&self, queue_url: &str, reason: &str) -> SourceError {
        let (recovery, text) = match self {
            DeadLetterTarget::Redrive {
                arn,
                max_receive_count,
            } => (
                Recovery::Retry,
                format!(
                    "message on {queue_url} handed back: the queue's redrive policy moves it to \
                     {arn} after {max_receive_count} receives (reason here: {reason}); configure \
                     dead_letter_queue(..) to send it there at once with its reason"
                ),
            ),
            _ => (
                Recovery::Fatal,
                format!(
                    "queue {queue_url} has no dead-letter queue, so a message that cannot be \
                     applied ({reason}) has nowhere to go: set \
                     SqsSourceBuilder::dead_letter_queue(url) or a RedrivePolicy on the queue"
                ),
            ),
        };
        SourceError::new(recovery, "dead letter", text)
    }
}

/// The copy of `message` that goes to the dead-letter queue `dlq_url` (see the crate docs,
/// "Dead letters"): the [`inbox_core::dead_letter`] attributes (the reason, the source queue
/// URL and `message <SQS message ID>`) added, the redelivery schedule left off (a replay
/// starts a new one). `receipt_handle`, of the receive that returned this copy, makes the
/// deduplication ID on a FIFO queue.
pub(crate) fn letter<'a>(
    dlq_url: &'a str,
    message: &Message,
    receipt_handle: &str,
    reason: &str,
) -> Copy<'a> {
    Copy {
        queue_url: dlq_url,
        operation: "SendMessage (dead letter)",
        why: "add the dead-letter attributes",
        added: vec![
            (REASON, truncate(reason, MAX_REASON_BYTES)),
            (ORIGINAL_SOURCE, message.meta.source.clone()),
            (ORIGINAL_POSITION, message.meta.position.clone()),
        ],
        fifo_dedup_id: fifo::is_fifo_queue(dlq_url).then(|| fifo_dedup_id(receipt_handle)),
        delay_seconds: None,
    }
}

/// Refuses an ID attribute (`who` sets it) that is empty, or that a dead letter or a delayed
/// redelivery writes itself: the ID would be overwritten on the way, and every letter of one
/// reason replay under one ID.
pub(crate) fn check_id_attribute(name: &str, who: &str) -> Result<(), Error> {
    if name.is_empty() {
        return Err(Error::Config(format!(
            "the ID attribute name is empty: name one in {who}"
        )));
    }
    if ADDED.contains(&name)
        || SCHEDULE_ATTRIBUTES.contains(&name)
        || name == DEDUPLICATION_ID_HEADER
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
fn fifo_dedup_id(receipt_handle: &str) -> String {
    if receipt_handle.is_empty() {
        MessageId::generate().to_string()
    } else {
        DedupId::DeadLetter(receipt_handle).value()
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
    match get_queue_url(client, account, name).send().await {
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

/// `GetQueueUrl` for the queue `name` of `account` (the caller's own when `None`).
fn get_queue_url(client: &Client, account: Option<&str>, name: &str) -> GetQueueUrlFluentBuilder {
    client
        .get_queue_url()
        .queue_name(name)
        .set_queue_owner_aws_account_id(account.map(str::to_owned))
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
    use std::time::Duration;

    use aws_sdk_sqs::types::MessageSystemAttributeName;

    use super::*;
    use crate::source::system_attribute;

    #[test]
    fn reasons_are_cut_on_a_char_boundary() {
        assert_eq!(truncate("abc", 10), "abc");
        assert_eq!(truncate("aé", 2), "a");
    }

    #[test]
    fn queue_names_come_from_the_url() {
        for (url, expected) in [
            (
                "https://sqs.eu-west-1.amazonaws.com/123456789012/payments-dlq",
                Some((Some("123456789012"), "payments-dlq")),
            ),
            (
                "http://127.0.0.1:4566/000000000000/q.fifo/",
                Some((Some("000000000000"), "q.fifo")),
            ),
            ("http://localhost:9324/queue/q", Some((None, "q"))),
            ("https://sqs.eu-west-1.amazonaws.com/", None),
        ] {
            assert_eq!(queue_name(url), expected, "{url}");
        }
    }

    #[test]
    fn fifo_dead_letter_ids_are_valid_and_new_per_delivery() {
        let a = fifo_dedup_id("AQEB+handle/one==");
        assert!(crate::fifo::is_valid_id(&a), "{a}");
        assert_eq!(
            a,
            fifo_dedup_id("AQEB+handle/one=="),
            "a retried send is dropped"
        );
        assert_ne!(a, fifo_dedup_id("AQEB+handle/two=="), "a redelivery is not");
        let fresh = fifo_dedup_id("");
        assert!(crate::fifo::is_valid_id(&fresh), "{fresh}");
        assert_ne!(fresh, fifo_dedup_id(""));
    }

    /// A dead-letter queue URL ending in `.fifo/` names a FIFO queue, as it does for the
    /// source and the producer: its copies carry a group and a deduplication ID.
    #[test]
    fn a_dead_letter_queue_is_fifo_by_the_same_rule_with_or_without_a_trailing_slash() {
        let message = Message::new(Ok(MessageId::generate()), "{}");
        for (url, fifo) in [
            ("http://127.0.0.1:4566/000000000000/q-dlq.fifo", true),
            ("http://127.0.0.1:4566/000000000000/q-dlq.fifo/", true),
            ("http://127.0.0.1:4566/000000000000/q-dlq", false),
            ("http://127.0.0.1:4566/000000000000/q-dlq/", false),
        ] {
            let copy = letter(url, &message, "handle", "reason");
            assert_eq!(copy.fifo_dedup_id.is_some(), fifo, "{url}");
        }
    }

    /// The copy made for a FIFO dead-letter queue given as `…/q-dlq.fifo/` is one SQS takes:
    /// without a group and a deduplication ID it refuses a FIFO send, and the message would be
    /// handed back again and again instead. moto takes no queue URL with a trailing `/` at all
    /// (it reads the queue name after the last `/`), so the copy goes to the URL without it.
    #[tokio::test]
    async fn a_copy_for_a_fifo_dead_letter_queue_named_with_a_trailing_slash_is_taken() {
        use inbox_conformance::sqs::{client, create_queue, delete_queue, drain, queue_name};

        let sqs = client().await;
        let fifo = [(aws_sdk_sqs::types::QueueAttributeName::FifoQueue, "true")];
        let name = format!("{}.fifo", queue_name("slash-dlq"));
        let dlq = create_queue(&sqs, &name, 30, &fifo).await;
        let mut message = Message::new(Ok(MessageId::generate()), "cannot be applied");
        message.key = Some(b"account-1".to_vec());
        let given = format!("{dlq}/");
        let mut copy = letter(&given, &message, "handle-1", "test: cannot be applied");
        copy.queue_url = &dlq;
        let sent = copy.send(&sqs, "event_id", &message, None).await;
        let dead = drain(&sqs, &dlq, Duration::from_secs(1)).await;
        delete_queue(&sqs, &dlq).await;
        sent.unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].body(), Some("cannot be applied"));
        let group = system_attribute(&dead[0], MessageSystemAttributeName::MessageGroupId);
        assert_eq!(group.map(String::as_str), Some("account-1"));
    }
}
