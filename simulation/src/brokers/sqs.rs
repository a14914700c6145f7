//! SQS, FIFO and standard: a simulated queue (its messages, receipt handles, visibility,
//! `ApproximateReceiveCount`, message attributes, `DelaySeconds`, a FIFO queue's message groups
//! and five-minute deduplication window) under the SQS adapter's own decisions
//! ([`inbox_sqs::delivery`]), taken where `inbox-sqs`'s source, acks and heartbeat take them:
//!
//! - what a received copy reports: [`Redelivery::read`] of its attributes, then
//!   [`Redelivery::report`] with its receive count; and whether it is handed out or hidden
//!   again until due ([`Redelivery::on_receive`]);
//! - what a delayed redelivery sends: the copy [`RedeliveryCopy::plan`] plans, carrying its
//!   count and due time as attributes (and a `DelaySeconds` on a standard queue), sent before
//!   the message is deleted with the delivery's receipt handle (a delete that fails leaves
//!   both);
//! - whether a delivery is stale: its [`Ownership`], lost when its visibility heartbeat finds
//!   the receipt handle refused (a seed-drawn chance on each heartbeat tick: the tick may come
//!   before the consumer gets to the delivery, or after, or never, the heartbeat being off);
//! - the FIFO deduplication ID of each send ([`DedupId`], [`send_dedup_id`]).
//!
//! SQS's own rules: a receive issues a new receipt handle and counts in
//! `ApproximateReceiveCount`; a delete or a visibility change takes only the latest handle (an
//! older one's delete succeeds and deletes nothing, a visibility change is refused, as it is
//! for a message no longer in flight); a standard queue hands out any visible message, a FIFO
//! queue the next messages of each group with none in flight, and drops a send whose
//! deduplication ID it saw in the last five minutes.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inbox_core::{Capabilities, MessageId, OutgoingMessage, SourceError};
use inbox_sqs::delivery::{
    send_dedup_id, whole_seconds, Arrival, DedupId, Ownership, Redelivery, RedeliveryCopy,
    DEDUPLICATION_ID_HEADER, MAX_HIDE, REDELIVERY_COUNT, REDELIVER_AT, SCHEDULE_ATTRIBUTES,
};
use rand::RngExt;
use tokio::time::Instant;

use crate::broker::{Broker, Conn, Handout};
use crate::world::Core;

pub(crate) use inbox_sqs::delivery::replay_header;

/// How long SQS FIFO drops a send whose deduplication ID it saw before.
const DEDUPLICATION_WINDOW: Duration = Duration::from_secs(300);
/// The source's visibility timeout: how long a received message stays hidden once no heartbeat
/// extends it (its consumer is gone, its delete failed).
const VISIBILITY: Duration = Duration::from_secs(3);
/// The most messages one `ReceiveMessage` returns.
const MAX_MESSAGES: usize = 10;
/// A FIFO queue's message groups (the consumer's lanes).
pub(crate) const GROUPS: usize = 3;
/// The wall clock when the seed starts, since the Unix epoch.
const EPOCH: Duration = Duration::from_secs(1_800_000_000);

/// One message in the queue: a first send, a redelivery's copy or a replay.
#[derive(Debug)]
struct Sent {
    /// The entry of [`Core::entries`] it carries.
    entry: usize,
    group: usize,
    /// The delayed redeliveries taken along its way, as the simulation counts them (not as
    /// its attributes say): what the consumer must pass when it asks for the next.
    lineage: u32,
    /// Message attributes, as sent.
    attributes: BTreeMap<String, String>,
    /// `ApproximateReceiveCount`.
    receives: u32,
    /// The receipt handle of the latest receive: the only one a delete or a visibility change
    /// takes.
    receipt: Option<u64>,
    /// In flight under its delivery's visibility heartbeat.
    extended: bool,
    /// Invisible until then: a visibility timeout, or a `DelaySeconds` before any receive.
    hidden_until: Option<Instant>,
    deleted: bool,
}

impl Sent {
    fn in_flight(&self, now: Instant) -> bool {
        !self.deleted
            && self.receipt.is_some()
            && (self.extended || self.hidden_until.is_some_and(|t| t > now))
    }

    fn visible(&self, now: Instant) -> bool {
        !self.deleted && !self.extended && self.hidden_until.is_none_or(|t| t <= now)
    }

    fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
}

/// A delivery handed out and not settled yet: its heartbeat runs.
#[derive(Debug)]
struct Out {
    conn: Conn,
    /// What the heartbeat tells the ack ([`inbox_core::Ack::is_stale`]).
    ownership: Ownership,
}

/// An SQS queue, FIFO or standard.
#[derive(Debug)]
pub(crate) struct Sqs {
    fifo: bool,
    messages: Vec<Sent>,
    /// FIFO: when each deduplication ID was last sent.
    deduplication: BTreeMap<String, Instant>,
    /// The message each receipt handle was issued for.
    receipts: BTreeMap<u64, usize>,
    out: BTreeMap<u64, Out>,
    next_receipt: u64,
    next_conn: Conn,
    /// Each consumer's clock, this far off (ms): a copy's due time is its sender's clock.
    skew: BTreeMap<Conn, i64>,
    start: Instant,
}

impl Sqs {
    pub(crate) fn new(fifo: bool) -> Self {
        Self {
            fifo,
            messages: Vec::new(),
            deduplication: BTreeMap::new(),
            receipts: BTreeMap::new(),
            out: BTreeMap::new(),
            next_receipt: 0,
            next_conn: 0,
            skew: BTreeMap::new(),
            start: Instant::now(),
        }
    }

    pub(crate) fn lanes(fifo: bool) -> usize {
        if fifo {
            GROUPS
        } else {
            1
        }
    }

    /// `conn`'s wall clock.
    fn clock(&self, conn: Conn) -> SystemTime {
        let now = UNIX_EPOCH + EPOCH + self.start.elapsed();
        let skew = self.skew.get(&conn).copied().unwrap_or(0);
        let off = Duration::from_millis(skew.unsigned_abs());
        if skew < 0 {
            now - off
        } else {
            now + off
        }
    }

    /// The message whose latest receipt handle is `receipt`: what a delete or a visibility
    /// change with it acts on.
    fn latest(&self, receipt: u64) -> Option<usize> {
        let m = *self.receipts.get(&receipt)?;
        (self.messages[m].receipt == Some(receipt) && !self.messages[m].deleted).then_some(m)
    }

    /// `SendMessage`: `false` when a FIFO queue dropped it as a copy of an earlier send.
    fn send_message(
        &mut self,
        entry: usize,
        group: usize,
        lineage: u32,
        attributes: BTreeMap<String, String>,
        delay_seconds: Option<i32>,
        deduplication: Option<String>,
    ) -> bool {
        let now = Instant::now();
        if let Some(id) = deduplication {
            if self
                .deduplication
                .get(&id)
                .is_some_and(|&sent| now < sent + DEDUPLICATION_WINDOW)
            {
                return false;
            }
            self.deduplication.insert(id, now);
        }
        let delay = delay_seconds.map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)));
        self.messages.push(Sent {
            entry,
            group,
            lineage,
            attributes,
            receives: 0,
            receipt: None,
            extended: false,
            hidden_until: delay.map(|d| now + d),
            deleted: false,
        });
        true
    }

    /// `DeleteMessage` with `receipt`: `true` when it deleted the message.
    fn delete(&mut self, receipt: u64) -> bool {
        self.out.remove(&receipt);
        let Some(m) = self.latest(receipt) else {
            return false;
        };
        let sent = &mut self.messages[m];
        sent.deleted = true;
        sent.extended = false;
        true
    }

    /// `ChangeMessageVisibility` with `receipt` to `seconds`: refused unless `receipt` is the
    /// latest and the message in flight.
    fn change_visibility(&mut self, receipt: u64, seconds: i32) {
        let now = Instant::now();
        let Some(m) = self.latest(receipt) else {
            return;
        };
        let sent = &mut self.messages[m];
        if sent.in_flight(now) {
            sent.extended = false;
            sent.hidden_until =
                Some(now + Duration::from_secs(u64::try_from(seconds).unwrap_or(0)));
        }
    }

    /// The heartbeat of `receipt`'s delivery stops: a message it kept in flight is visible
    /// again after the visibility timeout.
    fn stop_heartbeat(&mut self, receipt: u64) {
        self.out.remove(&receipt);
        if let Some(m) = self.latest(receipt) {
            let sent = &mut self.messages[m];
            if sent.extended {
                sent.extended = false;
                sent.hidden_until = Some(Instant::now() + VISIBILITY);
            }
        }
    }

    /// Each running heartbeat ticks: one whose receipt handle SQS refuses (the message was
    /// received again, deleted, or is no longer in flight) marks its delivery's ownership lost,
    /// if the tick comes at all before the consumer looks.
    fn heartbeats(&mut self, core: &mut Core) {
        let now = Instant::now();
        let receipts: Vec<u64> = self.out.keys().copied().collect();
        for receipt in receipts {
            let refused = self
                .latest(receipt)
                .is_none_or(|m| !self.messages[m].in_flight(now));
            let out = &self.out[&receipt];
            if refused && !out.ownership.is_lost() && core.rng.random_bool(0.5) {
                out.ownership.lose();
                core.note(format!(
                    "heartbeat of handle {receipt}: receipt handle refused, ownership lost"
                ));
            }
        }
    }
}

impl Broker for Sqs {
    /// As `SqsSource::capabilities`.
    fn capabilities(&self) -> Capabilities {
        let capabilities = Capabilities::NONE
            .with_delivery_count()
            .with_delayed_nack()
            .with_delayed_redelivery();
        if self.fifo {
            capabilities.with_lanes()
        } else {
            capabilities
        }
    }

    fn connect(&mut self, core: &mut Core) -> Conn {
        self.next_conn += 1;
        let skew = core.rng.random_range(-500..=500);
        self.skew.insert(self.next_conn, skew);
        self.next_conn
    }

    /// The consumer is gone: its heartbeats stop, and what they kept in flight is visible again
    /// after the visibility timeout.
    fn disconnect(&mut self, _core: &mut Core, conn: Conn) {
        let receipts: Vec<u64> = self
            .out
            .iter()
            .filter(|(_, out)| out.conn == conn)
            .map(|(&receipt, _)| receipt)
            .collect();
        for receipt in receipts {
            self.stop_heartbeat(receipt);
        }
    }

    /// The producer's send: on a FIFO queue deduplicated on the message ID
    /// ([`DedupId::FirstSend`]), so a producer's resend within five minutes is dropped.
    fn publish(&mut self, core: &mut Core, i: usize) {
        let id = MessageId::new(core.entries[i].id.clone()).unwrap();
        let deduplication = self.fifo.then(|| DedupId::FirstSend(&id).value());
        let group = core.entries[i].lane % Self::lanes(self.fifo);
        if !self.send_message(i, group, 0, BTreeMap::new(), None, deduplication) {
            core.note(format!(
                "entry {i} ({id}) dropped by SQS FIFO's deduplication: a resend within five \
                 minutes"
            ));
        }
    }

    /// A replay's send, as `SqsProducer` sends it: its headers as attributes, on a FIFO queue
    /// under [`send_dedup_id`].
    fn send(&mut self, core: &mut Core, i: usize, message: &OutgoingMessage) -> bool {
        let attributes = message
            .headers
            .iter()
            .filter(|(name, _)| name != DEDUPLICATION_ID_HEADER)
            .map(|(name, value)| (name.clone(), String::from_utf8_lossy(value).into_owned()))
            .collect();
        let deduplication = self.fifo.then(|| send_dedup_id(message));
        let group = core.entries[i].lane % Self::lanes(self.fifo);
        if self.send_message(i, group, 0, attributes, None, deduplication) {
            true
        } else {
            core.entries.pop();
            false
        }
    }

    /// A visibility timeout runs out (the heartbeat could not extend it), and the heartbeats
    /// tick.
    fn disturb(&mut self, core: &mut Core, _conn: Conn) {
        let held: Vec<usize> = (0..self.messages.len())
            .filter(|&m| self.messages[m].extended)
            .collect();
        if !held.is_empty() {
            let m = held[core.rng.random_range(0..held.len())];
            let sent = &mut self.messages[m];
            sent.extended = false;
            sent.hidden_until = None;
            core.note(format!(
                "message {m} (entry {}): visibility ran out, visible again",
                sent.entry
            ));
        }
        self.heartbeats(core);
    }

    /// `ReceiveMessage`, then what `SqsSource` does with each message received: a copy not due
    /// yet is hidden until it is, the others handed out with what they report.
    fn receive(&mut self, core: &mut Core, conn: Conn, max: usize) -> Vec<Handout> {
        let now = Instant::now();
        let wall = self.clock(conn);
        let max = max.clamp(1, MAX_MESSAGES);
        // A FIFO group with a message in flight gives out nothing; an open one its messages in
        // order, several in one receive.
        let open: Vec<bool> = (0..Self::lanes(self.fifo))
            .map(|g| {
                !self.fifo
                    || !self
                        .messages
                        .iter()
                        .any(|s| s.group == g && s.in_flight(now))
            })
            .collect();
        let mut batch = Vec::new();
        for _ in 0..max {
            let candidates: Vec<usize> = if self.fifo {
                (0..GROUPS)
                    .filter(|&g| open[g])
                    .filter_map(|g| {
                        (0..self.messages.len()).find(|&m| {
                            let s = &self.messages[m];
                            s.group == g && !s.deleted && !s.in_flight(now)
                        })
                    })
                    .filter(|&m| self.messages[m].visible(now))
                    .collect()
            } else {
                (0..self.messages.len())
                    .filter(|&m| self.messages[m].visible(now))
                    .collect()
            };
            if candidates.is_empty() {
                break;
            }
            let m = candidates[core.rng.random_range(0..candidates.len())];
            self.next_receipt += 1;
            let receipt = self.next_receipt;
            self.receipts.insert(receipt, m);
            let hide_fails = core.fault(0.03);
            let sent = &mut self.messages[m];
            sent.receives += 1;
            sent.receipt = Some(receipt);
            let redelivery = Redelivery::read(
                sent.attribute(REDELIVERY_COUNT),
                sent.attribute(REDELIVER_AT),
            );
            match redelivery.on_receive(wall) {
                Arrival::HideFor(left) => {
                    // `ChangeMessageVisibility` to the time left; when it fails, the copy
                    // comes back after the visibility timeout and is hidden again.
                    let hide = if hide_fails {
                        VISIBILITY
                    } else {
                        let seconds = whole_seconds(left.min(MAX_HIDE));
                        Duration::from_secs(u64::try_from(seconds).unwrap_or(0))
                    };
                    sent.extended = false;
                    sent.hidden_until = Some(now + hide);
                    let entry = sent.entry;
                    core.note(format!(
                        "message {m} (entry {entry}) received before due: hidden for {hide:?}"
                    ));
                }
                Arrival::Deliver => {
                    sent.extended = true;
                    sent.hidden_until = None;
                    let reported = redelivery.report(Some(sent.receives));
                    batch.push(Handout {
                        entry: sent.entry,
                        handle: receipt,
                        lane: self.fifo.then_some(sent.group),
                        delivery_count: reported.delivery_count,
                        redeliveries: reported.redeliveries,
                    });
                    self.out.insert(
                        receipt,
                        Out {
                            conn,
                            ownership: Ownership::new(),
                        },
                    );
                }
            }
        }
        batch
    }

    fn ack(&mut self, _core: &mut Core, _conn: Conn, h: &Handout) -> bool {
        self.delete(h.handle)
    }

    /// As `SqsAck::nack`: the visibility changed to the delay, whole seconds rounded up; a
    /// stale handle's change is refused and does nothing.
    fn nack(&mut self, _core: &mut Core, _conn: Conn, h: &Handout, retry_after: Duration) {
        self.out.remove(&h.handle);
        self.change_visibility(h.handle, whole_seconds(retry_after.min(MAX_HIDE)));
    }

    /// As `SqsAck::redeliver`: the copy sent, then the message deleted with this delivery's
    /// receipt handle, whether or not it is still the latest (the adapter cannot tell). A
    /// delete that fails leaves both.
    fn redeliver(
        &mut self,
        core: &mut Core,
        conn: Conn,
        h: &Handout,
        delay: Duration,
        redelivery: u32,
    ) -> Result<bool, SourceError> {
        let copy = RedeliveryCopy::plan(redelivery, delay, self.clock(conn), self.fifo);
        let m = self.receipts[&h.handle];
        let mut attributes = self.messages[m].attributes.clone();
        attributes.retain(|name, _| !SCHEDULE_ATTRIBUTES.contains(&name.as_str()));
        attributes.insert(REDELIVERY_COUNT.to_owned(), copy.count.to_string());
        if let Some(due) = copy.due_attribute() {
            attributes.insert(REDELIVER_AT.to_owned(), due);
        }
        let receipt = format!("receipt {}", h.handle);
        let deduplication = self.fifo.then(|| DedupId::Redelivery(&receipt).value());
        let Sent {
            entry,
            group,
            lineage,
            ..
        } = self.messages[m];
        let sent = self.send_message(
            entry,
            group,
            lineage + 1,
            attributes,
            copy.delay_seconds,
            deduplication,
        );
        let copied = self.messages.len() - 1;
        core.note(format!(
            "message {copied}: entry {entry}'s copy for redelivery {}{}",
            copy.count,
            if sent {
                ""
            } else {
                ", dropped by deduplication"
            }
        ));
        if core.fault(0.05) {
            core.note(format!(
                "delete of message {m} after its copy fails: both stay"
            ));
            self.stop_heartbeat(h.handle);
        } else {
            self.delete(h.handle);
        }
        Ok(true)
    }

    fn dead_letter(&mut self, _core: &mut Core, _conn: Conn, h: &Handout) -> bool {
        self.delete(h.handle)
    }

    /// Each copy carries its own count: one left beside its original goes its own way.
    fn redeliveries_asked(&self, h: &Handout) -> Option<u32> {
        let &m = self.receipts.get(&h.handle)?;
        Some(self.messages[m].lineage)
    }

    fn redelivery_to_back(&self) -> bool {
        self.fifo
    }

    /// As `SqsAck::is_stale`: whether the delivery's heartbeat lost its ownership.
    fn is_stale(&self, _core: &Core, _conn: Conn, h: &Handout) -> bool {
        self.out
            .get(&h.handle)
            .is_some_and(|out| out.ownership.is_lost())
    }

    fn open(&self) -> usize {
        self.messages.iter().filter(|s| !s.deleted).count()
    }
}
