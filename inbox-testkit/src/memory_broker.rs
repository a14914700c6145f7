use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use inbox_core::{
    Ack, Delivery, IdError, Message, MessageId, MessageSource, OutgoingMessage, Publish,
    PublishError, Recovery, SourceError,
};

/// An in-memory queue with at-least-once delivery.
#[derive(Debug, Clone, Default)]
pub struct MemoryBroker {
    inner: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    ready: VecDeque<Queued>,
    in_flight: HashMap<u64, (u64, Queued)>,
    dead: Vec<(Message, String)>,
    /// How many of the next dead letters fail.
    failing_dead_letters: u32,
    next_tag: u64,
    next_owner: u64,
    acked: u64,
    retention: Option<Duration>,
    /// Whether its sources report lanes ([`MemoryBroker::with_lanes`]).
    lanes: bool,
    next_seq: u64,
    /// Handles taken back by [`Redelivery::SilentStaleHandle`]: stale, but
    /// [`Ack::is_stale`] cannot tell.
    silent: HashSet<u64>,
}

impl State {
    /// Puts a message handed back ahead of the queue; with lanes, at its place in its lane, as
    /// a Kafka seek back or an SQS FIFO group keeps a lane's order whatever order the hand-backs
    /// come in.
    fn put_back(&mut self, queued: Queued) {
        if !self.lanes {
            self.ready.push_front(queued);
            return;
        }
        let lane = queued.message.meta.lane.clone();
        let same = |q: &Queued| q.message.meta.lane == lane;
        let at = self
            .ready
            .iter()
            .position(|q| same(q) && q.seq > queued.seq)
            .or_else(|| {
                self.ready
                    .iter()
                    .rposition(|q| same(q) && q.seq <= queued.seq)
                    .map(|i| i + 1)
            })
            .unwrap_or(0);
        self.ready.insert(at, queued);
    }
}

#[derive(Debug)]
struct Queued {
    message: Message,
    deliveries: u32,
    /// Times handed back under a redelivery schedule ([`Ack::redeliver`]).
    redeliveries: u32,
    not_before: Option<Instant>,
    /// A second copy of a delivery still in flight under this tag: taking it hands out the same
    /// handle again ([`Redelivery::SameHandle`]).
    copy_of: Option<u64>,
    /// Its place in the order of publishing, kept through redeliveries.
    seq: u64,
}

/// How [`MemoryBroker::redeliver`] hands out again what a consumer holds unsettled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redelivery {
    /// The broker takes the delivery back and hands it out anew: the old handle is stale, its
    /// ack, nack and dead letter do nothing (a Kafka partition revoked and assigned again, a
    /// visibility timeout that ran out, a Redis entry claimed by `XAUTOCLAIM`).
    StaleHandle,
    /// The broker hands the same entry out once more while the first copy is unsettled, and
    /// either copy's handle settles it (a Kafka seek back within one generation: both copies
    /// are one offset).
    SameHandle,
    /// As [`Redelivery::StaleHandle`], but the old handle cannot tell it went stale
    /// ([`Ack::is_stale`] stays `false`), as on a broker whose adapter learns it only later or
    /// never (an SQS receipt handle before the visibility heartbeat notices): the consumer holds
    /// both copies, and only its rule for a second copy keeps the message.
    SilentStaleHandle,
}

impl MemoryBroker {
    /// An empty broker: one queue, no lanes, so parallel lanes spread its messages in no order.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty broker whose messages carry ordering lanes: each message's is the one it was
    /// published with ([`Metadata::lane`](inbox_core::Metadata::lane)), as a Kafka partition,
    /// and its sources report lanes, so parallel lanes keep each lane's order. As a Kafka
    /// partition does, a lane keeps its order through hand-backs: a message handed back goes to
    /// its place in its lane, and while it waits out its nack delay nothing behind it in its lane
    /// is given out.
    pub fn with_lanes() -> Self {
        let broker = Self::default();
        broker.state().lanes = true;
        broker
    }

    fn state(&self) -> MutexGuard<'_, State> {
        crate::lock(&self.inner)
    }

    /// Enqueues a message with ID `id` (none when `None`) and `payload`.
    pub fn publish(&self, id: Option<&str>, payload: impl Into<Vec<u8>>) {
        let id = match id {
            Some(id) => MessageId::new(id).map_err(|reason| IdError::Invalid {
                field: "id".into(),
                reason,
            }),
            None => Err(IdError::Missing { field: "id".into() }),
        };
        self.publish_message(Message::new(id, payload));
    }

    /// Enqueues a message as given.
    pub fn publish_message(&self, mut message: Message) {
        message.meta.source = "memory".into();
        let mut state = self.state();
        state.next_seq += 1;
        let seq = state.next_seq;
        state.ready.push_back(Queued {
            message,
            deliveries: 0,
            redeliveries: 0,
            not_before: None,
            copy_of: None,
            seq,
        });
    }

    /// A new consumer connection. Dropping it returns its unacked deliveries to the queue.
    pub fn source(&self) -> MemorySource {
        let owner = {
            let mut state = self.state();
            state.next_owner += 1;
            state.next_owner
        };
        MemorySource {
            broker: self.clone(),
            owner,
            poll: Duration::from_millis(20),
        }
    }

    /// Says the broker keeps messages for `retention` (reported as its redelivery window).
    pub fn set_retention(&self, retention: Duration) {
        self.state().retention = Some(retention);
    }

    /// Messages not yet acked: ready or in flight.
    pub fn pending(&self) -> usize {
        let state = self.state();
        state.ready.len() + state.in_flight.len()
    }

    /// Messages handed out and not yet settled.
    pub fn in_flight(&self) -> usize {
        self.state().in_flight.len()
    }

    /// How many deliveries were acked.
    pub fn acked(&self) -> u64 {
        self.state().acked
    }

    /// The dead-lettered messages with their reasons.
    pub fn dead_letters(&self) -> Vec<(Message, String)> {
        self.state().dead.clone()
    }

    /// Makes the next `n` dead letters fail, as an unreachable dead-letter destination would:
    /// [`Ack::dead_letter`] then parks nothing, returns a [`Recovery::Retry`] error and puts the
    /// delivery back in the queue at once (no delay, to keep tests fast).
    pub fn fail_dead_letters(&self, n: u32) {
        self.state().failing_dead_letters = n;
    }

    /// Hands the deliveries of message `id` now in flight out again, ahead of the queue, as
    /// `how` says, while the consumer that holds them may still be working on them. Returns how
    /// many.
    pub fn redeliver(&self, id: &str, how: Redelivery) -> usize {
        let mut state = self.state();
        let mut tags: Vec<u64> = state
            .in_flight
            .iter()
            .filter(|(_, (_, q))| q.message.id.as_ref().is_ok_and(|m| m.as_str() == id))
            .map(|(tag, _)| *tag)
            .collect();
        tags.sort_unstable();
        for &tag in tags.iter().rev() {
            let copy = if how == Redelivery::SameHandle {
                let Some((_, queued)) = state.in_flight.get(&tag) else {
                    continue;
                };
                Queued {
                    message: queued.message.clone(),
                    not_before: None,
                    copy_of: Some(tag),
                    ..*queued
                }
            } else {
                let Some((_, queued)) = state.in_flight.remove(&tag) else {
                    continue;
                };
                if how == Redelivery::SilentStaleHandle {
                    state.silent.insert(tag);
                }
                queued
            };
            state.ready.push_front(copy);
        }
        tags.len()
    }

    /// Closes the connection of the source that [`MemorySource::connection`] named, as a broker
    /// does to a consumer it gave up on: every delivery it holds unsettled goes back to the
    /// queue, ahead of the rest, and its handles go stale (their ack, nack and dead letter do
    /// nothing). The source itself keeps receiving, as a new connection would. Returns how many
    /// deliveries went back.
    pub fn disconnect(&self, connection: Connection) -> usize {
        let mut state = self.state();
        let mut mine: Vec<u64> = state
            .in_flight
            .iter()
            .filter(|(_, (owner, _))| *owner == connection.0)
            .map(|(tag, _)| *tag)
            .collect();
        mine.sort_unstable();
        for &tag in mine.iter().rev() {
            if let Some((_, queued)) = state.in_flight.remove(&tag) {
                state.ready.push_front(queued);
            }
        }
        mine.len()
    }

    fn requeue(&self, tag: u64, delay: Option<Duration>) {
        let mut state = self.state();
        if let Some((_, mut queued)) = state.in_flight.remove(&tag) {
            queued.not_before = delay.map(|d| Instant::now() + d);
            state.put_back(queued);
        }
    }

    /// Requeues the delivery behind `delay` as redelivery `redelivery + 1` of a schedule.
    fn delay(&self, tag: u64, delay: Duration, redelivery: u32) {
        let mut state = self.state();
        if let Some((_, mut queued)) = state.in_flight.remove(&tag) {
            queued.not_before = Some(Instant::now() + delay);
            queued.redeliveries = redelivery + 1;
            state.ready.push_back(queued);
        }
    }
}

/// Names one [`MemorySource`]'s connection, for [`MemoryBroker::disconnect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection(u64);

/// One consumer's connection to a [`MemoryBroker`].
#[derive(Debug)]
pub struct MemorySource {
    broker: MemoryBroker,
    owner: u64,
    poll: Duration,
}

/// Acknowledges one [`MemoryBroker`] delivery.
#[derive(Debug)]
pub struct MemoryAck {
    broker: MemoryBroker,
    tag: u64,
}

impl Ack for MemoryAck {
    async fn ack(self) -> Result<(), SourceError> {
        let mut state = self.broker.state();
        if state.in_flight.remove(&self.tag).is_some() {
            state.acked += 1;
        }
        Ok(())
    }

    async fn nack(self, retry_after: Duration) -> Result<(), SourceError> {
        self.broker.requeue(self.tag, Some(retry_after));
        Ok(())
    }

    /// Requeued behind `delay`, its redelivery count carried with it.
    async fn redeliver(
        self,
        _message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        self.broker.delay(self.tag, delay, redelivery);
        Ok(())
    }

    /// The broker requeued or settled this delivery since it was handed out.
    fn is_stale(&self) -> bool {
        let state = self.broker.state();
        !state.in_flight.contains_key(&self.tag) && !state.silent.contains(&self.tag)
    }

    /// Keeps the message and reason for [`MemoryBroker::dead_letters`] and acks the delivery,
    /// in one step; see [`MemoryBroker::fail_dead_letters`] for a failing one.
    async fn dead_letter(self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let mut state = self.broker.state();
        if state.failing_dead_letters > 0 {
            state.failing_dead_letters -= 1;
            drop(state);
            self.broker.requeue(self.tag, None);
            return Err(SourceError::new(
                Recovery::Retry,
                "dead letter",
                format!("the memory broker was told to fail this dead letter ({reason})"),
            ));
        }
        state.dead.push((message.clone(), reason.to_owned()));
        if state.in_flight.remove(&self.tag).is_some() {
            state.acked += 1;
        }
        Ok(())
    }
}

impl MessageSource for MemorySource {
    type Ack = MemoryAck;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<MemoryAck>>, SourceError> {
        let batch = self.take(max);
        if batch.is_empty() {
            tokio::time::sleep(self.poll).await;
            return Ok(self.take(max));
        }
        Ok(batch)
    }

    fn redelivery_window(&self) -> Option<Duration> {
        self.broker.state().retention
    }

    /// Lanes when made [`MemoryBroker::with_lanes`].
    fn capabilities(&self) -> inbox_core::Capabilities {
        let capabilities = inbox_core::Capabilities::NONE
            .with_delivery_count()
            .with_delayed_nack()
            .with_delayed_redelivery();
        if self.broker.state().lanes {
            capabilities.with_lanes()
        } else {
            capabilities
        }
    }
}

impl MemorySource {
    /// This source's connection, to close it under a running consumer with
    /// [`MemoryBroker::disconnect`].
    pub fn connection(&self) -> Connection {
        Connection(self.owner)
    }

    fn take(&mut self, max: usize) -> Vec<Delivery<MemoryAck>> {
        let now = Instant::now();
        let mut state = self.broker.state();
        let mut batch = Vec::new();
        let mut waiting = VecDeque::new();
        // With lanes, a lane whose next message waits out its nack delay gives out nothing
        // behind it, as a Kafka partition sought back or an SQS FIFO group would not.
        let mut blocked: Vec<Option<String>> = Vec::new();
        let lanes = state.lanes;
        while batch.len() < max {
            let Some(queued) = state.ready.pop_front() else {
                break;
            };
            if queued.not_before.is_some_and(|t| t > now)
                || (lanes && blocked.contains(&queued.message.meta.lane))
            {
                if lanes {
                    blocked.push(queued.message.meta.lane.clone());
                }
                waiting.push_back(queued);
                continue;
            }
            let tag = match queued.copy_of {
                Some(tag) => tag,
                None => {
                    state.next_tag += 1;
                    let tag = state.next_tag;
                    state.in_flight.insert(tag, (self.owner, queued));
                    tag
                }
            };
            // A second copy goes under the first one's handle, unless that one settled meanwhile.
            let Some((_, first)) = state.in_flight.get_mut(&tag) else {
                continue;
            };
            first.deliveries += 1;
            let mut message = first.message.clone();
            message.meta.delivery_count = Some(first.deliveries);
            message.meta.redelivered = first.deliveries > 1;
            message.meta.redeliveries = first.redeliveries;
            message.meta.position = format!("tag {tag}");
            batch.push(Delivery {
                message,
                ack: MemoryAck {
                    broker: self.broker.clone(),
                    tag,
                },
            });
        }
        while let Some(queued) = waiting.pop_back() {
            state.ready.push_front(queued);
        }
        batch
    }
}

impl Drop for MemorySource {
    /// The connection closed: every delivery it had not acked goes back to the queue.
    fn drop(&mut self) {
        self.broker.disconnect(self.connection());
    }
}

/// Enqueues each message with its ID, key and headers, whatever the destination: the broker is
/// one queue. Route destinations to brokers with [`inbox_core::Destinations`].
impl Publish for MemoryBroker {
    async fn send_batch(
        &self,
        _destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        for outgoing in messages {
            let mut message = Message::new(Ok(outgoing.id.clone()), outgoing.payload.clone());
            message.key = outgoing.key.clone().map(String::into_bytes);
            message.headers = outgoing.headers.clone();
            self.publish_message(message);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_dead_letter_parks_and_acks_and_a_failed_one_hands_the_delivery_back() {
        let broker = MemoryBroker::new();
        broker.publish(Some("evt-1"), "x");
        let mut source = broker.source();
        broker.fail_dead_letters(1);

        let first = source.receive(1).await.unwrap().pop().unwrap();
        let e = first
            .ack
            .dead_letter(&first.message, "bad")
            .await
            .unwrap_err();
        assert_eq!(e.recovery(), Recovery::Retry);
        assert!(broker.dead_letters().is_empty());
        assert_eq!((broker.pending(), broker.acked()), (1, 0), "not acked");

        let again = source.receive(1).await.unwrap().pop().expect("handed back");
        assert_eq!(again.message.meta.delivery_count, Some(2));
        again.ack.dead_letter(&again.message, "bad").await.unwrap();
        let dead = broker.dead_letters();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].1, "bad");
        assert_eq!(
            (broker.pending(), broker.acked()),
            (0, 1),
            "parked and acked"
        );
    }
}
