//! The redelivery bookkeeping, as plain state: what a delivery's headers count, what a delayed
//! copy carries and where it goes, and which delay queues are known to exist.
//!
//! [`RabbitSource`](crate::RabbitSource) and [`RabbitAck`](crate::RabbitAck) read the headers,
//! publish and declare; the rules here take and give plain values (no AMQP types, no I/O, no
//! clock), so a simulation can drive the same rules over a model of the broker.

use std::collections::HashSet;
use std::time::Duration;

/// The quorum queue's count of earlier deliveries of a message, absent on its first.
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// What a delivery reports about its earlier deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// [`Metadata::delivery_count`](inbox_core::Metadata::delivery_count): one more than
    /// `x-delivery-count`; 1 for a first delivery without the header; `None` for a redelivery
    /// without it (a classic queue, which does not count).
    pub delivery_count: Option<u32>,
    /// [`Metadata::redelivered`](inbox_core::Metadata::redelivered): the broker's flag.
    pub redelivered: bool,
    /// [`Metadata::redeliveries`](inbox_core::Metadata::redeliveries): the
    /// [`REDELIVERY_COUNT`](inbox_core::REDELIVERY_COUNT) header of a delayed copy, else 0.
    pub redeliveries: u32,
}

impl Counts {
    /// The counts of a delivery with `x-delivery-count` = `delivery_count_header`, the broker's
    /// `redelivered` flag, and [`REDELIVERY_COUNT`](inbox_core::REDELIVERY_COUNT) =
    /// `redelivery_header` (each header `None` when absent or not a non-negative integer).
    pub fn read(
        delivery_count_header: Option<u64>,
        redelivered: bool,
        redelivery_header: Option<u64>,
    ) -> Self {
        let delivery_count = match delivery_count_header {
            Some(n) => u32::try_from(n.saturating_add(1)).ok(),
            None if !redelivered => Some(1),
            None => None,
        };
        Self {
            delivery_count,
            redelivered,
            redeliveries: redelivery_header
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(0),
        }
    }
}

/// A copy handed back under the redelivery schedule: where it waits, for how long, and the
/// count it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DelayedCopy {
    /// The delay queue: `<queue>.delay.<n>`, `n` the redelivery, from 0. Its expired messages
    /// go back to `<queue>`.
    pub queue: String,
    /// The copy's `expiration`, in whole milliseconds, at least 1 (0 would expire it at once).
    pub expiration_ms: u64,
    /// Its [`REDELIVERY_COUNT`](inbox_core::REDELIVERY_COUNT) header: `n + 1`.
    pub redeliveries: u32,
}

impl DelayedCopy {
    /// The copy of a message of `queue` handed back for redelivery `redelivery` (from 0), to
    /// wait `delay`.
    pub fn new(queue: &str, delay: Duration, redelivery: u32) -> Self {
        Self {
            queue: format!("{queue}.delay.{redelivery}"),
            expiration_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX).max(1),
            redeliveries: redelivery.saturating_add(1),
        }
    }

    /// Whether the copy keeps header `name` of the delivery: all but `x-delivery-count` (the
    /// copy is a new message to the queue, its count starts again) and the redelivery count,
    /// which the copy sets anew.
    pub fn keeps_header(name: &str) -> bool {
        name != DELIVERY_COUNT_HEADER && name != inbox_core::REDELIVERY_COUNT
    }
}

/// The delay queues declared on the publishing connection, so each is declared once per
/// connection, and again when the broker says it is gone.
#[derive(Debug, Default)]
pub struct DelayQueues {
    declared: HashSet<String>,
}

impl DelayQueues {
    /// Nothing declared yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `queue` must be declared before a copy is published to it.
    pub fn needs_declaring(&self, queue: &str) -> bool {
        !self.declared.contains(queue)
    }

    /// `queue` was declared (or found) on the current connection.
    pub fn declared(&mut self, queue: &str) {
        self.declared.insert(queue.to_owned());
    }

    /// A copy published to `queue` was unroutable: the queue is gone (deleted while the
    /// consumer ran), so it is declared again before the next publish.
    pub fn gone(&mut self, queue: &str) {
        self.declared.remove(queue);
    }

    /// A new publishing connection: what the old one declared is not known to exist any more.
    pub fn reconnected(&mut self) {
        self.declared.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_headers_count_deliveries_and_redeliveries() {
        let first = Counts::read(None, false, None);
        assert_eq!(
            first,
            Counts {
                delivery_count: Some(1),
                redelivered: false,
                redeliveries: 0
            }
        );
        // A quorum queue's third delivery of a delayed copy handed back twice.
        let third = Counts::read(Some(2), true, Some(2));
        assert_eq!((third.delivery_count, third.redeliveries), (Some(3), 2));
        // A classic queue redelivers without counting.
        assert_eq!(Counts::read(None, true, None).delivery_count, None);
        assert_eq!(
            Counts::read(Some(u64::MAX), true, None).delivery_count,
            None
        );
        assert_eq!(Counts::read(None, false, Some(u64::MAX)).redeliveries, 0);
    }

    #[test]
    fn a_delayed_copy_goes_to_its_steps_queue_with_the_next_count() {
        let copy = DelayedCopy::new("payments", Duration::from_millis(1500), 0);
        assert_eq!(
            copy,
            DelayedCopy {
                queue: "payments.delay.0".into(),
                expiration_ms: 1500,
                redeliveries: 1
            }
        );
        let copy = DelayedCopy::new("payments", Duration::from_micros(10), 2);
        assert_eq!(
            (copy.queue.as_str(), copy.expiration_ms),
            ("payments.delay.2", 1)
        );
        assert!(DelayedCopy::keeps_header("trace"));
        assert!(!DelayedCopy::keeps_header("x-delivery-count"));
        assert!(!DelayedCopy::keeps_header(inbox_core::REDELIVERY_COUNT));
    }

    #[test]
    fn a_delay_queue_is_declared_again_when_gone_or_on_a_new_connection() {
        let mut queues = DelayQueues::new();
        assert!(queues.needs_declaring("q.delay.0"));
        queues.declared("q.delay.0");
        queues.declared("q.delay.1");
        assert!(!queues.needs_declaring("q.delay.0"));
        queues.gone("q.delay.0");
        assert!(queues.needs_declaring("q.delay.0"));
        assert!(!queues.needs_declaring("q.delay.1"));
        queues.reconnected();
        assert!(queues.needs_declaring("q.delay.1"));
    }
}
