//! A lease store that answers from a script, for tests of the effect consumer's paths without
//! a database.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use inbox_core::effect::{Acquired, LeaseStore, Release};
use inbox_core::{MessageId, StoreError};

use crate::lock;

/// Answers [`LeaseStore::acquire`] and [`LeaseStore::complete`] from a script, in call order,
/// then `Done` and `true`; every other call succeeds. Its transaction is `()`.
#[derive(Debug, Default)]
pub struct ScriptedLeases {
    acquire: Mutex<VecDeque<Acquired>>,
    complete: Mutex<VecDeque<bool>>,
}

impl ScriptedLeases {
    /// The next answers of `acquire`, after those already given.
    pub fn then_acquire(&self, answers: impl IntoIterator<Item = Acquired>) {
        lock(&self.acquire).extend(answers);
    }

    /// The next answers of `complete` (`false`: the done mark was fenced out).
    pub fn then_complete(&self, answers: impl IntoIterator<Item = bool>) {
        lock(&self.complete).extend(answers);
    }
}

impl LeaseStore for ScriptedLeases {
    type Tx = ();

    async fn acquire(&self, _: &str, _: &MessageId, _: Duration) -> Result<Acquired, StoreError> {
        Ok(lock(&self.acquire).pop_front().unwrap_or(Acquired::Done))
    }
    async fn release(
        &self,
        _: &str,
        _: &MessageId,
        _: u64,
        _: Release,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }
    async fn begin(&self) -> Result<(), StoreError> {
        Ok(())
    }
    async fn complete(
        &self,
        _: &mut (),
        _: &str,
        _: &MessageId,
        _: u64,
    ) -> Result<bool, StoreError> {
        Ok(lock(&self.complete).pop_front().unwrap_or(true))
    }
}
