//! The PostgreSQL store under the store suite: a [`TestDb`] schema per scenario, the inbox in
//! one key mode (and the layout `INBOX_TEST_LAYOUT` names), and a table of effects.

use std::time::Duration;

use inbox_core::{HandlerError, MessageId};
use inbox_postgres::{KeyMode, PgInbox, PgTx, TableName};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::StoreUnderTest;
use crate::{database_url, FaultProxy, TestDb};

/// How long the suite's purge keeps claims; [`StoreUnderTest::age_and_purge`] ages them twice
/// as much.
const KEPT: Duration = Duration::from_secs(14 * 24 * 3600);

/// [`PgInbox`] in one [`KeyMode`], on a schema of its own.
#[derive(Debug)]
pub struct Postgres {
    db: TestDb,
    inbox: PgInbox,
    mode: KeyMode,
}

impl Postgres {
    /// A fresh schema with an inbox of `mode` keys and a table of effects.
    ///
    /// # Panics
    /// When PostgreSQL cannot be reached.
    pub async fn new(mode: KeyMode) -> Self {
        let db = TestDb::new().await;
        let inbox = db.inbox_named("store_inbox", mode);
        inbox.migrate().await.expect("migrate the inbox");
        sqlx::query("CREATE TABLE effects (message_id text NOT NULL)")
            .execute(&db.pool)
            .await
            .expect("the effects table");
        Self { db, inbox, mode }
    }
}

impl StoreUnderTest for Postgres {
    type Store = PgInbox;

    fn store(&self) -> PgInbox {
        self.inbox.clone()
    }

    async fn apply(&self, tx: &mut PgTx, id: &MessageId) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects VALUES ($1)")
            .bind(id.as_str())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn fail_and_swallow(&self, tx: &mut PgTx) {
        let failed = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
        assert!(failed.is_err(), "division by zero fails");
    }

    async fn applied(&self, id: &MessageId) -> u64 {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE message_id = $1")
            .bind(id.as_str())
            .fetch_one(&self.db.pool)
            .await
            .expect("count effects");
        u64::try_from(n).unwrap_or_default()
    }

    fn refused_id(&self) -> Option<MessageId> {
        (self.mode == KeyMode::Uuid).then(|| MessageId::new("not-a-uuid").expect("an ID"))
    }

    async fn age_and_purge(&self) -> Option<u64> {
        let minutes = i32::try_from(2 * KEPT.as_secs() / 60).expect("minutes");
        sqlx::query("UPDATE store_inbox SET processed_minute = processed_minute - $1")
            .bind(minutes)
            .execute(&self.db.pool)
            .await
            .expect("age the claims");
        let report = self.inbox.purge(KEPT, 1000).await.expect("purge");
        Some(report.deleted())
    }

    async fn proxied(&self) -> Option<(PgInbox, FaultProxy)> {
        let options: PgConnectOptions = database_url().parse().expect("DATABASE_URL parses");
        let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
            .await
            .expect("resolve the database")
            .next()
            .expect("the database has an address");
        let proxy = FaultProxy::start(upstream).await.expect("the proxy");
        let options = options
            .host("127.0.0.1")
            .port(proxy.addr().port())
            .options([("search_path", self.db.schema.as_str())]);
        // No ping per acquire; a short acquire timeout, so a refused connection is an error the
        // consumer sees, not a wait.
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_millis(500))
            .test_before_acquire(false)
            .connect_lazy_with(options);
        let table = TableName::qualified(&self.db.schema, "store_inbox").expect("table name");
        let mut inbox = PgInbox::new(pool)
            .with_table(table)
            .with_key_mode(self.mode);
        if crate::partitioned_layout() {
            inbox = inbox.partitioned(inbox_postgres::Partitions::default());
        }
        Some((inbox, proxy))
    }

    async fn cleanup(self) {
        self.db.drop().await;
    }
}
