//! Stage hooks: observe each step of the algorithm, or stop dead there as a crash would.

use std::fmt;
use std::sync::Arc;

use crate::MessageId;

/// A step of the claim/apply/commit/ack algorithm, reported for every message that reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    /// The ID was claimed in the open transaction (not yet committed).
    Claimed,
    /// The handler returned `Ok` (not yet committed).
    Applied,
    /// The transaction committed; the broker has not been acked yet.
    Committed,
    /// The broker ack returned.
    Acked,
}

/// What a hook tells the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HookAction {
    /// Carry on.
    Continue,
    /// Stop at once, as if the process died here: no rollback call, no ack, no further message.
    /// [`Consumer::run`](crate::Consumer::run) returns [`Error::Crashed`](crate::Error::Crashed).
    Crash,
}

type HookFn = dyn Fn(Stage, &MessageId) -> HookAction + Send + Sync;

/// A callback run at each [`Stage`] of each message.
#[derive(Clone)]
pub struct StageHook(Arc<HookFn>);

impl StageHook {
    /// Wraps a callback.
    pub fn new(f: impl Fn(Stage, &MessageId) -> HookAction + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    pub(crate) fn call(&self, stage: Stage, id: &MessageId) -> HookAction {
        (self.0)(stage, id)
    }
}

impl fmt::Debug for StageHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StageHook")
    }
}
