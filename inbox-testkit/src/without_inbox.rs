use inbox_core::{InboxStore, InvalidId, MessageId, StoreError};

/// Wraps a store and records nothing: every claim says "new". The consumer still commits
/// before it acks, so this is the article's variant b, "commit after the database, no inbox",
/// kept to show the duplicates the inbox prevents. Never use it in production.
#[derive(Debug, Clone)]
pub struct WithoutInbox<S>(pub S);

impl<S: InboxStore> InboxStore for WithoutInbox<S> {
    type Tx = S::Tx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.0.begin().await
    }
    async fn claim(&self, _: &mut Self::Tx, _: &str, _: &MessageId) -> Result<bool, StoreError> {
        Ok(true)
    }
    fn check_id(&self, id: &MessageId) -> Result<(), InvalidId> {
        self.0.check_id(id)
    }
    fn set_handler_timeout(&mut self, timeout: std::time::Duration) {
        self.0.set_handler_timeout(timeout);
    }
}
