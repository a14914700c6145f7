//! The kill test's wallet database on either inbox store: what the harness reads from it, and a
//! consumer run on it.

use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::{self, Summary};
use inbox_conformance::{mysql_wallet, TestDb};
use inbox_core::{async_trait, BoxError, StatsSnapshot};

use crate::brokers::Broker;
use crate::cli::{ConsumerSpec, StoreKind};
use crate::consume::{Shutdown, Watch};

/// A wallet (accounts, ledger) and its inbox, in a schema or database of one run's own.
#[async_trait]
pub(crate) trait WalletDb: Send + Sync {
    /// The schema (PostgreSQL) or database (MySQL) a consumer child attaches to.
    fn name(&self) -> &str;

    /// The inbox store.
    fn store(&self) -> StoreKind;

    /// What the ledger says.
    async fn summary(&self) -> Result<Summary, BoxError>;

    /// Every account's balance, by id.
    async fn balances(&self) -> Result<Vec<(i64, i64)>, BoxError>;

    /// Runs one consumer of `spec` on this wallet in this process until `shutdown`.
    async fn consume(
        &self,
        broker: &dyn Broker,
        spec: &ConsumerSpec,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError>;

    /// Drops the schema or database.
    async fn remove(self: Box<Self>);
}

/// A fresh wallet on `store`.
pub(crate) async fn create(store: StoreKind) -> Box<dyn WalletDb> {
    match store {
        StoreKind::Postgres => Box::new(TestDb::new().await),
        StoreKind::Mysql => Box::new(mysql_wallet::wallet_db().await),
    }
}

#[async_trait]
impl WalletDb for TestDb {
    fn name(&self) -> &str {
        &self.schema
    }

    fn store(&self) -> StoreKind {
        StoreKind::Postgres
    }

    async fn summary(&self) -> Result<Summary, BoxError> {
        Ok(wallet::summary(&self.pool).await?)
    }

    async fn balances(&self) -> Result<Vec<(i64, i64)>, BoxError> {
        Ok(sqlx::query_as("SELECT id, balance FROM accounts")
            .fetch_all(&self.pool)
            .await?)
    }

    async fn consume(
        &self,
        broker: &dyn Broker,
        spec: &ConsumerSpec,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError> {
        broker.consume(spec, self, Watch::default(), shutdown).await
    }

    async fn remove(self: Box<Self>) {
        (*self).drop().await;
    }
}

#[async_trait]
impl WalletDb for MySqlDb {
    fn name(&self) -> &str {
        &self.name
    }

    fn store(&self) -> StoreKind {
        StoreKind::Mysql
    }

    async fn summary(&self) -> Result<Summary, BoxError> {
        Ok(mysql_wallet::summary(&self.pool).await?)
    }

    async fn balances(&self) -> Result<Vec<(i64, i64)>, BoxError> {
        Ok(mysql_wallet::balances(&self.pool).await?)
    }

    async fn consume(
        &self,
        broker: &dyn Broker,
        spec: &ConsumerSpec,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError> {
        broker.consume_mysql(spec, self, shutdown).await
    }

    async fn remove(self: Box<Self>) {
        (*self).drop().await;
    }
}
