//! What the adapter keeps of each SQS delivery, and the rules it decides with: plain state and
//! plain functions, no I/O and no SDK types, so the I/O shell ([`SqsSource`](crate::SqsSource),
//! [`SqsAck`](crate::SqsAck), [`SqsProducer`](crate::SqsProducer)) and a simulation drive the
//! same logic.
//!
//! - [`Redelivery`]: where a received copy stands on the redelivery schedule, whether it is due
//!   ([`Redelivery::on_receive`]) and what it reports ([`Redelivery::report`]);
//! - [`RedeliveryCopy::plan`]: how the copy for the next redelivery is sent;
//! - [`Ownership`]: whether a receipt handle still holds its message;
//! - [`DedupId`]: the FIFO `MessageDeduplicationId` of each kind of send.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inbox_core::{MessageId, OutgoingMessage};

pub use inbox_core::REDELIVERY_COUNT;

use crate::fifo;

/// The message attribute of a redelivered copy that is not to be handed out before this time:
/// milliseconds since the Unix epoch, decimal. Set where SQS cannot delay the copy itself (a
/// FIFO queue, which takes no per-message delay, or a delay beyond SQS's 15 minutes).
pub const REDELIVER_AT: &str = "x-inbox-redeliver-at";

/// The attributes a delayed redelivery writes on its copy, and a dead letter leaves off (a
/// replay starts a new schedule).
pub const SCHEDULE_ATTRIBUTES: [&str; 2] = [REDELIVERY_COUNT, REDELIVER_AT];

/// An [`OutgoingMessage`] header that [`SqsProducer`](crate::SqsProducer)
/// sends as the FIFO `MessageDeduplicationId` instead of the message ID, and never as an
/// attribute. [`SqsDeadLetters`](crate::SqsDeadLetters) sets it on every dead letter it reads,
/// so a replay is deduplicated against nothing but itself.
pub const DEDUPLICATION_ID_HEADER: &str = "x-inbox-deduplication-id";

/// SQS's longest per-message delay (`DelaySeconds`).
pub const MAX_SEND_DELAY: Duration = Duration::from_secs(15 * 60);

/// SQS's longest visibility timeout (a copy not due for longer is hidden more than once).
pub const MAX_HIDE: Duration = Duration::from_secs(12 * 60 * 60);

/// Where a received message stands on the redelivery schedule: how many delayed redeliveries the
/// consumer asked for before this copy, and when this copy is due.
///
/// Only [`Ack::redeliver`](inbox_core::Ack::redeliver) moves it: it sends a copy that carries the
/// next count, and deletes the message it received. A hand-back (a nack, a crash, a visibility
/// timeout, a shutdown) leaves the message, and so its count, as it was, where SQS's
/// `ApproximateReceiveCount` counts every receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Redelivery {
    /// Delayed redeliveries before this copy ([`Metadata::redeliveries`](inbox_core::Metadata::redeliveries)).
    pub count: u32,
    /// Not to be handed to the consumer before this time.
    pub due: Option<SystemTime>,
}

/// What a receive does with one received copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Hand it to the consumer.
    Deliver,
    /// Not due yet: set its visibility to this (whole seconds, at most [`MAX_HIDE`]) and hand
    /// it to no one.
    HideFor(Duration),
}

/// What a received copy tells the consumer of its past, in its
/// [`Metadata`](inbox_core::Metadata): [`Redelivery::report`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported {
    /// [`Metadata::delivery_count`](inbox_core::Metadata::delivery_count): SQS's
    /// `ApproximateReceiveCount` of this copy, every receive counted.
    pub delivery_count: Option<u32>,
    /// [`Metadata::redeliveries`](inbox_core::Metadata::redeliveries): the delayed redeliveries
    /// the consumer asked for, carried by the copy; never the receives.
    pub redeliveries: u32,
    /// [`Metadata::redelivered`](inbox_core::Metadata::redelivered): received before, or a
    /// redelivered copy.
    pub redelivered: bool,
}

impl Redelivery {
    /// Reads the values of the attributes [`REDELIVERY_COUNT`] and [`REDELIVER_AT`] of a received
    /// message. A missing or unreadable value counts as none: a first delivery, due now.
    pub fn read(count: Option<&str>, due: Option<&str>) -> Self {
        let count = count.and_then(|c| c.trim().parse().ok()).unwrap_or(0);
        let due = due
            .and_then(|ms| ms.trim().parse::<u64>().ok())
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
        Self { count, due }
    }

    /// What to do with this copy, received at `now`: deliver it once due, hide it until then.
    /// A due time more than [`MAX_HIDE`] away is hidden for [`MAX_HIDE`] and decided again.
    pub fn on_receive(&self, now: SystemTime) -> Arrival {
        match self.due.and_then(|due| due.duration_since(now).ok()) {
            Some(left) if !left.is_zero() => Arrival::HideFor(left.min(MAX_HIDE)),
            _ => Arrival::Deliver,
        }
    }

    /// What this copy reports, received for the `receive_count`th time
    /// (`ApproximateReceiveCount`, `None` when SQS did not say). Only the consumer's own
    /// delayed redeliveries move it along its schedule: a hand-back, a crash, a visibility
    /// timeout or a hide until due counts as a receive, not as a redelivery.
    pub fn report(&self, receive_count: Option<u32>) -> Reported {
        Reported {
            delivery_count: receive_count,
            redeliveries: self.count,
            redelivered: receive_count.is_some_and(|n| n > 1) || self.count > 0,
        }
    }
}

/// How the copy for a delayed redelivery is sent: its attributes and SQS's own delay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedeliveryCopy {
    /// The copy's [`REDELIVERY_COUNT`]: the redelivery asked for, counted from 1.
    pub count: u32,
    /// `DelaySeconds` for the send (standard queues; at most 15 minutes), `None` for none.
    pub delay_seconds: Option<i32>,
    /// The copy's [`REDELIVER_AT`], where SQS's own delay cannot cover the whole delay.
    pub due: Option<SystemTime>,
}

impl RedeliveryCopy {
    /// The copy for redelivery `redelivery` (from 0, as the consumer passes it) after `delay`,
    /// sent at `now` to a FIFO queue or not. A standard queue delays the copy itself up to 15
    /// minutes (rounded up to whole seconds); a longer delay, or any delay on a FIFO queue (which
    /// takes no per-message delay), is carried in [`REDELIVER_AT`] and kept by
    /// [`Redelivery::on_receive`].
    pub fn plan(redelivery: u32, delay: Duration, now: SystemTime, fifo: bool) -> Self {
        let count = redelivery.saturating_add(1);
        if delay.is_zero() {
            return Self {
                count,
                delay_seconds: None,
                due: None,
            };
        }
        let due = (fifo || delay > MAX_SEND_DELAY).then(|| now + delay);
        let delay_seconds = (!fifo).then(|| whole_seconds(delay.min(MAX_SEND_DELAY)));
        Self {
            count,
            delay_seconds,
            due,
        }
    }

    /// The [`REDELIVER_AT`] value: milliseconds since the Unix epoch.
    pub fn due_attribute(&self) -> Option<String> {
        let due = self.due?.duration_since(UNIX_EPOCH).ok()?;
        Some(due.as_millis().to_string())
    }
}

/// `delay` in whole seconds as SQS takes them, rounded up: rounding down would make a delay
/// under 1 s no delay at all.
pub fn whole_seconds(delay: Duration) -> i32 {
    let seconds = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
    i32::try_from(seconds).unwrap_or(i32::MAX)
}

/// Whether a delivery's receipt handle still holds its message. Lost once SQS refuses the handle
/// (the visibility heartbeat found it stale: the message was handed out again under a new
/// handle, or deleted by its other copy); never found again.
///
/// Shared between the heartbeat that notices and the ack that reports it
/// ([`Ack::is_stale`](inbox_core::Ack::is_stale)).
#[derive(Debug, Default)]
pub struct Ownership {
    lost: AtomicBool,
}

impl Ownership {
    /// Held, as every delivery starts.
    pub fn new() -> Self {
        Self::default()
    }

    /// SQS refused the receipt handle: the message is another receive's now, or gone.
    pub fn lose(&self) {
        self.lost.store(true, Ordering::Release);
    }

    /// Whether [`lose`](Self::lose) was called.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

/// The FIFO `MessageDeduplicationId` of each kind of send. SQS drops, without an error, any send
/// whose deduplication ID it has seen on the queue in the last 5 minutes: a send that must
/// arrive carries an ID no earlier send had, and only a retry of the same send shares one.
///
/// Each is a valid deduplication ID (1 to 128 ASCII letters, digits or punctuation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DedupId<'a> {
    /// A producer's send: the message ID (hashed where SQS would refuse it), so SQS drops a
    /// resend within 5 minutes and the inbox any later one.
    FirstSend(&'a MessageId),
    /// An explicit ID ([`DEDUPLICATION_ID_HEADER`]): used as given where valid, else hashed.
    Given(&'a str),
    /// A dead letter replayed to its source, by its own position in the dead-letter queue (its
    /// SQS message ID): never the first send's ID, which SQS would still hold for 5 minutes, and
    /// new each time the message is parked again; a replay of the same letter twice (a crash
    /// before its removal) is one message.
    Replay(&'a str),
    /// A delayed redelivery's copy, by the receipt handle of the delivery it replaces: new per
    /// delivery, the same for a retried send of it.
    Redelivery(&'a str),
    /// A dead letter sent to a FIFO dead-letter queue, by the receipt handle of the delivery:
    /// new per delivery, so a message parked again within 5 minutes arrives again.
    DeadLetter(&'a str),
}

impl DedupId<'_> {
    /// The `MessageDeduplicationId` to send.
    pub fn value(&self) -> String {
        match self {
            DedupId::FirstSend(id) => fifo::fifo_id(id.as_str()),
            DedupId::Given(text) => fifo::fifo_id(text),
            DedupId::Replay(position) => {
                format!("replay-{}", fifo::hash_hex(position.as_bytes()))
            }
            DedupId::Redelivery(handle) => {
                format!("redelivery-{}", fifo::hash_hex(handle.as_bytes()))
            }
            // Kept as it was before the kinds had names: SQS compares only within one queue.
            DedupId::DeadLetter(handle) => fifo::hash_hex(handle.as_bytes()),
        }
    }
}

/// The `MessageDeduplicationId` the producer sends `message` under on a FIFO queue: the one
/// its [`DEDUPLICATION_ID_HEADER`] gives (a replay's), else its ID ([`DedupId::FirstSend`]).
pub fn send_dedup_id(message: &OutgoingMessage) -> String {
    let given = message
        .headers
        .iter()
        .find(|(name, _)| name == DEDUPLICATION_ID_HEADER)
        .map(|(_, value)| String::from_utf8_lossy(value));
    match given {
        Some(given) => DedupId::Given(&given).value(),
        None => DedupId::FirstSend(&message.id).value(),
    }
}

/// The header the dead-letter reader puts on the letter at `position` (its SQS message ID in
/// the dead-letter queue): a replay of it is deduplicated by this letter alone, never taken for
/// a copy of the first send, nor of an earlier letter of the same message.
pub fn replay_header(position: &str) -> (String, Vec<u8>) {
    (
        DEDUPLICATION_ID_HEADER.to_owned(),
        DedupId::Replay(position).value().into_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_first_delivery_is_redelivery_zero_and_due_now() {
        let now = UNIX_EPOCH + 1000 * SECOND;
        let first = Redelivery::read(None, None);
        assert_eq!(first, Redelivery::default());
        assert_eq!(first.on_receive(now), Arrival::Deliver);
        assert_eq!(Redelivery::read(Some("x"), Some("soon")), first);
        assert_eq!(Redelivery::read(Some("3"), None).count, 3);
    }

    #[test]
    fn only_a_redelivery_moves_a_message_along_its_schedule() {
        let first = Redelivery::default().report(Some(1));
        assert_eq!((first.delivery_count, first.redeliveries), (Some(1), 0));
        assert!(!first.redelivered);
        // Handed back twice (a nack behind a blocked message, a crash): received three times,
        // still the first step of its schedule.
        let handed_back = Redelivery::default().report(Some(3));
        assert_eq!(
            (handed_back.redeliveries, handed_back.redelivered),
            (0, true)
        );
        // A redelivered copy: its own receive count starts again, its count goes on.
        let copy = Redelivery::read(Some("2"), None).report(Some(1));
        assert_eq!((copy.redeliveries, copy.redelivered), (2, true));
        assert_eq!(Redelivery::default().report(None).redeliveries, 0);
    }

    #[test]
    fn a_copy_is_hidden_until_due_at_most_twelve_hours_at_a_time() {
        let now = UNIX_EPOCH + 1000 * SECOND;
        let copy = RedeliveryCopy::plan(0, 90 * SECOND, now, true);
        assert_eq!(copy.count, 1);
        assert_eq!(
            copy.delay_seconds, None,
            "FIFO queues take no per-message delay"
        );
        let received = Redelivery::read(Some("1"), copy.due_attribute().as_deref());
        assert_eq!(received.on_receive(now), Arrival::HideFor(90 * SECOND));
        assert_eq!(
            received.on_receive(now + 89 * SECOND),
            Arrival::HideFor(SECOND)
        );
        assert_eq!(received.on_receive(now + 90 * SECOND), Arrival::Deliver);
        assert_eq!(received.on_receive(now + 95 * SECOND), Arrival::Deliver);

        let day = RedeliveryCopy::plan(2, 24 * 3600 * SECOND, now, false);
        assert_eq!((day.count, day.delay_seconds), (3, Some(900)));
        let received = Redelivery::read(Some("3"), day.due_attribute().as_deref());
        assert_eq!(
            received.on_receive(now + 900 * SECOND),
            Arrival::HideFor(MAX_HIDE)
        );
    }

    #[test]
    fn a_standard_queue_delays_up_to_fifteen_minutes_itself() {
        let now = UNIX_EPOCH;
        let short = RedeliveryCopy::plan(0, Duration::from_millis(1500), now, false);
        assert_eq!((short.delay_seconds, short.due), (Some(2), None));
        let quarter = RedeliveryCopy::plan(0, MAX_SEND_DELAY, now, false);
        assert_eq!((quarter.delay_seconds, quarter.due), (Some(900), None));
        let none = RedeliveryCopy::plan(4, Duration::ZERO, now, true);
        assert_eq!((none.count, none.delay_seconds, none.due), (5, None, None));
    }

    #[test]
    fn ownership_once_lost_stays_lost() {
        let held = Ownership::new();
        assert!(!held.is_lost());
        held.lose();
        assert!(held.is_lost());
    }

    #[test]
    fn no_kind_of_send_shares_a_deduplication_id_with_another() {
        let id = MessageId::generate();
        let ids = [
            DedupId::FirstSend(&id).value(),
            DedupId::Replay(id.as_str()).value(),
            DedupId::Redelivery(id.as_str()).value(),
            DedupId::DeadLetter(id.as_str()).value(),
        ];
        for (i, a) in ids.iter().enumerate() {
            assert!(fifo::is_valid_id(a), "{a}");
            for b in &ids[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(ids[0], id.as_str());
        assert_eq!(
            DedupId::Replay("dlq-1").value(),
            DedupId::Replay("dlq-1").value()
        );
        assert_ne!(
            DedupId::Replay("dlq-1").value(),
            DedupId::Replay("dlq-2").value()
        );
        assert_eq!(DedupId::Given("mine-1").value(), "mine-1");
        assert!(fifo::is_valid_id(&DedupId::Given("not valid here").value()));

        // The producer sends the header's ID where there is one, else the message ID.
        let mut message = OutgoingMessage::new(id.clone(), "{}");
        assert_eq!(send_dedup_id(&message), ids[0]);
        message.headers.push(replay_header("dlq-1"));
        assert_eq!(send_dedup_id(&message), DedupId::Replay("dlq-1").value());
    }
}
