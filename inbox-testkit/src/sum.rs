//! The smallest handler with state: a running sum in a [`MemoryStore<i64>`](crate::MemoryStore).

use inbox_core::{Handler, HandlerError, Message, MessageId};

use crate::MemoryTx;

/// Adds each message's JSON number to the state; a payload that is not one is a permanent
/// failure ([`Message::json`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sum;

impl Handler<MemoryTx<i64>> for Sum {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        *tx.state_mut() += message.json::<i64>()?;
        Ok(())
    }
}
