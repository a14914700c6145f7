//! A lease store with `PgLeases`' rules: a row per message, processing then done; a lease is
//! `locked_until` on the paused clock and a fencing token one higher per new lease; attempts
//! counted in the row; a done mark that takes the row lock until its transaction ends and is
//! refused for a token that is no longer current. Every statement can fail, a commit can
//! succeed and report a lost connection, and the store goes away for a while.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::effect::{Acquired, Attempt, Lease, LeaseStore, Release, Settled};
use inbox_core::{MessageId, Recovery, StoreError, Transaction};
use rand::RngExt;
use tokio::time::Instant;

use super::{Lab, Row};

/// The lease store the effect consumers share.
#[derive(Debug, Clone)]
pub(crate) struct SimLeases {
    lab: Arc<Lab>,
}

impl SimLeases {
    pub(crate) fn new(lab: &Arc<Lab>) -> Self {
        Self {
            lab: Arc::clone(lab),
        }
    }

    /// Fails a statement the seed says fails, or any while the store is unreachable; starts an
    /// outage now and then.
    fn reachable(&self, what: &str, p: f64) -> Result<(), StoreError> {
        let (mut w, mut s) = self.lab.lock();
        let now = Instant::now();
        if s.down_until.is_some_and(|until| until > now) {
            return Err(failed(Recovery::Reconnect, what));
        }
        if w.core.fault(0.01) {
            let outage = Duration::from_millis(w.core.rng.random_range(1..3_000));
            w.core
                .note(format!("lease store unreachable for {outage:?}"));
            s.down_until = Some(now + outage);
            return Err(failed(Recovery::Reconnect, what));
        }
        if w.core.fault(p) {
            w.core.note(format!("lease store: {what} fails"));
            return Err(failed(Recovery::Retry, what));
        }
        Ok(())
    }

    /// Waits until no other transaction than `tx` holds the row of `id`, at most the lock
    /// timeout: `false` when it ran out.
    async fn unlocked(&self, id: &str, tx: Option<u64>) -> bool {
        let started = Instant::now();
        loop {
            let freed = self.lab.freed.notified();
            {
                let s = self.lab.state();
                match s.rows.get(id).and_then(|r| r.locked_by) {
                    Some(holder) if Some(holder) != tx => {}
                    _ => return true,
                }
            }
            let left = self
                .lab
                .settings
                .lock_timeout
                .saturating_sub(started.elapsed());
            if tokio::time::timeout(left, freed).await.is_err() {
                return false;
            }
        }
    }
}

pub(crate) fn failed(recovery: Recovery, what: &str) -> StoreError {
    StoreError::new(recovery, what, "the simulation failed it")
}

fn attempt(token: u64, clean_token: u64) -> Attempt {
    if token == 1 {
        Attempt::First
    } else if clean_token == token - 1 {
        Attempt::AfterNotApplied
    } else {
        Attempt::AfterExpiry
    }
}

/// The done transaction: the done mark taken in it (with its row lock) and the handler's
/// `record` writes.
#[derive(Debug)]
pub(crate) struct LeaseTx {
    lab: Arc<Lab>,
    id: u64,
    /// The row marked done in this transaction, and the token it was marked under.
    marked: Option<(String, u64)>,
    /// A done mark was refused: like PostgreSQL's aborted transaction, nothing commits.
    fenced: bool,
    /// What `record` wrote: the message, the token and how it was settled.
    pub(crate) writes: Vec<(String, u64, Settled)>,
}

impl LeaseTx {
    /// The done mark this transaction holds, if any.
    pub(crate) fn marked(&self) -> Option<(&str, u64)> {
        self.marked
            .as_ref()
            .map(|(id, token)| (id.as_str(), *token))
    }
}

impl Drop for LeaseTx {
    /// Ended by commit, rollback, or a crash that dropped it: its row lock is free.
    fn drop(&mut self) {
        let mut s = self.lab.state();
        for row in s.rows.values_mut() {
            if row.locked_by == Some(self.id) {
                row.locked_by = None;
            }
        }
        drop(s);
        self.lab.freed.notify_waiters();
    }
}

impl LeaseStore for SimLeases {
    type Tx = LeaseTx;

    async fn acquire(
        &self,
        _consumer: &str,
        id: &MessageId,
        lease: Duration,
    ) -> Result<Acquired, StoreError> {
        let id = id.as_str();
        self.lab.latency().await;
        self.reachable("taking a lease", 0.03)?;
        // A done mark not yet committed holds the row: wait for it, then answer busy.
        let free = self.unlocked(id, None).await;
        let (mut w, mut s) = self.lab.lock();
        let now = Instant::now();
        let lock_timeout = self.lab.settings.lock_timeout;
        let acquired = match s.rows.get_mut(id) {
            Some(row) if !free => {
                if row.done {
                    Acquired::Done
                } else {
                    let left = row.locked_until.saturating_duration_since(now);
                    Acquired::Busy {
                        retry_after: left.max(lock_timeout),
                    }
                }
            }
            None => {
                s.rows.insert(
                    id.to_owned(),
                    Row {
                        token: 1,
                        clean_token: 0,
                        attempts: 1,
                        locked_until: now + lease,
                        first_leased: now,
                        done: false,
                        locked_by: None,
                    },
                );
                Acquired::Leased(Lease {
                    token: 1,
                    attempt: Attempt::First,
                    attempts: 1,
                    since_first: Duration::ZERO,
                })
            }
            Some(row) if row.done => Acquired::Done,
            Some(row) if row.locked_until > now => Acquired::Busy {
                retry_after: row.locked_until - now,
            },
            Some(row) => {
                row.token += 1;
                row.attempts += 1;
                row.locked_until = now + lease;
                Acquired::Leased(Lease {
                    token: row.token,
                    attempt: attempt(row.token, row.clean_token),
                    attempts: row.attempts,
                    since_first: now - row.first_leased,
                })
            }
        };
        match acquired {
            Acquired::Leased(l) => {
                s.counts.leases += 1;
                w.core.note(format!(
                    "lease on {id}: token {}, {:?}, attempt {}, until +{lease:?}",
                    l.token, l.attempt, l.attempts
                ));
                if w.core.fault(0.01) {
                    w.core.note(format!(
                        "lease on {id} committed, but the connection was lost: the consumer does not know"
                    ));
                    return Err(failed(Recovery::Reconnect, "taking a lease"));
                }
            }
            Acquired::Busy { retry_after } => {
                w.core
                    .note(format!("lease on {id}: busy for {retry_after:?}"));
            }
            Acquired::Done => w.core.note(format!("lease on {id}: done")),
        }
        Ok(acquired)
    }

    async fn release(
        &self,
        _consumer: &str,
        id: &MessageId,
        token: u64,
        release: Release,
    ) -> Result<bool, StoreError> {
        let id = id.as_str();
        self.lab.latency().await;
        self.reachable("releasing a lease", 0.03)?;
        if !self.unlocked(id, None).await {
            return Err(failed(Recovery::Retry, "releasing a lease: lock timeout"));
        }
        let (mut w, mut s) = self.lab.lock();
        let Some(row) = s.rows.get_mut(id).filter(|r| r.token == token && !r.done) else {
            w.core
                .note(format!("release of {id} token {token}: taken over"));
            return Ok(false);
        };
        row.locked_until = Instant::now();
        if release.not_applied {
            row.clean_token = token;
        }
        if release.dead_lettered {
            row.attempts = 0;
        }
        w.core
            .note(format!("released {id} token {token}: {release:?}"));
        Ok(true)
    }

    async fn begin(&self) -> Result<LeaseTx, StoreError> {
        self.lab.latency().await;
        self.reachable("begin", 0.02)?;
        let mut s = self.lab.state();
        s.next_tx += 1;
        Ok(LeaseTx {
            lab: Arc::clone(&self.lab),
            id: s.next_tx,
            marked: None,
            fenced: false,
            writes: Vec::new(),
        })
    }

    async fn complete(
        &self,
        tx: &mut LeaseTx,
        _consumer: &str,
        id: &MessageId,
        token: u64,
    ) -> Result<bool, StoreError> {
        let id = id.as_str();
        self.lab.latency().await;
        self.reachable("marking done", 0.02)?;
        if !self.unlocked(id, Some(tx.id)).await {
            return Err(failed(Recovery::Retry, "marking done: lock timeout"));
        }
        let (mut w, mut s) = self.lab.lock();
        match s.rows.get_mut(id) {
            Some(row) if row.token == token && !row.done => {
                row.locked_by = Some(tx.id);
                tx.marked = Some((id.to_owned(), token));
                Ok(true)
            }
            row => {
                let now = row.map(|r| (r.token, r.done));
                s.counts.fenced += 1;
                tx.fenced = true;
                w.core.note(format!(
                    "done mark of {id} token {token} fenced out: the row is at (token, done) {now:?}"
                ));
                Ok(false)
            }
        }
    }
}

impl Transaction for LeaseTx {
    async fn commit(self) -> Result<(), StoreError> {
        self.lab.latency().await;
        // Its row lock is freed when `self` drops, after the state's lock is given back.
        self.settle()
    }

    async fn rollback(self) -> Result<(), StoreError> {
        Ok(())
    }
}

impl LeaseTx {
    /// The commit: the done mark and the writes land, or nothing does.
    fn settle(&self) -> Result<(), StoreError> {
        let (mut w, mut s) = self.lab.lock();
        let now = Instant::now();
        let core = &mut w.core;
        let roll: f64 = if core.faults { core.rng.random() } else { 1.0 };
        if s.down_until.is_some_and(|until| until > now) || roll < 0.02 {
            core.note("lease store: commit fails before it commits".into());
            return Err(failed(Recovery::Reconnect, "commit"));
        }
        if roll < 0.04 {
            core.note("lease store: commit refused (an aborted transaction)".into());
            return Err(failed(Recovery::Retry, "commit"));
        }
        if self.fenced {
            // PostgreSQL answers COMMIT of an aborted transaction with a rollback.
            core.note("commit of a fenced-out transaction: nothing written".into());
            return Ok(());
        }
        let Some((id, token)) = &self.marked else {
            if !self.writes.is_empty() {
                core.violation(format!(
                    "record writes {:?} committed without a done mark",
                    self.writes
                ));
            }
            return Ok(());
        };
        let row = s.rows.get_mut(id).unwrap();
        if row.token != *token || row.done || row.locked_by != Some(self.id) {
            core.violation(format!(
                "done mark of {id} committed under token {token}, but the row is at token {} (done {})",
                row.token, row.done
            ));
        }
        row.done = true;
        row.locked_until = now;
        let settled = match self.writes.as_slice() {
            [(wid, wtoken, settled)] if wid == id && wtoken == token => *settled,
            writes => {
                core.violation(format!(
                    "the done mark of {id} token {token} committed with record writes {writes:?}"
                ));
                Settled::Called
            }
        };
        if s.done.insert(id.clone(), settled).is_some() || !core.claims.insert(id.clone()) {
            core.violation(format!("{id} marked done twice"));
        }
        *core.applied.entry(id.clone()).or_default() += 1;
        core.note(format!(
            "committed the done mark of {id} token {token} ({})",
            settled.as_str()
        ));
        if roll < 0.06 {
            core.note("connection lost after the commit: outcome unknown".into());
            return Err(failed(Recovery::Reconnect, "commit"));
        }
        Ok(())
    }
}
