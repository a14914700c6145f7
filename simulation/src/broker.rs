//! A simulated broker as the consumer sees it: [`SimSource`] and [`SimAck`] over any
//! [`Broker`], which keeps its broker's rules (and, where an adapter keeps bookkeeping of its
//! own, that adapter's real state).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{
    Ack, Capabilities, Delivery, Message, MessageId, MessageSource, OutgoingMessage, Recovery,
    SourceError,
};

use crate::replay::Letter;
use crate::world::{world, Core, Shared};

/// One consumer's connection to the broker.
pub(crate) type Conn = u64;

/// One delivery as the broker handed it out: what its ack handle carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Handout {
    /// The entry, by index into [`Core::entries`].
    pub(crate) entry: usize,
    /// The broker's handle: a receipt, a generation, a delivery tag.
    pub(crate) handle: u64,
    /// The ordering lane, where the broker keeps one.
    pub(crate) lane: Option<usize>,
    /// `Metadata::delivery_count`, where the broker counts.
    pub(crate) delivery_count: Option<u32>,
    /// `Metadata::redeliveries`: the redeliveries the consumer asked for so far, as the
    /// broker (or the adapter's bookkeeping) counted them.
    pub(crate) redeliveries: u32,
}

/// A broker's rules: what it hands out, to whom, and what each settlement does. Every method
/// runs under the world's lock, on the paused clock.
pub(crate) trait Broker: Debug + Send {
    /// What the source reports.
    fn capabilities(&self) -> Capabilities;
    /// A consumer connects.
    fn connect(&mut self, core: &mut Core) -> Conn;
    /// A consumer is gone (crashed or stopped): what it held comes back.
    fn disconnect(&mut self, core: &mut Core, conn: Conn);
    /// Publishes entry `i` of [`Core::entries`].
    fn publish(&mut self, core: &mut Core, i: usize);
    /// Publishes entry `i`, a copy of a dead letter sent back by a replay as `message`;
    /// `false` when the broker dropped it (a deduplication window).
    fn send(&mut self, core: &mut Core, i: usize, message: &OutgoingMessage) -> bool {
        let _ = message;
        self.publish(core, i);
        true
    }
    /// What the broker does on its own before a receive, when the seed says so: a visibility
    /// timeout running out, a rebalance, an `XAUTOCLAIM`.
    fn disturb(&mut self, core: &mut Core, conn: Conn);
    /// Up to `max` deliveries for `conn`.
    fn receive(&mut self, core: &mut Core, conn: Conn, max: usize) -> Vec<Handout>;
    /// Settles the delivery; `true` when it settled the entry (not a stale handle).
    fn ack(&mut self, core: &mut Core, conn: Conn, h: &Handout) -> bool;
    /// Hands the delivery back.
    fn nack(&mut self, core: &mut Core, conn: Conn, h: &Handout, retry_after: Duration);
    /// Hands the delivery back for redelivery `redelivery + 1`, after `delay`: `Ok(true)` when
    /// the broker took it, `Ok(false)` for a stale handle's request, or the error the adapter
    /// returns (the delivery then handed back as the adapter does).
    fn redeliver(
        &mut self,
        core: &mut Core,
        conn: Conn,
        h: &Handout,
        delay: Duration,
        redelivery: u32,
    ) -> Result<bool, SourceError>;
    /// Acks a batch as the adapter's `Ack::ack_all` does, where that is more than one ack after
    /// another (RabbitMQ's `multiple` ack), checking and noting each entry it acks; `None`: one
    /// by one, as [`Ack::ack_all`]'s default.
    fn ack_all(
        &mut self,
        core: &mut Core,
        conn: Conn,
        hs: &[Handout],
    ) -> Option<Result<(), SourceError>> {
        let _ = (core, conn, hs);
        None
    }
    /// Settles the delivery as dead-lettered (the letter is already kept); `true` when it
    /// settled the entry.
    fn dead_letter(&mut self, core: &mut Core, conn: Conn, h: &Handout) -> bool;
    /// How many delayed redeliveries were asked for along the way of the message `h` carries,
    /// where the broker tells a message's copies apart (an SQS copy left beside its original by
    /// a delete that failed goes on from its own count); `None`: per entry, as
    /// [`Core::redeliveries`] counts them.
    fn redeliveries_asked(&self, h: &Handout) -> Option<u32> {
        let _ = h;
        None
    }
    /// The lowest count a redelivery of `h` may report, where it is lower than the hand-backs
    /// so far: Kafka's committed count, when the commits that carried later ones were refused
    /// (the member that made them goes on from its own count; another starts from the broker's).
    /// Default: none lower.
    fn redelivery_floor(&self, h: &Handout) -> Option<u32> {
        let _ = h;
        None
    }
    /// Whether a delayed redelivery sends the message to the back of its lane (an SQS FIFO copy
    /// joins the back of its group): strict order then holds for the other entries only.
    fn redelivery_to_back(&self) -> bool {
        false
    }
    /// Whether the adapter can tell that the broker took the delivery back.
    fn is_stale(&self, core: &Core, conn: Conn, h: &Handout) -> bool;
    /// How many entries are neither acked nor dead-lettered.
    fn open(&self) -> usize;
}

/// One consumer's connection.
#[derive(Debug)]
pub(crate) struct SimSource {
    world: Shared,
    conn: Conn,
    lanes: bool,
    capabilities: Capabilities,
}

impl SimSource {
    pub(crate) fn connect(shared: &Shared) -> Self {
        let mut w = world(shared);
        let w = &mut *w;
        let conn = w.broker.connect(&mut w.core);
        let capabilities = w.broker.capabilities();
        w.core.note(format!("connection {conn} opened"));
        Self {
            world: Arc::clone(shared),
            conn,
            lanes: capabilities.lanes(),
            capabilities,
        }
    }
}

#[derive(Debug)]
pub(crate) struct SimAck {
    world: Shared,
    conn: Conn,
    handout: Handout,
}

fn source_error(what: &str) -> SourceError {
    SourceError::new(Recovery::Retry, what, "the simulation failed it")
}

impl MessageSource for SimSource {
    type Ack = SimAck;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<SimAck>>, SourceError> {
        let batch = {
            let mut w = world(&self.world);
            let w = &mut *w;
            let core = &mut w.core;
            if core.fault(0.03) {
                core.note(format!("connection {}: receive fails", self.conn));
                return Err(source_error("receive"));
            }
            if core.fault(0.15) {
                w.broker.disturb(core, self.conn);
            }
            let taken = w.broker.receive(core, self.conn, max);
            let mut batch = Vec::with_capacity(taken.len());
            for h in taken {
                let entry = &core.entries[h.entry];
                let mut message = Message::new(Ok(MessageId::new(entry.id.clone()).unwrap()), "");
                if entry.replayed {
                    message
                        .headers
                        .push((inbox_core::REPLAYED.to_owned(), b"true".to_vec()));
                }
                message.meta.delivery_count = h.delivery_count;
                message.meta.redelivered = h.delivery_count.is_some_and(|n| n > 1);
                message.meta.redeliveries = h.redeliveries;
                message.meta.position = format!("entry {} handle {}", h.entry, h.handle);
                if self.lanes {
                    message.meta.lane = h.lane.map(|lane| format!("lane {lane}"));
                }
                batch.push(Delivery {
                    message,
                    ack: SimAck {
                        world: Arc::clone(&self.world),
                        conn: self.conn,
                        handout: h,
                    },
                });
            }
            if !batch.is_empty() {
                let got: Vec<&str> = batch
                    .iter()
                    .map(|d| d.message.meta.position.as_str())
                    .collect();
                let line = format!("connection {} received {}", self.conn, got.join(", "));
                core.note(line);
            }
            batch
        };
        if batch.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(batch)
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }
}

impl Drop for SimSource {
    /// The consumer is gone: whatever it held goes back.
    fn drop(&mut self) {
        let mut w = world(&self.world);
        let w = &mut *w;
        w.broker.disconnect(&mut w.core, self.conn);
        w.core.note(format!(
            "connection {} closed: what it held goes back",
            self.conn
        ));
    }
}

impl Ack for SimAck {
    async fn ack(self) -> Result<(), SourceError> {
        let mut w = world(&self.world);
        let w = &mut *w;
        let i = self.handout.entry;
        if w.core.fault(0.03) {
            w.core.note(format!("ack entry {i} fails"));
            return Err(source_error("ack"));
        }
        let settled = w.core.settled(i);
        if w.broker.ack(&mut w.core, self.conn, &self.handout) {
            let id = w.core.entries[i].id.clone();
            if !settled {
                w.core.violation(format!(
                    "entry {i} ({id}) acked, but {id} is neither committed nor dead-lettered"
                ));
            }
            w.core.note(format!("acked entry {i} ({id})"));
        } else {
            w.core.note(format!(
                "ack of entry {i} with a stale handle: nothing happens"
            ));
        }
        Ok(())
    }

    async fn nack(self, retry_after: Duration) -> Result<(), SourceError> {
        let mut w = world(&self.world);
        let w = &mut *w;
        w.core.note(format!("nacked entry {}", self.handout.entry));
        w.broker
            .nack(&mut w.core, self.conn, &self.handout, retry_after);
        Ok(())
    }

    async fn redeliver(
        self,
        _message: &Message,
        delay: Duration,
        redelivery: u32,
    ) -> Result<(), SourceError> {
        let mut w = world(&self.world);
        let w = &mut *w;
        let i = self.handout.entry;
        if w.core.fault(0.03) {
            // As `Ack::redeliver` promises: the delivery comes back as a nacked one does.
            w.core
                .note(format!("redelivery of entry {i} fails: handed back"));
            w.broker
                .nack(&mut w.core, self.conn, &self.handout, Duration::ZERO);
            return Err(source_error("redeliver"));
        }
        let id = w.core.entries[i].id.clone();
        let asked = w
            .broker
            .redeliveries_asked(&self.handout)
            .unwrap_or_else(|| w.core.redeliveries.get(&i).copied().unwrap_or(0));
        // Read before the redelivery commits its own count.
        let floor = w
            .broker
            .redelivery_floor(&self.handout)
            .map_or(asked, |floor| floor.min(asked));
        let taken =
            match w
                .broker
                .redeliver(&mut w.core, self.conn, &self.handout, delay, redelivery)
            {
                Ok(taken) => taken,
                Err(e) => {
                    w.core
                        .note(format!("redelivery of entry {i} ({id}) fails: {e}"));
                    return Err(e);
                }
            };
        // The schedule goes on from where it was: a count that ran ahead skips delays (a
        // hand-back counted as a redelivery), one that went back restarts it (the message may
        // never reach its dead letter). One step back is allowed: a copy re-published for its
        // delay can come beside its original, when a crash came between the two. A stale
        // handle's request changes nothing, whatever it says.
        if taken {
            if redelivery > asked || redelivery + 1 < floor {
                w.core.violation(format!(
                    "entry {i} ({id}) handed back as redelivery {redelivery} of its schedule, \
                     but it was handed back for a redelivery {asked} times before"
                ));
            }
            w.core.redeliveries.insert(i, redelivery + 1);
        }
        w.core.note(format!(
            "entry {i} ({id}) handed back as redelivery {redelivery}, due in {delay:?}"
        ));
        Ok(())
    }

    async fn ack_all(acks: Vec<Self>) -> Result<(), SourceError> {
        let Some(first) = acks.first() else {
            return Ok(());
        };
        let batched = {
            let mut w = world(&first.world);
            let w = &mut *w;
            let hs: Vec<Handout> = acks.iter().map(|a| a.handout.clone()).collect();
            w.broker.ack_all(&mut w.core, first.conn, &hs)
        };
        if let Some(result) = batched {
            return result;
        }
        for ack in acks {
            ack.ack().await?;
        }
        Ok(())
    }

    fn is_stale(&self) -> bool {
        let w = world(&self.world);
        w.broker.is_stale(&w.core, self.conn, &self.handout)
    }

    async fn dead_letter(self, message: &Message, reason: &str) -> Result<(), SourceError> {
        let mut w = world(&self.world);
        let w = &mut *w;
        let i = self.handout.entry;
        let id = message
            .id
            .as_ref()
            .map(|id| id.to_string())
            .unwrap_or_default();
        if w.core.fault(0.1) {
            w.core.note(format!("dead letter of entry {i} fails"));
            w.broker
                .nack(&mut w.core, self.conn, &self.handout, Duration::ZERO);
            return Err(source_error("dead letter"));
        }
        *w.core.parked.entry(id.clone()).or_default() += 1;
        let position = format!("letter {}", w.core.parked.values().sum::<u32>());
        w.core.letters.push(Letter {
            position,
            entry: i,
            id: id.clone(),
        });
        w.core
            .note(format!("dead-lettered entry {i} ({id}): {reason}"));
        w.broker.dead_letter(&mut w.core, self.conn, &self.handout);
        Ok(())
    }
}
