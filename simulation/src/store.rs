//! The inbox store: claims take row locks, as a primary key's insert does. A claim of an ID
//! that another open transaction claimed waits until that one ends (and then finds the row if
//! it committed), fails on a deadlock or a lock timeout, and any part of a transaction can fail
//! as a database's does. A store can be one of several shards, each with outages of its own.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use inbox_core::{ConsumerBinding, InboxStore, MessageId, Recovery, StoreError, Transaction};
use rand::RngExt;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::world::{world, Shared};

/// The row locks of the inbox table: which open transaction holds each ID, and which ID each
/// waiting transaction waits for.
#[derive(Debug, Default)]
struct Rows {
    held: BTreeMap<String, u64>,
    waiting: BTreeMap<u64, String>,
    next_tx: u64,
}

#[derive(Debug, Default)]
struct Locks {
    rows: Mutex<Rows>,
    /// Told when a transaction ends and its rows are free.
    freed: Notify,
}

impl Locks {
    fn rows(&self) -> MutexGuard<'_, Rows> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether transaction `tx`, waiting for `id`, waits in a cycle.
    fn deadlocked(rows: &Rows, tx: u64, id: &str) -> bool {
        let mut wanted = id;
        for _ in 0..rows.held.len() + 1 {
            let Some(&holder) = rows.held.get(wanted) else {
                return false;
            };
            if holder == tx {
                return true;
            }
            match rows.waiting.get(&holder) {
                Some(next) => wanted = next,
                None => return false,
            }
        }
        false
    }

    fn release(&self, tx: u64) {
        let mut rows = self.rows();
        rows.held.retain(|_, holder| *holder != tx);
        rows.waiting.remove(&tx);
        drop(rows);
        self.freed.notify_waiters();
    }
}

/// One shard of the inbox (the only one, unsharded).
#[derive(Debug, Clone)]
pub(crate) struct SimStore {
    world: Shared,
    shard: usize,
    locks: Arc<Locks>,
    /// Unreachable until then.
    down_until: Arc<Mutex<Option<Instant>>>,
    /// How long a claim waits on a row lock before it fails, if at all.
    lock_timeout: Option<Duration>,
}

impl SimStore {
    pub(crate) fn new(world: &Shared, shard: usize, lock_timeout: Option<Duration>) -> Self {
        Self {
            world: Arc::clone(world),
            shard,
            locks: Arc::default(),
            down_until: Arc::default(),
            lock_timeout,
        }
    }
}

impl SimStore {
    /// Unreachable for `outage` from now.
    pub(crate) fn down_for(&self, outage: Duration) {
        *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + outage);
    }
}

#[derive(Debug)]
pub(crate) struct SimTx {
    world: Shared,
    locks: Arc<Locks>,
    id: u64,
    claims: Vec<String>,
    pub(crate) applied: Vec<String>,
    /// The entries of `applied`.
    pub(crate) entries: Vec<usize>,
}

impl Drop for SimTx {
    /// Ended by commit, rollback, or a crash that dropped it: its rows are free.
    fn drop(&mut self) {
        self.locks.release(self.id);
    }
}

fn store_error(recovery: Recovery, what: &str) -> StoreError {
    StoreError::new(recovery, what, "the simulation failed it")
}

impl InboxStore for SimStore {
    type Tx = SimTx;

    /// One consumer name in the simulated world: the binding changes nothing.
    fn bind(&self, _: &ConsumerBinding) -> Self {
        self.clone()
    }

    async fn begin(&self) -> Result<SimTx, StoreError> {
        let now = Instant::now();
        let mut w = world(&self.world);
        let mut down = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        if down.is_some_and(|until| until > now) {
            return Err(store_error(Recovery::Reconnect, "begin"));
        }
        if w.core.fault(0.02) {
            let outage = Duration::from_millis(w.core.rng.random_range(1..3_000));
            w.core.note(format!(
                "shard {}: store unreachable for {outage:?}",
                self.shard
            ));
            *down = Some(now + outage);
            return Err(store_error(Recovery::Reconnect, "begin"));
        }
        let mut rows = self.locks.rows();
        rows.next_tx += 1;
        Ok(SimTx {
            world: Arc::clone(&self.world),
            locks: Arc::clone(&self.locks),
            id: rows.next_tx,
            claims: Vec::new(),
            applied: Vec::new(),
            entries: Vec::new(),
        })
    }

    /// One by one, as a store without a batch insert claims.
    async fn claim(&self, tx: &mut SimTx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        let mut claimed = Vec::with_capacity(ids.len());
        for id in ids {
            claimed.push(self.claim_one(tx, id).await?);
        }
        Ok(claimed)
    }
}

impl SimStore {
    async fn claim_one(&self, tx: &mut SimTx, id: &MessageId) -> Result<bool, StoreError> {
        let id = id.to_string();
        {
            let mut w = world(&self.world);
            if w.core.fault(0.02) {
                w.core.note(format!("claim of {id} fails"));
                return Err(store_error(Recovery::Retry, "claim"));
            }
        }
        let started = Instant::now();
        loop {
            let freed = self.locks.freed.notified();
            {
                let mut rows = self.locks.rows();
                if world(&self.world).core.claims.contains(&id) {
                    rows.waiting.remove(&tx.id);
                    return Ok(false);
                }
                match rows.held.get(&id) {
                    Some(&holder) if holder == tx.id => return Ok(false),
                    Some(_) => {
                        if Locks::deadlocked(&rows, tx.id, &id) {
                            rows.waiting.remove(&tx.id);
                            drop(rows);
                            world(&self.world)
                                .core
                                .note(format!("claim of {id}: deadlock detected"));
                            return Err(store_error(Recovery::Retry, "claim: deadlock"));
                        }
                        rows.waiting.insert(tx.id, id.clone());
                    }
                    None => {
                        rows.waiting.remove(&tx.id);
                        rows.held.insert(id.clone(), tx.id);
                        tx.claims.push(id);
                        return Ok(true);
                    }
                }
            }
            match self.lock_timeout {
                Some(limit) => {
                    let left = limit.saturating_sub(started.elapsed());
                    if tokio::time::timeout(left, freed).await.is_err() {
                        self.locks.rows().waiting.remove(&tx.id);
                        world(&self.world)
                            .core
                            .note(format!("claim of {id}: lock timeout"));
                        return Err(store_error(Recovery::Retry, "claim: lock timeout"));
                    }
                }
                None => freed.await,
            }
        }
    }
}

impl Transaction for SimTx {
    async fn commit(self) -> Result<(), StoreError> {
        let mut w = world(&self.world);
        let roll: f64 = if w.core.faults {
            w.core.rng.random()
        } else {
            1.0
        };
        if roll < 0.02 {
            w.core
                .note("commit refused (an aborted transaction)".into());
            return Err(store_error(Recovery::Retry, "commit"));
        }
        if roll < 0.04 {
            w.core.note("connection lost before the commit".into());
            return Err(store_error(Recovery::Reconnect, "commit"));
        }
        let core = &mut w.core;
        for id in &self.applied {
            if !self.claims.contains(id) {
                core.violation(format!("{id} applied without its claim in the transaction"));
            }
            let n = {
                let n = core.applied.entry(id.clone()).or_default();
                *n += 1;
                *n
            };
            if n > 1 {
                core.violation(format!("{id} applied {n} times"));
            }
        }
        for id in &self.claims {
            if !core.claims.insert(id.clone()) {
                core.violation(format!("{id} claimed by two transactions"));
            }
        }
        for &i in &self.entries {
            let entry = &core.entries[i];
            let shard = if core.sharded {
                crate::shard_of(&entry.id)
            } else {
                0
            };
            core.order.entry((entry.lane, shard)).or_default().push(i);
        }
        core.note(format!("committed claims {:?}", self.claims));
        if roll < 0.06 {
            core.note("connection lost after the commit: outcome unknown".into());
            return Err(store_error(Recovery::Reconnect, "commit"));
        }
        Ok(())
    }

    async fn rollback(self) -> Result<(), StoreError> {
        Ok(())
    }
}
