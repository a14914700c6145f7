//! RabbitMQ: a quorum queue and its delay queues, read over channels, under the RabbitMQ
//! adapter's own rules ([`inbox_rabbitmq::redelivery`], [`inbox_rabbitmq::unsettled`]), taken
//! where `inbox-rabbitmq`'s source, acks and dead-letter publisher take them:
//!
//! - what a delivery reports: [`Counts::read`] of its `x-delivery-count` header, its
//!   `redelivered` flag and its [`REDELIVERY_COUNT`] header (`RabbitSource::convert`);
//! - what a batch's ack may cover: each channel's [`Unsettled`], a tag tracked when the consumer
//!   receives it and settled once its ack or nack frame is sent, never for a frame that failed;
//!   a batch acked as [`Unsettled::plan`] says, one `multiple` ack and then single acks, up to
//!   the first that fails (`RabbitAck::ack_all`);
//! - a nack: a delayed requeue, its frame sent once the wait is over, and dropped when the
//!   channel closed meanwhile (`RabbitAck::nack`);
//! - a delayed redelivery: the [`DelayedCopy`] (its delay queue, its `expiration`, the headers it
//!   keeps, its count), published on the source's dead-letter connection after its delay queue is
//!   declared where [`DelayQueues`] says it must be (a new connection forgets what the last one
//!   declared), declared again and published once more when the copy comes back unroutable;
//!   then the delivery is acked. A publish that fails hands the delivery back after
//!   `RETRY_AFTER` (`DeadLetters::delay`, `RabbitAck::redeliver`).
//!
//! RabbitMQ's own rules, kept here: a channel numbers its deliveries from tag 1 and pushes ready
//! messages up to its prefetch window (twice the first receive's batch, at least 20); an ack
//! settles its tag, or with `multiple` every tag of the channel up to it still unsettled; an ack
//! or nack of a tag the channel does not hold closes the channel (`PRECONDITION_FAILED`), and a
//! closed channel requeues what it held. A requeued message goes back to its place in the queue
//! with `redelivered` set and `x-delivery-count` raised (a quorum queue before 4.3, where a nack
//! counts as a close does), and past `x-delivery-limit` the queue dead-letters it to
//! `<queue>.dlq`. A copy expires only at the head of its delay queue, and is then dead-lettered
//! back to the queue, at least once (now and then twice). A publish to a queue that does not
//! exist comes back unroutable.
//!
//! The faults, drawn from the seed: the consuming connection lost (its channel closes), the
//! dead-letter connection lost, an empty delay queue deleted (an operator's cleanup: the adapter
//! must declare it again), ack and nack frames that fail on a channel that stays open, and a
//! copy's publish that fails (opening the connection, the declare, a `basic.nack`, a confirm
//! that times out whether or not the copy landed).
//!
//! [`channel`] keeps the channels, [`delay`] the delay queues and the dead-letter connection.
//!
//! [`Unsettled`]: inbox_rabbitmq::unsettled::Unsettled
//! [`Unsettled::plan`]: inbox_rabbitmq::unsettled::Unsettled::plan

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use inbox_core::dead_letter::RETRY_AFTER;
use inbox_core::{Capabilities, Recovery, SourceError, REDELIVERY_COUNT};
use inbox_rabbitmq::redelivery::{Counts, DelayQueues, DelayedCopy, DELIVERY_COUNT_HEADER};
use inbox_rabbitmq::unsettled::AckPlan;
use rand::RngExt;
use tokio::time::Instant;

use crate::broker::{Broker, Conn, Handout};
use crate::replay::Letter;
use crate::world::Core;

mod channel;
mod delay;

use channel::{Channel, Delivered};
use delay::DelayQueue;

/// The queue consumed.
const QUEUE: &str = "queue";
/// The queue's `x-delivery-limit` unless the seed draws a lower one: the adapter's default.
const DELIVERY_LIMIT: u32 = 20;
/// The smallest prefetch window the source sets (`RabbitSourceBuilder::prefetch_for`).
const MIN_PREFETCH: usize = 20;

/// A message's AMQP headers, as far as the adapter reads them: integers.
type Headers = BTreeMap<String, u64>;

/// Where a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Ready,
    /// Delivered on a channel and not settled.
    Out,
    /// Waiting in a delay queue.
    Delayed,
    /// Acked, or dead-lettered to `<queue>.dlq`.
    Gone,
}

/// One message: a first publish, a replay, or a delayed copy.
#[derive(Debug, Clone)]
struct Msg {
    /// The entry of [`Core::entries`] it carries.
    entry: usize,
    /// Its headers as published.
    headers: Headers,
    /// The delayed redeliveries taken along its way, as the simulation counts them (not as its
    /// headers say): what the consumer must pass when it asks for the next.
    lineage: u32,
    /// The quorum queue's count of its returns: `x-delivery-count`.
    returns: u32,
    /// Its place in the queue: a requeued message goes back there.
    position: u64,
    place: Place,
}

/// One `RabbitSource`: its consuming channel and its dead-letter publisher.
#[derive(Debug)]
struct Source {
    /// The channel consumed, from the first receive on.
    link: Option<usize>,
    /// Whether the dead-letter connection is open.
    publisher: bool,
    /// `DeadLetters::delay_queues`.
    delay_queues: DelayQueues,
}

/// A quorum queue with its delay queues and dead-letter queue.
#[derive(Debug, Default)]
pub(crate) struct RabbitMq {
    messages: Vec<Msg>,
    next_position: u64,
    channels: Vec<Channel>,
    /// Every delivery, by handle.
    deliveries: BTreeMap<u64, Delivered>,
    next_handle: u64,
    sources: BTreeMap<Conn, Source>,
    next_conn: Conn,
    delay_queues: BTreeMap<String, DelayQueue>,
    /// Delayed nacks: when each frame goes out, and its delivery.
    nacks: Vec<(Instant, u64)>,
    /// `x-delivery-limit`, drawn at the first connection.
    delivery_limit: Option<u32>,
}

fn error(recovery: Recovery, context: &str, why: &str) -> SourceError {
    SourceError::new(recovery, context, why.to_owned())
}

impl RabbitMq {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A message at the back of the queue, or of a delay queue.
    fn add(&mut self, entry: usize, headers: Headers, lineage: u32, place: Place) -> usize {
        self.next_position += 1;
        self.messages.push(Msg {
            entry,
            headers,
            lineage,
            returns: 0,
            position: self.next_position,
            place,
        });
        self.messages.len() - 1
    }

    fn source(&mut self, conn: Conn) -> &mut Source {
        self.sources.get_mut(&conn).unwrap()
    }

    /// The message goes back to its place with its count raised; past the delivery limit the
    /// queue dead-letters it.
    fn requeue(&mut self, core: &mut Core, m: usize) {
        let limit = self.delivery_limit.unwrap_or(DELIVERY_LIMIT);
        let msg = &mut self.messages[m];
        msg.returns += 1;
        if msg.returns <= limit {
            msg.place = Place::Ready;
            return;
        }
        msg.place = Place::Gone;
        let (entry, returns) = (msg.entry, msg.returns);
        let id = core.entries[entry].id.clone();
        *core.parked.entry(id.clone()).or_default() += 1;
        let position = format!("letter {}", core.parked.values().sum::<u32>());
        core.letters.push(Letter {
            position,
            entry,
            id: id.clone(),
        });
        core.note(format!(
            "message {m} (entry {entry}, {id}) returned {returns} times, past x-delivery-limit \
             {limit}: the queue dead-letters it"
        ));
    }

    /// What came due by now on its own: the delayed nacks whose wait is over are sent, and the
    /// copies expired at the head of their delay queue go back to the queue.
    fn tick(&mut self, core: &mut Core) {
        let now = Instant::now();
        self.nacks.sort_by_key(|&(at, _)| at);
        let due = self.nacks.partition_point(|&(at, _)| at <= now);
        let sent: Vec<(Instant, u64)> = self.nacks.drain(..due).collect();
        for (_, handle) in sent {
            self.link_nack(core, handle);
        }
        self.expire(core, now);
    }

    fn handle(&self, h: &Handout) -> (usize, u64) {
        let d = &self.deliveries[&h.handle];
        (d.channel, d.tag)
    }
}

impl Broker for RabbitMq {
    /// As `RabbitSource::capabilities` with `Topology::Declare`: a quorum queue.
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
            .with_delivery_count()
            .with_delayed_redelivery()
    }

    fn connect(&mut self, core: &mut Core) -> Conn {
        if self.delivery_limit.is_none() {
            let limit = if core.rng.random_bool(0.3) {
                core.rng.random_range(2..=6)
            } else {
                DELIVERY_LIMIT
            };
            self.delivery_limit = Some(limit);
            core.note(format!("x-delivery-limit {limit}"));
        }
        self.next_conn += 1;
        self.sources.insert(
            self.next_conn,
            Source {
                link: None,
                publisher: false,
                delay_queues: DelayQueues::new(),
            },
        );
        self.next_conn
    }

    /// The connections close: their channels requeue what they held, and the delayed nacks
    /// still waiting are never sent.
    fn disconnect(&mut self, core: &mut Core, conn: Conn) {
        self.tick(core);
        for c in 0..self.channels.len() {
            if self.channels[c].conn == conn {
                self.close(core, c, "its connection closed");
            }
        }
        self.source(conn).publisher = false;
    }

    fn publish(&mut self, _core: &mut Core, i: usize) {
        self.add(i, Headers::new(), 0, Place::Ready);
    }

    /// One of what can happen: the consuming connection is lost, or the dead-letter connection,
    /// or an operator deletes an empty delay queue.
    fn disturb(&mut self, core: &mut Core, conn: Conn) {
        self.tick(core);
        let link = self.source(conn).link.filter(|&c| self.channels[c].open);
        let publisher = self.source(conn).publisher;
        let empty: Vec<String> = self
            .delay_queues
            .iter()
            .filter(|(_, q)| q.exists && q.waiting.is_empty())
            .map(|(name, _)| name.clone())
            .collect();
        let mut events = Vec::new();
        events.extend(link.map(|_| 0));
        events.extend(publisher.then_some(1));
        events.extend((!empty.is_empty()).then_some(2));
        if events.is_empty() {
            return;
        }
        match events[core.rng.random_range(0..events.len())] {
            0 => self.close(core, link.unwrap(), "the connection is lost"),
            1 => {
                self.source(conn).publisher = false;
                core.note(format!(
                    "connection {conn}: the dead-letter connection is lost"
                ));
            }
            _ => {
                let name = empty[core.rng.random_range(0..empty.len())].clone();
                self.delete_if_empty(core, &name);
            }
        }
    }

    /// The broker pushes ready messages in queue order as the prefetch window allows (how many
    /// reach the channel before the receive takes its batch is the seed's); `RabbitSource::
    /// receive` takes what is buffered, up to `max`, each reporting [`Counts::read`] of what it
    /// carries and tracked as unsettled.
    fn receive(&mut self, core: &mut Core, conn: Conn, max: usize) -> Vec<Handout> {
        self.tick(core);
        let c = self.link(core, conn);
        let ch = &mut self.channels[c];
        let window = *ch.prefetch.get_or_insert((2 * max).max(MIN_PREFETCH));
        let credit = window.saturating_sub(ch.unacked.len());
        let wanted = max.saturating_sub(ch.buffer.len()) + core.rng.random_range(0..=3);
        let mut ready: Vec<usize> = (0..self.messages.len())
            .filter(|&m| self.messages[m].place == Place::Ready)
            .collect();
        ready.sort_by_key(|&m| self.messages[m].position);
        ready.truncate(credit.min(wanted));
        if !ready.is_empty() {
            let lines: Vec<String> = ready.into_iter().map(|m| self.deliver(c, m)).collect();
            core.note(format!("channel {c} delivers {}", lines.join(", ")));
        }
        let ch = &mut self.channels[c];
        let n = max.min(ch.buffer.len());
        let taken: Vec<u64> = ch.buffer.drain(..n).collect();
        taken
            .into_iter()
            .map(|handle| {
                let d = &self.deliveries[&handle];
                let header = |name: &str| d.headers.get(name).copied();
                let counts = Counts::read(
                    header(DELIVERY_COUNT_HEADER),
                    d.redelivered,
                    header(REDELIVERY_COUNT),
                );
                self.channels[c].unsettled.track(d.tag);
                Handout {
                    entry: self.messages[d.msg].entry,
                    handle,
                    lane: None,
                    delivery_count: counts.delivery_count,
                    redeliveries: counts.redeliveries,
                }
            })
            .collect()
    }

    fn ack(&mut self, core: &mut Core, _conn: Conn, h: &Handout) -> bool {
        self.tick(core);
        let (c, tag) = self.handle(h);
        self.link_ack(core, c, tag, false, false).is_ok()
    }

    /// `RabbitAck::ack_all`: per channel, the plan of its unsettled tags, one `multiple` ack,
    /// then single acks up to the first that fails.
    fn ack_all(
        &mut self,
        core: &mut Core,
        _conn: Conn,
        hs: &[Handout],
    ) -> Option<Result<(), SourceError>> {
        self.tick(core);
        let mut groups: BTreeMap<usize, BTreeSet<u64>> = BTreeMap::new();
        for h in hs {
            let (c, tag) = self.handle(h);
            groups.entry(c).or_default().insert(tag);
        }
        let mut first_error = None;
        for (c, tags) in groups {
            let AckPlan {
                multiple_up_to,
                singles,
            } = self.channels[c].unsettled.plan(&tags);
            let mut result = Ok(());
            if let Some(last) = multiple_up_to {
                result = self.link_ack(core, c, last, true, true);
            }
            for tag in singles {
                if result.is_err() {
                    break;
                }
                result = self.link_ack(core, c, tag, false, true);
            }
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        Some(first_error.map_or(Ok(()), Err))
    }

    /// `RabbitAck::nack`: at once, or a delayed requeue.
    fn nack(&mut self, core: &mut Core, _conn: Conn, h: &Handout, retry_after: Duration) {
        self.tick(core);
        if retry_after.is_zero() {
            self.link_nack(core, h.handle);
        } else {
            self.nacks.push((Instant::now() + retry_after, h.handle));
        }
    }

    /// `RabbitAck::redeliver`: the copy published to its delay queue, then the delivery acked;
    /// a publish that fails hands the delivery back after `RETRY_AFTER`.
    fn redeliver(
        &mut self,
        core: &mut Core,
        conn: Conn,
        h: &Handout,
        delay: Duration,
        redelivery: u32,
    ) -> Result<bool, SourceError> {
        self.tick(core);
        let copy = DelayedCopy::new(QUEUE, delay, redelivery);
        let d = &self.deliveries[&h.handle];
        let (c, tag) = (d.channel, d.tag);
        let mut headers: Headers = d
            .headers
            .iter()
            .filter(|(name, _)| DelayedCopy::keeps_header(name))
            .map(|(name, value)| (name.clone(), *value))
            .collect();
        headers.insert(REDELIVERY_COUNT.to_owned(), u64::from(copy.redeliveries));
        let lineage = self.messages[d.msg].lineage + 1;
        match self.delay(core, conn, &copy, h.entry, &headers, lineage) {
            Ok(()) => self.link_ack(core, c, tag, false, false).map(|()| true),
            Err(e) => {
                self.nacks.push((Instant::now() + RETRY_AFTER, h.handle));
                Err(e)
            }
        }
    }

    /// `RabbitAck::dead_letter`, the letter parked: on the dead-letter connection (opened if it
    /// was not), then the delivery acked.
    fn dead_letter(&mut self, core: &mut Core, conn: Conn, h: &Handout) -> bool {
        self.tick(core);
        let opened = self.publisher(core, conn, false);
        debug_assert!(opened.is_ok());
        let (c, tag) = self.handle(h);
        self.link_ack(core, c, tag, false, false).is_ok()
    }

    /// Each copy carries its own count: one beside its original goes its own way.
    fn redeliveries_asked(&self, h: &Handout) -> Option<u32> {
        let d = self.deliveries.get(&h.handle)?;
        Some(self.messages[d.msg].lineage)
    }

    fn is_stale(&self, _core: &Core, _conn: Conn, _h: &Handout) -> bool {
        false
    }

    fn open(&self) -> usize {
        self.messages
            .iter()
            .filter(|m| m.place != Place::Gone)
            .count()
    }
}
