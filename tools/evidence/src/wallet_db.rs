//! The kill test's wallet database on either inbox store: what the harness reads from it, and a
//! consumer run on it.

use futures_util::future::BoxFuture;
use std::collections::HashSet;

use inbox_conformance::pg_cluster::{ClusterSettings, PgCluster};
use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::{self, Summary};
use inbox_conformance::{mysql_wallet, TestDb, TestStore};
use inbox_core::{BoxError, StatsSnapshot};

use crate::brokers::Broker;
use crate::cli::{ConsumerSpec, StoreKind};
use crate::consume::{Shutdown, Watch};

/// A wallet (accounts, ledger) and its inbox, in a schema or database of one run's own. The
/// methods return boxed futures because the tool picks the store at run time.
pub(crate) trait WalletDb: Send + Sync {
    /// The schema (PostgreSQL) or database (MySQL) a consumer child attaches to.
    fn name(&self) -> &str;

    /// The inbox store.
    fn store(&self) -> StoreKind;

    /// What the ledger says.
    fn summary(&self) -> BoxFuture<'_, Result<Summary, BoxError>>;

    /// Every account's balance, by id.
    fn balances(&self) -> BoxFuture<'_, Result<Vec<(i64, i64)>, BoxError>>;

    /// Runs one consumer of `spec` on this wallet in this process until `shutdown`.
    fn consume<'a>(
        &'a self,
        broker: &'a dyn Broker,
        spec: &'a ConsumerSpec,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>>;

    /// Drops the schema or database.
    fn remove(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// A fresh wallet on `store` (`shards` clusters for [`StoreKind::Sharded`]).
pub(crate) async fn create(store: StoreKind, shards: usize) -> Result<Box<dyn WalletDb>, BoxError> {
    Ok(match store {
        StoreKind::Postgres => Box::new(TestDb::new().await),
        StoreKind::Mysql => Box::new(mysql_wallet::wallet_db().await),
        StoreKind::Sharded => Box::new(ShardedWallet::create(shards).await?),
    })
}

/// The shard clusters: name, port variable, default port.
const SHARDS: [(&str, &str, u16); 2] = [
    ("inbox_shard_a", "INBOX_SHARD_A_PG_PORT", 5443),
    ("inbox_shard_b", "INBOX_SHARD_B_PG_PORT", 5444),
];

/// The URL of shard `i`'s cluster, as the harness and its consumer children both see it.
fn shard_url(i: usize) -> String {
    let (_, var, port) = SHARDS[i];
    let port = std::env::var(var)
        .ok()
        .and_then(|p| p.parse::<u16>().ok())
        .unwrap_or(port);
    format!("postgres://postgres:postgres@127.0.0.1:{port}/inbox")
}

/// Which shard a credit goes to: its account, even or odd (the only shard when there is one).
pub(crate) fn shard_of_account(account_id: i64, shards: usize) -> usize {
    usize::try_from(account_id.rem_euclid(2)).unwrap_or(0) % shards.max(1)
}

/// Attaches to each shard's schema; `schemas` is [`ShardedWallet::name`]: one per shard, in
/// order, comma-separated.
pub(crate) async fn attach_shards(schemas: &str) -> Vec<TestDb> {
    let mut dbs = Vec::new();
    for (i, schema) in schemas.split(',').enumerate() {
        dbs.push(TestDb::attach_at(&shard_url(i), schema).await);
    }
    dbs
}

/// A wallet spread over shard clusters of the run's own, each with its own schema.
struct ShardedWallet {
    dbs: Vec<TestDb>,
    name: String,
    /// Kept up for the run (stopped on drop if started here).
    _clusters: Vec<PgCluster>,
}

impl ShardedWallet {
    async fn create(shards: usize) -> Result<Self, BoxError> {
        let settings = ClusterSettings {
            conf: vec!["max_connections = 200".into()],
            hba: None,
        };
        let mut clusters = Vec::new();
        let mut dbs = Vec::new();
        for (i, (name, var, port)) in SHARDS.into_iter().enumerate().take(shards) {
            clusters.push(PgCluster::up(name, var, port, &settings)?);
            dbs.push(TestDb::at(&shard_url(i)).await);
        }
        let name = dbs
            .iter()
            .map(|d| d.schema.as_str())
            .collect::<Vec<_>>()
            .join(",");
        Ok(Self {
            dbs,
            name,
            _clusters: clusters,
        })
    }
}

impl WalletDb for ShardedWallet {
    fn name(&self) -> &str {
        &self.name
    }

    fn store(&self) -> StoreKind {
        StoreKind::Sharded
    }

    /// The shards' ledgers together: an event applied in two shards counts as a duplicate.
    fn summary(&self) -> BoxFuture<'_, Result<Summary, BoxError>> {
        Box::pin(async move {
            let mut events = HashSet::new();
            let mut rows = 0;
            let (mut exact, mut total) = (true, 0);
            for db in &self.dbs {
                let ids: Vec<String> = sqlx::query_scalar("SELECT event_id FROM ledger")
                    .fetch_all(&db.pool)
                    .await?;
                rows += ids.len() as i64;
                events.extend(ids);
                let one = wallet::summary(db).await?;
                exact &= one.balances_exact;
                total += one.total_balance;
            }
            Ok(Summary {
                ledger_rows: rows,
                distinct_events: events.len() as i64,
                balances_exact: exact,
                total_balance: total,
            })
        })
    }

    /// Every shard's accounts: an account in two shards appears twice.
    fn balances(&self) -> BoxFuture<'_, Result<Vec<(i64, i64)>, BoxError>> {
        Box::pin(async move {
            let mut all = Vec::new();
            for db in &self.dbs {
                all.extend(WalletDb::balances(db).await?);
            }
            Ok(all)
        })
    }

    fn consume<'a>(
        &'a self,
        broker: &'a dyn Broker,
        spec: &'a ConsumerSpec,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>> {
        broker.consume(spec, &self.dbs[0], Watch::default(), shutdown)
    }

    fn remove(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let Self { dbs, .. } = *self;
            for db in dbs {
                db.drop().await;
            }
        })
    }
}

impl WalletDb for TestDb {
    fn name(&self) -> &str {
        &self.schema
    }

    fn store(&self) -> StoreKind {
        StoreKind::Postgres
    }

    fn summary(&self) -> BoxFuture<'_, Result<Summary, BoxError>> {
        Box::pin(async move { Ok(TestStore::summary(self).await?) })
    }

    fn balances(&self) -> BoxFuture<'_, Result<Vec<(i64, i64)>, BoxError>> {
        Box::pin(async move { Ok(TestStore::balances(self).await?) })
    }

    fn consume<'a>(
        &'a self,
        broker: &'a dyn Broker,
        spec: &'a ConsumerSpec,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>> {
        broker.consume(spec, self, Watch::default(), shutdown)
    }

    fn remove(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin((*self).drop())
    }
}

impl WalletDb for MySqlDb {
    fn name(&self) -> &str {
        &self.name
    }

    fn store(&self) -> StoreKind {
        StoreKind::Mysql
    }

    fn summary(&self) -> BoxFuture<'_, Result<Summary, BoxError>> {
        Box::pin(async move { Ok(TestStore::summary(self).await?) })
    }

    fn balances(&self) -> BoxFuture<'_, Result<Vec<(i64, i64)>, BoxError>> {
        Box::pin(async move { Ok(TestStore::balances(self).await?) })
    }

    fn consume<'a>(
        &'a self,
        broker: &'a dyn Broker,
        spec: &'a ConsumerSpec,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>> {
        broker.consume_mysql(spec, self, shutdown)
    }

    fn remove(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin((*self).drop())
    }
}
