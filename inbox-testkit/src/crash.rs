//! Crash points: hooks that stop the consumer at a stage of the algorithm, as a crash would.
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use inbox_core::{HookAction, MessageId, Stage, StageHook};

/// A hook that crashes the consumer the first time any message reaches `stage`, then lets
/// every later call pass (so a restarted consumer with the same hook runs on).
pub fn crash_at(stage: Stage) -> StageHook {
    let fired = Arc::new(Mutex::new(false));
    StageHook::new(move |at, _id| {
        let mut fired = fired.lock().unwrap_or_else(|e| e.into_inner());
        if at == stage && !*fired {
            *fired = true;
            HookAction::Crash
        } else {
            HookAction::Continue
        }
    })
}

/// A hook that crashes the consumer when one of `ids` reaches `stage`, once per ID.
pub fn crash_at_ids(stage: Stage, ids: impl IntoIterator<Item = MessageId>) -> StageHook {
    let armed: Arc<Mutex<HashSet<MessageId>>> = Arc::new(Mutex::new(ids.into_iter().collect()));
    StageHook::new(move |at, id| {
        let mut armed = armed.lock().unwrap_or_else(|e| e.into_inner());
        if at == stage && armed.remove(id) {
            HookAction::Crash
        } else {
            HookAction::Continue
        }
    })
}
