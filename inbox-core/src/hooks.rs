//! Stage hooks: observe each step of the algorithm as a message reaches it.

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

type HookFn = dyn Fn(Stage, &MessageId) + Send + Sync;

/// A callback run at each [`Stage`] of each message, on the consumer's task: keep it short.
///
/// It observes; it cannot change what the consumer does. (The test kit's crash points, which
/// stop a consumer dead at a stage, wrap the store, the handler and the source instead.)
#[derive(Clone)]
pub struct StageHook(Arc<HookFn>);

impl StageHook {
    /// Wraps a callback.
    pub fn new(f: impl Fn(Stage, &MessageId) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    pub(crate) fn call(&self, stage: Stage, id: &MessageId) {
        (self.0)(stage, id)
    }
}

impl fmt::Debug for StageHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StageHook")
    }
}
