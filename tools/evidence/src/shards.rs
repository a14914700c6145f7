//! `--store sharded`: the wallet and its inbox spread over PostgreSQL shard clusters of the
//! run's own, a schema in each, credits routed by account; one more [`TestStore`] beside
//! PostgreSQL's and MySQL's.

use std::collections::HashSet;
use std::sync::Arc;

use inbox_conformance::pg_cluster::{ClusterSettings, PgCluster};
use inbox_conformance::wallet::{CreditEvent, Summary};
use inbox_conformance::{TestDb, TestStore};
use inbox_core::{Message, MessageId, Sharded};
use inbox_postgres::{PgInbox, PgTx};

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
fn shard_of_account(account_id: i64, shards: usize) -> usize {
    usize::try_from(account_id.rem_euclid(2)).unwrap_or(0) % shards.max(1)
}

/// Attaches to each shard's schema; `schemas` is [`ShardedDb::name`]: one per shard, in
/// order, comma-separated.
pub(crate) async fn attach_shards(schemas: &str) -> Vec<TestDb> {
    let mut dbs = Vec::new();
    for (i, schema) in schemas.split(',').enumerate() {
        dbs.push(TestDb::attach_at(&shard_url(i), schema).await);
    }
    dbs
}

/// The inbox over `dbs`, each credit claimed in its account's shard.
pub(crate) fn sharded_inbox(dbs: &[TestDb]) -> Sharded<PgInbox> {
    let shards = dbs.len();
    Sharded::new(
        dbs.iter().map(TestDb::inbox).collect(),
        move |_: &MessageId, m: &Message| {
            m.json::<CreditEvent>()
                .map_or(0, |e| shard_of_account(e.account_id, shards))
        },
    )
}

/// A wallet spread over `N` shard clusters (1 or 2) of the run's own, each with its own schema.
/// Stalls are noted in the first shard.
#[derive(Debug, Clone)]
pub(crate) struct ShardedDb<const N: usize> {
    dbs: Vec<TestDb>,
    name: String,
    /// Kept up for the run (stopped with the last copy, if started here).
    _clusters: Arc<Vec<PgCluster>>,
}

impl<const N: usize> ShardedDb<N> {
    fn new(dbs: Vec<TestDb>, clusters: Vec<PgCluster>) -> Self {
        let name = dbs
            .iter()
            .map(|d| d.schema.as_str())
            .collect::<Vec<_>>()
            .join(",");
        Self {
            dbs,
            name,
            _clusters: Arc::new(clusters),
        }
    }
}

impl<const N: usize> TestStore for ShardedDb<N> {
    /// Each shard's store (`Sharded` routes among them and is not a store itself).
    type Inbox = PgInbox;

    /// # Panics
    /// When a shard cluster cannot be started or reached.
    async fn create() -> Self {
        let settings = ClusterSettings {
            conf: vec!["max_connections = 200".into()],
            hba: None,
        };
        let mut clusters = Vec::new();
        let mut dbs = Vec::new();
        for (i, (name, var, port)) in SHARDS.into_iter().enumerate().take(N) {
            let cluster = PgCluster::up(name, var, port, &settings)
                .unwrap_or_else(|e| panic!("cannot start the shard cluster {name}: {e}"));
            clusters.push(cluster);
            dbs.push(TestDb::at(&shard_url(i)).await);
        }
        Self::new(dbs, clusters)
    }

    async fn attach(name: &str) -> Self {
        Self::new(attach_shards(name).await, Vec::new())
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// The first shard's inbox; a consumer over every shard takes [`sharded_inbox`].
    fn inbox(&self) -> PgInbox {
        self.dbs[0].inbox()
    }

    async fn inbox_rows(&self) -> i64 {
        let mut rows = 0;
        for db in &self.dbs {
            rows += db.inbox_rows().await;
        }
        rows
    }

    async fn remove(self) {
        for db in self.dbs {
            db.drop().await;
        }
    }

    async fn apply(tx: &mut PgTx, id: &MessageId, event: &CreditEvent) -> Result<(), sqlx::Error> {
        TestDb::apply(tx, id, event).await
    }

    async fn first_handling(&self, id: &MessageId) -> Result<bool, sqlx::Error> {
        self.dbs[0].first_handling(id).await
    }

    /// The shards' ledgers together: an event applied in two shards counts as a duplicate.
    async fn summary(&self) -> Result<Summary, sqlx::Error> {
        let mut events = HashSet::new();
        let mut rows = 0;
        let (mut exact, mut total) = (true, 0);
        for db in &self.dbs {
            let ids: Vec<String> = sqlx::query_scalar("SELECT event_id FROM ledger")
                .fetch_all(&db.pool)
                .await?;
            rows += ids.len() as i64;
            events.extend(ids);
            let one = db.summary().await?;
            exact &= one.balances_exact;
            total += one.total_balance;
        }
        Ok(Summary {
            ledger_rows: rows,
            distinct_events: events.len() as i64,
            balances_exact: exact,
            total_balance: total,
        })
    }

    /// Every shard's accounts: an account in two shards appears twice.
    async fn balances(&self) -> Result<Vec<(i64, i64)>, sqlx::Error> {
        let mut all = Vec::new();
        for db in &self.dbs {
            all.extend(db.balances().await?);
        }
        Ok(all)
    }

    async fn stalls(&self) -> Result<i64, sqlx::Error> {
        self.dbs[0].stalls().await
    }

    async fn applied(&self, id: &MessageId) -> u64 {
        let mut rows = 0;
        for db in &self.dbs {
            rows += db.applied(id).await;
        }
        rows
    }

    async fn fail_and_swallow(&self, tx: &mut PgTx) {
        self.dbs[0].fail_and_swallow(tx).await;
    }
}
