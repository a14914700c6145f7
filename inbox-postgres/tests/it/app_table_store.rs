//! The store of `docs/writing-a-store.md`, verbatim: an inbox over an application's own table
//! of processed messages, on `PgTx`. The store suite runs on it, a handler written for
//! `PgInbox` runs on it unchanged, and a test checks the page still shows this very code.

// The page's store, from here to the end marker.
use std::collections::HashSet;
use std::time::Duration;

use inbox_core::{ConsumerBinding, InboxStore, InvalidId, MessageId, RefusedId, StoreError};
use inbox_postgres::sqlx::{self, PgPool};
use inbox_postgres::{Error, PgTx};

/// The application's table of processed messages, made by its own migrations.
const PROCESSED: &str = "CREATE TABLE processed (
    consumer     text         NOT NULL,
    message_id   varchar(200) NOT NULL,
    processed_at timestamptz  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id))";

/// The longest ID `processed.message_id` keeps, in characters.
const MAX_ID_CHARS: usize = 200;

/// An inbox over `processed`, in the schema of the pool's `search_path`.
#[derive(Debug, Clone)]
struct AppTableStore {
    pool: PgPool,
    consumer: String,
    /// The consumer's handler timeout, for the statements after the claim.
    handler_timeout: Option<Duration>,
}

impl AppTableStore {
    fn new(pool: PgPool) -> Self {
        Self {
            pool,
            consumer: String::new(), // set by `bind`
            handler_timeout: None,
        }
    }

    /// Forgets the claims older than `age`: a copy of such a message is applied again.
    async fn purge(&self, age: Duration) -> Result<u64, sqlx::Error> {
        let sql = "DELETE FROM processed WHERE processed_at < now() - make_interval(secs => $1)";
        let deleted = sqlx::query(sql)
            .bind(age.as_secs_f64())
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected())
    }
}

impl InboxStore for AppTableStore {
    type Tx = PgTx;

    fn bind(&self, binding: &ConsumerBinding) -> Self {
        let consumer = binding.consumer.clone();
        Self {
            consumer,
            handler_timeout: binding.handler_timeout,
            ..self.clone()
        }
    }

    async fn begin(&self) -> Result<PgTx, StoreError> {
        PgTx::begin(&self.pool).await // its commit refuses a transaction the server aborted
    }

    async fn claim(&self, tx: &mut PgTx, ids: &[MessageId]) -> Result<Vec<bool>, StoreError> {
        // An ID too long for the column is refused before anything is written: the consumer
        // dead-letters its message and applies the others.
        if let Some(index) = ids
            .iter()
            .position(|id| id.as_str().chars().count() > MAX_ID_CHARS)
        {
            let why = format!("an ID over {MAX_ID_CHARS} characters does not fit `processed`");
            let reason = InvalidId::RefusedByStore(why);
            return Err(RefusedId { index, reason }.into());
        }
        let keys: Vec<&str> = ids.iter().map(MessageId::as_str).collect();
        // The handler's bound, set by this statement for the statements after it: the insert
        // itself may wait on a peer's uncommitted claim, which is no handler's doing.
        let bound = self
            .handler_timeout
            .map(|t| t.as_millis().max(1).to_string());
        let (inserted, _): (Vec<String>, String) = sqlx::query_as(
            "WITH claimed AS (
                 INSERT INTO processed (consumer, message_id) SELECT $1, unnest($2::text[])
                 ON CONFLICT DO NOTHING RETURNING message_id)
             SELECT array(SELECT message_id FROM claimed)::text[],
                    set_config('statement_timeout',
                               coalesce($3, current_setting('statement_timeout')), true)",
        )
        .bind(&self.consumer)
        .bind(&keys)
        .bind(bound)
        .fetch_one(&mut **tx)
        .await
        .map_err(|source| {
            StoreError::from(Error::Database {
                context: "claiming",
                source,
            })
        })?;
        // One answer per ID, in order: `true` for the first occurrence of an inserted ID only.
        let mut new: HashSet<String> = inserted.into_iter().collect();
        Ok(ids.iter().map(|id| new.remove(id.as_str())).collect())
    }
}
// End of the page's store.

use inbox_conformance::wallet::{CreditEvent, Summary};
use inbox_conformance::{database_url, FaultProxy, TestDb, TestStore};
use inbox_core::{Consumer, Handler, HandlerError, Message};
use inbox_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use inbox_postgres::PgInbox;
use inbox_testkit::MemoryBroker;

/// [`AppTableStore`] under the suites: a schema of its own per scenario, holding `processed`
/// beside the wallet of [`TestDb`], which it delegates to.
#[derive(Debug, Clone)]
struct AppTable {
    db: TestDb,
    store: AppTableStore,
}

impl TestStore for AppTable {
    type Inbox = AppTableStore;

    async fn create() -> Self {
        let db = TestDb::new().await;
        sqlx::query(PROCESSED)
            .execute(&db.pool)
            .await
            .expect("create `processed`");
        Self::attach(&db.schema).await
    }

    async fn attach(schema: &str) -> Self {
        let db = TestDb::attach(schema).await;
        let store = AppTableStore::new(db.pool.clone());
        Self { db, store }
    }

    fn name(&self) -> &str {
        &self.db.schema
    }

    fn inbox(&self) -> AppTableStore {
        self.store.clone()
    }

    async fn inbox_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM processed")
            .fetch_one(&self.db.pool)
            .await
            .expect("count the claims")
    }

    async fn remove(self) {
        self.db.drop().await;
    }

    async fn apply(tx: &mut PgTx, id: &MessageId, event: &CreditEvent) -> sqlx::Result<()> {
        TestDb::apply(tx, id, event).await
    }

    async fn first_handling(&self, id: &MessageId) -> sqlx::Result<bool> {
        self.db.first_handling(id).await
    }

    async fn summary(&self) -> sqlx::Result<Summary> {
        self.db.summary().await
    }

    async fn balances(&self) -> sqlx::Result<Vec<(i64, i64)>> {
        self.db.balances().await
    }

    async fn stalls(&self) -> sqlx::Result<i64> {
        self.db.stalls().await
    }

    async fn applied(&self, id: &MessageId) -> u64 {
        self.db.applied(id).await
    }

    async fn fail_and_swallow(&self, tx: &mut PgTx) {
        self.db.fail_and_swallow(tx).await;
    }

    fn refused_id(&self) -> Option<MessageId> {
        MessageId::new("x".repeat(MAX_ID_CHARS + 1)).ok()
    }

    async fn age_and_purge(&self) -> Option<u64> {
        sqlx::query("UPDATE processed SET processed_at = processed_at - interval '30 days'")
            .execute(&self.db.pool)
            .await
            .expect("age the claims");
        let kept = Duration::from_secs(14 * 24 * 3600);
        Some(self.store.purge(kept).await.expect("purge"))
    }

    async fn proxied(&self) -> Option<(AppTableStore, FaultProxy)> {
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
        // A short acquire timeout, so a refused connection is an error the consumer sees.
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_millis(500))
            .test_before_acquire(false)
            .connect_lazy_with(options);
        Some((AppTableStore::new(pool), proxy))
    }
}

inbox_conformance::store_suite!(app_table, AppTable::create());

/// A handler written for `PgInbox`: it knows only `PgTx`.
struct Credit;

impl Handler<PgTx> for Credit {
    async fn handle(&self, tx: &mut PgTx, _: &MessageId, m: &Message) -> Result<(), HandlerError> {
        let cents: i64 = m.json()?;
        sqlx::query("UPDATE balances SET cents = cents + $1")
            .bind(cents)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// The same handler value type runs on `PgInbox` and on the application's table: each applies
/// the two distinct credits once and skips the copy.
#[tokio::test]
async fn a_handler_for_pg_inbox_runs_on_the_app_table_store() {
    let under_test = AppTable::create().await;
    let pool = under_test.db.pool.clone();
    sqlx::query("CREATE TABLE balances (cents bigint NOT NULL)")
        .execute(&pool)
        .await
        .expect("balances");
    sqlx::query("INSERT INTO balances VALUES (0)")
        .execute(&pool)
        .await
        .expect("a balance");
    let broker = MemoryBroker::new();
    for (id, cents) in [("evt-1", "100"), ("evt-2", "250"), ("evt-1", "100")] {
        broker.publish(Some(id), cents);
    }
    let on_app_table = Consumer::new("wallet", broker.source(), under_test.inbox(), Credit)
        .run_until_idle()
        .await
        .expect("the consumer on the app's table runs");
    assert_eq!(
        (on_app_table.applied, on_app_table.skipped_duplicates),
        (2, 1)
    );
    let claimed: Vec<String> =
        sqlx::query_scalar("SELECT message_id FROM processed ORDER BY message_id")
            .fetch_all(&pool)
            .await
            .expect("the claims");
    assert_eq!(claimed, ["evt-1", "evt-2"]);

    for (id, cents) in [("evt-3", "40"), ("evt-3", "40")] {
        broker.publish(Some(id), cents);
    }
    let inbox = PgInbox::new(pool.clone()); // migrated by `TestDb`
    let on_inbox = Consumer::new("wallet", broker.source(), inbox, Credit)
        .run_until_idle()
        .await
        .expect("the consumer on PgInbox runs");
    assert_eq!((on_inbox.applied, on_inbox.skipped_duplicates), (1, 1));
    let cents: i64 = sqlx::query_scalar("SELECT cents FROM balances")
        .fetch_one(&pool)
        .await
        .expect("the balance");
    assert_eq!(cents, 390);
    under_test.remove().await;
}

/// The claim bounds the statements after it by the consumer's handler timeout, and leaves the
/// statement timeout as it was when the consumer has none.
#[tokio::test]
async fn the_claim_sets_the_handler_timeout_for_the_statements_after_it() {
    let under_test = AppTable::create().await;
    let binding = ConsumerBinding::new("c");
    let show = "SHOW statement_timeout";
    let before: String = sqlx::query_scalar(show)
        .fetch_one(&under_test.db.pool)
        .await
        .expect("show");
    for (binding, expected) in [
        (binding.clone(), before.as_str()),
        (
            binding.handler_timeout(Duration::from_millis(1500)),
            "1500ms",
        ),
    ] {
        let store = under_test.inbox().bind(&binding);
        let mut tx = store.begin().await.expect("begin");
        let claimed = store.claim(&mut tx, &[MessageId::generate()]).await;
        assert_eq!(claimed.expect("claim"), [true]);
        let after: String = sqlx::query_scalar(show)
            .fetch_one(&mut *tx)
            .await
            .expect("show");
        assert_eq!(after, expected, "{binding:?}");
        inbox_core::Transaction::rollback(tx)
            .await
            .expect("rollback");
    }
    under_test.remove().await;
}

/// The page shows this file's store, character for character.
#[test]
fn the_page_shows_this_store() {
    let page = include_str!("../../../docs/writing-a-store.md");
    let this = include_str!("app_table_store.rs");
    let start = this
        .find("use std::collections")
        .expect("the store's start");
    let end = this
        .find("// End of the page's store.")
        .expect("the store's end");
    assert!(
        page.contains(&this[start..end]),
        "docs/writing-a-store.md shows another store than tests/it/app_table_store.rs: copy it over"
    );
}
