//! The delay queues, and the dead-letter connection that publishes a delayed copy to them as
//! `DeadLetters::delay` does: its delay queue declared where [`DelayQueues`] says it must be,
//! declared again after a copy comes back unroutable.
//!
//! [`DelayQueues`]: inbox_rabbitmq::redelivery::DelayQueues

use std::collections::VecDeque;
use std::time::Duration;

use inbox_core::{Recovery, SourceError};
use inbox_rabbitmq::redelivery::DelayedCopy;
use rand::RngExt;
use tokio::time::Instant;

use super::{error, Headers, Place, RabbitMq};
use crate::broker::Conn;
use crate::world::Core;

/// One delay queue.
#[derive(Debug, Default)]
pub(super) struct DelayQueue {
    pub(super) exists: bool,
    /// Copies waiting, oldest first, each with when it expires as the broker sees it.
    pub(super) waiting: VecDeque<(usize, Instant)>,
}

/// What a copy's publish came to.
pub(super) enum Published {
    Stored,
    Unroutable,
    Failed(SourceError),
}

impl RabbitMq {
    /// The copies expired at the head of their delay queue are dead-lettered back to the
    /// queue, at least once: now and then twice.
    pub(super) fn expire(&mut self, core: &mut Core, now: Instant) {
        let mut expired = Vec::new();
        for (name, queue) in &mut self.delay_queues {
            while let Some(&(m, at)) = queue.waiting.front() {
                if at > now {
                    break;
                }
                queue.waiting.pop_front();
                expired.push((name.clone(), m));
            }
        }
        for (name, m) in expired {
            self.next_position += 1;
            let msg = &mut self.messages[m];
            msg.position = self.next_position;
            msg.place = Place::Ready;
            let twice = core.fault(0.02);
            core.note(format!(
                "message {m} (entry {}) expires in {name}: dead-lettered back to the queue{}",
                msg.entry,
                if twice { ", twice (at least once)" } else { "" }
            ));
            if twice {
                let copy = msg.clone();
                self.add(copy.entry, copy.headers, copy.lineage, Place::Ready);
            }
        }
    }

    /// `DeadLetters::channel`: the dead-letter connection, opened if it is not; a new one
    /// forgets the delay queues declared.
    pub(super) fn publisher(
        &mut self,
        core: &mut Core,
        conn: Conn,
        faults: bool,
    ) -> Result<(), SourceError> {
        if self.source(conn).publisher {
            return Ok(());
        }
        if faults && core.fault(0.03) {
            core.note(format!(
                "connection {conn}: opening the dead-letter connection fails"
            ));
            return Err(error(
                Recovery::Reconnect,
                "talking to RabbitMQ",
                "opening the dead-letter connection failed",
            ));
        }
        let source = self.source(conn);
        source.publisher = true;
        source.delay_queues.reconnected();
        core.note(format!("connection {conn}: dead-letter connection opened"));
        Ok(())
    }

    /// `DeadLetters::declare_delay_queue`: declared unless
    /// [`DelayQueues`](inbox_rabbitmq::redelivery::DelayQueues) knows it exists.
    pub(super) fn declare(
        &mut self,
        core: &mut Core,
        conn: Conn,
        queue: &str,
    ) -> Result<(), SourceError> {
        if !self.source(conn).delay_queues.needs_declaring(queue) {
            return Ok(());
        }
        if core.fault(0.03) {
            self.source(conn).publisher = false;
            core.note(format!(
                "connection {conn}: declaring {queue} fails, the dead-letter connection is lost"
            ));
            return Err(error(
                Recovery::Reconnect,
                "talking to RabbitMQ",
                "declaring the delay queue failed",
            ));
        }
        let delay_queue = self.delay_queues.entry(queue.to_owned()).or_default();
        let created = !delay_queue.exists;
        delay_queue.exists = true;
        self.source(conn).delay_queues.declared(queue);
        core.note(format!(
            "connection {conn} declares {queue}{}",
            if created { ": created" } else { "" }
        ));
        Ok(())
    }

    /// `publish_confirmed` of a copy to its delay queue.
    pub(super) fn publish(
        &mut self,
        core: &mut Core,
        copy: &DelayedCopy,
        entry: usize,
        headers: &Headers,
        lineage: u32,
    ) -> Published {
        let exists = self
            .delay_queues
            .get(&copy.queue)
            .is_some_and(|queue| queue.exists);
        let failed = core.fault(0.05);
        let landed = exists && (!failed || core.rng.random_bool(0.5));
        if landed {
            let m = self.add(entry, headers.clone(), lineage, Place::Delayed);
            let late = Duration::from_millis(core.rng.random_range(0..50));
            let at = Instant::now() + Duration::from_millis(copy.expiration_ms) + late;
            let queue = self.delay_queues.get_mut(&copy.queue).unwrap();
            queue.waiting.push_back((m, at));
            core.note(format!(
                "message {m}: entry {entry}'s copy for redelivery {} in {}, expiring in {} ms",
                copy.redeliveries, copy.queue, copy.expiration_ms
            ));
        }
        if failed {
            core.note(format!(
                "the publish of entry {entry}'s copy fails (basic.nack or no confirm in time), \
                 the copy {}",
                if landed { "landed" } else { "lost" }
            ));
            return Published::Failed(error(
                Recovery::Retry,
                "publishing to RabbitMQ",
                "the copy was not confirmed",
            ));
        }
        if exists {
            Published::Stored
        } else {
            Published::Unroutable
        }
    }

    /// `DeadLetters::delay`: the connection, the declare, the publish; a copy returned
    /// unroutable found its delay queue gone, which is declared again before one more publish.
    pub(super) fn delay(
        &mut self,
        core: &mut Core,
        conn: Conn,
        copy: &DelayedCopy,
        entry: usize,
        headers: &Headers,
        lineage: u32,
    ) -> Result<(), SourceError> {
        self.publisher(core, conn, true)?;
        self.declare(core, conn, &copy.queue)?;
        // An operator's cleanup may delete it meanwhile, the moment it matters most.
        if core.fault(0.1) {
            self.delete_if_empty(core, &copy.queue);
        }
        match self.publish(core, copy, entry, headers, lineage) {
            Published::Stored => return Ok(()),
            Published::Failed(e) => return Err(e),
            Published::Unroutable => {}
        }
        core.note(format!(
            "connection {conn}: entry {entry}'s copy comes back unroutable, {} is gone; \
             declaring it again",
            copy.queue
        ));
        self.source(conn).delay_queues.gone(&copy.queue);
        self.declare(core, conn, &copy.queue)?;
        match self.publish(core, copy, entry, headers, lineage) {
            Published::Stored => Ok(()),
            Published::Failed(e) => Err(e),
            Published::Unroutable => {
                core.note(format!(
                    "connection {conn}: entry {entry}'s copy unroutable again: Error::Unroutable, \
                     fatal"
                ));
                Err(error(
                    Recovery::Fatal,
                    "publishing to RabbitMQ",
                    "no queue is bound to the delay queue's routing key",
                ))
            }
        }
    }

    /// `queue.delete` with `if-empty`, as an operator's cleanup of idle queues does.
    pub(super) fn delete_if_empty(&mut self, core: &mut Core, name: &str) {
        if let Some(queue) = self.delay_queues.get_mut(name) {
            if queue.exists && queue.waiting.is_empty() {
                queue.exists = false;
                core.note(format!("an operator deletes the empty delay queue {name}"));
            }
        }
    }
}
