//! The channels: delivery tags, the prefetch buffer, acks and nacks as RabbitMQ takes them, and
//! beside each the adapter's `Link` with its [`Unsettled`] tags, settled as `Link::ack` and
//! `Link::nack` settle them: once the frame is sent, never for one that failed.

use std::collections::{BTreeMap, VecDeque};

use inbox_core::{Recovery, SourceError};
use inbox_rabbitmq::redelivery::DELIVERY_COUNT_HEADER;
use inbox_rabbitmq::unsettled::Unsettled;

use super::{error, Headers, Place, RabbitMq};
use crate::broker::Conn;
use crate::world::Core;

/// One delivery, as its channel sent it.
#[derive(Debug)]
pub(super) struct Delivered {
    pub(super) channel: usize,
    pub(super) tag: u64,
    pub(super) msg: usize,
    /// Its headers, `x-delivery-count` as the queue set it.
    pub(super) headers: Headers,
    pub(super) redelivered: bool,
}

/// One channel: the broker's side and the adapter's (`Link`).
#[derive(Debug)]
pub(super) struct Channel {
    pub(super) conn: Conn,
    pub(super) open: bool,
    pub(super) next_tag: u64,
    /// The prefetch window, fixed by the first receive.
    pub(super) prefetch: Option<usize>,
    /// The broker's: tags delivered and not settled, with their handles.
    pub(super) unacked: BTreeMap<u64, u64>,
    /// Delivered to the client and not yet taken by a receive.
    pub(super) buffer: VecDeque<u64>,
    /// The adapter's: `Link::unsettled`.
    pub(super) unsettled: Unsettled,
}

impl RabbitMq {
    /// The channel closes: what it held unsettled is requeued.
    pub(super) fn close(&mut self, core: &mut Core, c: usize, why: &str) {
        let ch = &mut self.channels[c];
        if !ch.open {
            return;
        }
        ch.open = false;
        ch.buffer.clear();
        // A delayed nack whose channel closed is never sent.
        let deliveries = &self.deliveries;
        self.nacks
            .retain(|(_, handle)| deliveries[handle].channel != c);
        let unacked = std::mem::take(&mut ch.unacked);
        let tags: Vec<u64> = unacked.keys().copied().collect();
        core.note(format!(
            "channel {c} closes ({why}): tags {tags:?} requeued"
        ));
        for handle in unacked.into_values() {
            let m = self.deliveries[&handle].msg;
            self.requeue(core, m);
        }
    }

    /// The channel consumed by `conn`, opened anew if it closed (`RabbitSource::ensure_open`):
    /// a new connection, whose tags start again at 1.
    pub(super) fn link(&mut self, core: &mut Core, conn: Conn) -> usize {
        if let Some(c) = self.source(conn).link {
            if self.channels[c].open {
                return c;
            }
        }
        let c = self.channels.len();
        self.channels.push(Channel {
            conn,
            open: true,
            next_tag: 0,
            prefetch: None,
            unacked: BTreeMap::new(),
            buffer: VecDeque::new(),
            unsettled: Unsettled::new(),
        });
        self.source(conn).link = Some(c);
        core.note(format!("connection {conn} consumes on channel {c}"));
        c
    }

    /// The broker delivers message `m` on channel `c`.
    pub(super) fn deliver(&mut self, c: usize, m: usize) -> String {
        let ch = &mut self.channels[c];
        ch.next_tag += 1;
        let tag = ch.next_tag;
        self.next_handle += 1;
        let handle = self.next_handle;
        ch.unacked.insert(tag, handle);
        ch.buffer.push_back(handle);
        let msg = &mut self.messages[m];
        msg.place = Place::Out;
        let mut headers = msg.headers.clone();
        if msg.returns > 0 {
            headers.insert(DELIVERY_COUNT_HEADER.to_owned(), u64::from(msg.returns));
        }
        let line = format!("tag {tag} message {m} (entry {}) {headers:?}", msg.entry);
        self.deliveries.insert(
            handle,
            Delivered {
                channel: c,
                tag,
                msg: m,
                headers,
                redelivered: msg.returns > 0,
            },
        );
        line
    }

    /// `basic.ack` of `tag` on channel `c` (of every unsettled tag up to it, with `multiple`):
    /// the handles it settled. A tag the channel does not hold closes the channel.
    pub(super) fn basic_ack(
        &mut self,
        core: &mut Core,
        c: usize,
        tag: u64,
        multiple: bool,
    ) -> Vec<u64> {
        let ch = &mut self.channels[c];
        if !ch.unacked.contains_key(&tag) {
            core.violation(format!(
                "channel {c}: ack of tag {tag}, which the channel does not hold: \
                 PRECONDITION_FAILED closes the channel"
            ));
            self.close(core, c, "unknown delivery tag");
            return Vec::new();
        }
        let tags: Vec<u64> = if multiple {
            ch.unacked.range(..=tag).map(|(&t, _)| t).collect()
        } else {
            vec![tag]
        };
        let mut settled = Vec::new();
        for t in tags {
            let handle = ch.unacked.remove(&t).unwrap();
            self.messages[self.deliveries[&handle].msg].place = Place::Gone;
            settled.push(handle);
        }
        settled
    }

    /// `Link::ack`: the frame, unless the channel is closed or the frame fails; then the tags it
    /// settled leave the adapter's unsettled set. `checked`: an ack of committed messages,
    /// each checked and noted (not a redelivery's or a dead letter's).
    pub(super) fn link_ack(
        &mut self,
        core: &mut Core,
        c: usize,
        tag: u64,
        multiple: bool,
        checked: bool,
    ) -> Result<(), SourceError> {
        let context = "acknowledging to RabbitMQ";
        if !self.channels[c].open {
            core.note(format!(
                "channel {c}: ack of tag {tag} not sent, the channel is closed"
            ));
            return Err(error(Recovery::Reconnect, context, "the channel closed"));
        }
        if core.fault(0.03) {
            core.note(format!("channel {c}: the ack frame of tag {tag} fails"));
            return Err(error(
                Recovery::Reconnect,
                context,
                "the frame was not sent",
            ));
        }
        let settled = self.basic_ack(core, c, tag, multiple);
        let unsettled = &mut self.channels[c].unsettled;
        if multiple {
            unsettled.settled_up_to(tag);
        } else {
            unsettled.settled([tag]);
        }
        if !checked {
            return Ok(());
        }
        let how = if multiple { "multiple ack" } else { "ack" };
        for handle in settled {
            let d = &self.deliveries[&handle];
            let i = self.messages[d.msg].entry;
            let id = core.entries[i].id.clone();
            if !core.settled(i) {
                core.violation(format!(
                    "entry {i} ({id}) acked (channel {c} tag {}, by the {how} of tag {tag}), but \
                     {id} is neither committed nor dead-lettered",
                    d.tag
                ));
            }
            core.note(format!(
                "acked entry {i} ({id}): channel {c} tag {}, by the {how} of tag {tag}",
                d.tag
            ));
        }
        Ok(())
    }

    /// `Link::nack` of delivery `handle`: the frame, unless the channel is closed or the frame
    /// fails; then the tag leaves the adapter's unsettled set and the broker requeues it.
    pub(super) fn link_nack(&mut self, core: &mut Core, handle: u64) {
        let d = &self.deliveries[&handle];
        let (c, tag, m) = (d.channel, d.tag, d.msg);
        if !self.channels[c].open {
            core.note(format!(
                "channel {c}: nack of tag {tag} not sent, the channel is closed"
            ));
            return;
        }
        if core.fault(0.03) {
            core.note(format!(
                "channel {c}: the nack frame of tag {tag} fails: the delivery stays unsettled"
            ));
            return;
        }
        self.channels[c].unsettled.settled([tag]);
        if self.channels[c].unacked.remove(&tag).is_none() {
            core.violation(format!(
                "channel {c}: nack of tag {tag}, which the channel does not hold: \
                 PRECONDITION_FAILED closes the channel"
            ));
            self.close(core, c, "unknown delivery tag");
            return;
        }
        core.note(format!(
            "channel {c}: nack of tag {tag}: message {m} (entry {}) requeued",
            self.messages[m].entry
        ));
        self.requeue(core, m);
    }
}
