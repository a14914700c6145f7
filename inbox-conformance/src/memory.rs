//! The suite on the test kit's in-memory broker: every scenario that needs no second process and
//! no network runs in seconds against the real PostgreSQL inbox. It is the store's own
//! scenario test, and a reference run of the suite that no broker's quirks can disturb.
//!
//! What the memory broker stands in for: a queue that hands out each message again when the
//! connection holding it closes ([`MemorySource`] dropped, or [`MemoryBroker::disconnect`]ed
//! while its handler stalls), counts deliveries and parks dead letters with their reasons.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_core::{Destinations, DynPublish};
use inbox_testkit::{lock, Connection, MemoryBroker, MemorySource};

use crate::{unique_name, DeadLetter, LosingSource, TestBroker, TestQueue};

/// The in-memory broker as a [`TestBroker`]: each scenario's queue is a [`MemoryBroker`] of its
/// own, inside the test process.
#[derive(Debug, Default, Clone, Copy)]
pub struct Memory;

/// One scenario's [`MemoryBroker`], and which connections each member opened.
#[derive(Debug)]
pub struct MemoryQueue {
    name: String,
    broker: MemoryBroker,
    members: Mutex<HashMap<String, Vec<Connection>>>,
}

impl TestBroker for Memory {
    type Queue = MemoryQueue;

    async fn queue(&self, scenario: &str) -> MemoryQueue {
        MemoryQueue {
            name: unique_name(scenario),
            broker: MemoryBroker::new(),
            members: Mutex::default(),
        }
    }

    /// Never called: the broker lives in the test process, so
    /// [`TestBroker::reaches_other_processes`] says no and the process-kill scenario is skipped.
    async fn attach(&self, name: &str) -> MemoryQueue {
        panic!("the memory queue {name} lives in another process and cannot be reached")
    }

    fn reaches_other_processes(&self) -> bool {
        false
    }
}

impl TestQueue for MemoryQueue {
    type Source = MemorySource;

    fn name(&self) -> String {
        self.name.clone()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        self.broker.publish(id, payload);
    }

    async fn source(&self, member: &str) -> MemorySource {
        let source = self.broker.source();
        lock(&self.members)
            .entry(member.to_owned())
            .or_default()
            .push(source.connection());
        source
    }

    /// A source whose connection [`TestQueue::take_away`] closes while its handler stalls.
    async fn losing_source(&self, member: &str) -> Option<LosingSource<MemorySource>> {
        Some(LosingSource {
            source: self.source(member).await,
            stall: Duration::from_secs(1),
        })
    }

    async fn take_away(&self, member: &str) {
        let connections = lock(&self.members).get(member).cloned();
        for connection in connections.unwrap_or_default() {
            self.broker.disconnect(connection);
        }
    }

    /// A dropped source hands its deliveries back at once.
    fn redelivery_delay(&self) -> Duration {
        Duration::from_millis(100)
    }

    async fn producer(&self) -> Arc<dyn DynPublish> {
        Arc::new(Destinations::new().route(self.name.clone(), self.broker.clone()))
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        self.broker
            .dead_letters()
            .into_iter()
            .map(|(message, reason)| DeadLetter {
                payload: message.payload,
                reason,
            })
            .collect()
    }

    async fn left(&self) -> u64 {
        self.broker.pending() as u64
    }

    async fn cleanup(&self) {}
}
