//! The handlers the consumers run: per message or set-based, failing, panicking or stalling
//! as the seed says; a poison message fails every time.

use std::time::Duration;

use inbox_core::{BatchHandler, BatchItem, Handler, HandlerError, Message, MessageId};
use rand::RngExt;

use crate::store::SimTx;
use crate::world::{world, Shared};

/// What the simulated handler panics with; the tests' panic hook keeps it off their output.
pub const HANDLER_PANIC: &str = "the handler panicked";

/// The entry a message was received from.
fn entry_of(message: &Message) -> usize {
    let position = &message.meta.position;
    position
        .strip_prefix("entry ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|i| i.parse().ok())
        .unwrap()
}

#[derive(Debug)]
pub(crate) struct SimHandler {
    pub(crate) world: Shared,
}

impl Handler<SimTx> for SimHandler {
    async fn handle(
        &self,
        tx: &mut SimTx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let (roll, stall) = {
            let mut w = world(&self.world);
            if w.core.poison.contains(id.as_str()) {
                return Err(HandlerError::transient("poison: fails every time"));
            }
            let roll: f64 = if w.core.faults {
                w.core.rng.random()
            } else {
                1.0
            };
            let stall = w.core.rng.random_range(1..1_000);
            (roll, stall)
        };
        if roll < 0.06 {
            return Err(HandlerError::transient("the downstream is down"));
        }
        if roll < 0.08 {
            return Err(HandlerError::permanent("the message is refused"));
        }
        if roll < 0.09 {
            panic!("{}", HANDLER_PANIC);
        }
        if roll < 0.2 {
            tokio::time::sleep(Duration::from_millis(stall)).await;
        }
        tx.applied.push(id.to_string());
        tx.entries.push(entry_of(message));
        Ok(())
    }
}

/// A set-based handler: decoding fails now and then (a permanent or a transient error, before
/// any transaction), and a failing batch says not which message failed, so the consumer halves
/// it.
#[derive(Debug)]
pub(crate) struct SimBatch {
    pub(crate) world: Shared,
}

impl BatchHandler<SimTx> for SimBatch {
    type Item = ();

    fn decode(&self, _id: &MessageId, _message: &Message) -> Result<(), HandlerError> {
        let mut w = world(&self.world);
        let roll: f64 = if w.core.faults {
            w.core.rng.random()
        } else {
            1.0
        };
        if roll < 0.02 {
            return Err(HandlerError::permanent("the payload does not parse"));
        }
        if roll < 0.04 {
            return Err(HandlerError::transient("the schema registry is down"));
        }
        Ok(())
    }

    async fn handle_batch(
        &self,
        tx: &mut SimTx,
        batch: &[BatchItem<'_, ()>],
    ) -> Result<(), HandlerError> {
        let failing = {
            let mut w = world(&self.world);
            let faults = w.core.faults;
            batch.iter().any(|b| {
                w.core.poison.contains(b.id.as_str()) || faults && w.core.rng.random_bool(0.05)
            })
        };
        if failing {
            return Err(HandlerError::transient("one row of the batch failed"));
        }
        tx.applied.extend(batch.iter().map(|b| b.id.to_string()));
        tx.entries.extend(batch.iter().map(|b| entry_of(b.message)));
        Ok(())
    }
}
