use inbox_core::{ConsumerBinding, InboxStore, MessageId, StoreError};

/// Wraps a store and records nothing: every claim says "new". The consumer still commits
/// before it acks, so this is the article's variant b, "commit after the database, no inbox",
/// kept to show the duplicates the inbox prevents. Never use it in production.
#[derive(Debug, Clone)]
pub struct WithoutInbox<S>(pub S);

impl<S: InboxStore> InboxStore for WithoutInbox<S> {
    type Tx = S::Tx;

    fn bind(&self, binding: &ConsumerBinding) -> Self {
        Self(self.0.bind(binding))
    }
    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.0.begin().await
    }
    async fn claim(&self, _: &mut Self::Tx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        Ok(vec![true; ids.len()])
    }
}
