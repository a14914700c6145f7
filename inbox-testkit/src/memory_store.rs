use std::collections::HashSet;
use std::sync::Arc;

use tokio::sync::{Mutex, OwnedMutexGuard};

use inbox_core::{
    ConsumerBinding, InboxStore, MessageId, OperationError, Recovery, StoreError, Transaction,
};

/// An in-memory inbox store holding a user state `S` beside the claims.
///
/// Transactions are serialised (one at a time) and work on a copy, published on commit: a
/// dropped transaction (a crash) leaves nothing behind.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore<S> {
    committed: Arc<Mutex<Data<S>>>,
    /// The consumer this copy claims for ([`InboxStore::bind`]).
    consumer: Option<Arc<str>>,
}

#[derive(Debug, Clone, Default)]
struct Data<S> {
    claims: HashSet<(String, MessageId)>,
    state: S,
}

/// An open [`MemoryStore`] transaction.
#[derive(Debug)]
pub struct MemoryTx<S> {
    guard: OwnedMutexGuard<Data<S>>,
    work: Data<S>,
}

impl<S> MemoryTx<S> {
    /// The state as this transaction sees it.
    pub fn state(&self) -> &S {
        &self.work.state
    }

    /// Changes the state inside this transaction.
    pub fn state_mut(&mut self) -> &mut S {
        &mut self.work.state
    }
}

impl<S: Clone + Default + Send + 'static> MemoryStore<S> {
    /// An empty store.
    pub fn new() -> Self {
        Self {
            committed: Arc::new(Mutex::new(Data::default())),
            consumer: None,
        }
    }

    /// The committed state.
    pub async fn state(&self) -> S {
        self.committed.lock().await.state.clone()
    }

    /// How many IDs are remembered, over all consumers.
    pub async fn claims(&self) -> usize {
        self.committed.lock().await.claims.len()
    }
}

impl<S: Clone + Default + Send + Sync + 'static> InboxStore for MemoryStore<S> {
    type Tx = MemoryTx<S>;

    async fn begin(&self) -> Result<MemoryTx<S>, StoreError> {
        let guard = Arc::clone(&self.committed).lock_owned().await;
        let work = (*guard).clone();
        Ok(MemoryTx { guard, work })
    }

    fn bind(&self, binding: &ConsumerBinding) -> Self {
        Self {
            committed: Arc::clone(&self.committed),
            consumer: Some(binding.consumer.as_str().into()),
        }
    }

    async fn claim(
        &self,
        tx: &mut MemoryTx<S>,
        ids: &[MessageId],
    ) -> Result<Vec<bool>, StoreError> {
        let consumer = self.consumer.as_deref().ok_or_else(|| {
            OperationError::new(
                Recovery::Fatal,
                "claiming message IDs",
                "the store is not bound to a consumer (InboxStore::bind)",
            )
        })?;
        Ok(ids
            .iter()
            .map(|id| tx.work.claims.insert((consumer.to_owned(), id.clone())))
            .collect())
    }
}

impl<S: Send + Sync + 'static> Transaction for MemoryTx<S> {
    async fn commit(mut self) -> Result<(), StoreError> {
        *self.guard = self.work;
        Ok(())
    }

    async fn rollback(self) -> Result<(), StoreError> {
        Ok(())
    }
}
