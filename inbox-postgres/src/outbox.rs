//! The transactional outbox: a handler writes outgoing messages into an outbox table inside its
//! inbox transaction, and an [`OutboxRelay`] publishes them to a broker through any
//! [`Publish`] implementation, marking each row sent only after the broker confirmed it.
//!
//! See [`Outbox`] for an example, delivery and order.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use inbox_core::{MessageId, OutgoingMessage, Publish, PublishError, Recovery};
use sqlx::types::chrono::{DateTime, Utc};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::task::JoinHandle;

use crate::error::{db, recovery};
use crate::{Error, Result, TableName};

/// The gauge [`Outbox::oldest_unsent`] sets, per `outbox` label (`schema.table` or `table`):
/// seconds since the next row to publish was written, 0 when every row is sent. Page when it
/// keeps growing: no relay runs, or the broker refuses.
pub const OUTBOX_OLDEST_UNSENT_GAUGE: &str = "inbox_outbox_oldest_unsent_age_seconds";

/// The counter of outbox rows published and marked sent, per `outbox` label.
pub const OUTBOX_PUBLISHED_COUNTER: &str = "inbox_outbox_published_total";

/// The counter of failed relay batches (a publish or a database error), per `outbox` label.
pub const OUTBOX_ERRORS_COUNTER: &str = "inbox_outbox_errors_total";

/// The longest wait between attempts while errors repeat.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The outbox table: messages to publish, written in the caller's transaction.
///
/// One row per message: `id` (`bigint` identity, the publishing order), `message_id` (`text`),
/// `destination` (`text`, a topic, queue or stream name for the relay's [`Publish`]), `key`
/// (`text`, nullable), `payload` (`bytea`), `created_at` and `sent_at` (`timestamptz`, null until
/// the broker confirmed). A partial index on `id` over the unsent rows keeps finding them cheap
/// however many sent rows wait for [`purge_sent`](Outbox::purge_sent).
///
/// ```no_run
/// use inbox_core::{async_trait, Consumer, Handler, HandlerError, Message, MessageId};
/// use inbox_core::{MessageSource, Publish};
/// use inbox_postgres::{Outbox, PgInbox, PgTx};
///
/// /// Confirms each order, and tells the shipping service, in the transaction that claims the
/// /// order's message.
/// struct ConfirmOrder {
///     outbox: Outbox,
/// }
///
/// #[async_trait]
/// impl Handler<PgTx> for ConfirmOrder {
///     async fn handle(&self, tx: &mut PgTx, id: &MessageId, message: &Message) -> Result<(), HandlerError> {
///         sqlx::query("UPDATE orders SET confirmed = true WHERE event_id = $1")
///             .bind(id.as_str())
///             .execute(&mut **tx)
///             .await?;
///         // Commits with the claim and the update, or not at all.
///         self.outbox.write(tx, "shipments", &message.payload).await?;
///         Ok(())
///     }
/// }
///
/// /// `source`: any adapter's source; `publisher`: a `KafkaProducer`, `SqsSender`,
/// /// `RabbitPublisher` or `RedisStreamProducer` for `shipments`, or `Destinations` of several.
/// async fn run(
///     source: impl MessageSource,
///     publisher: impl Publish + 'static,
/// ) -> Result<(), Box<dyn std::error::Error>> {
///     let pool = sqlx::PgPool::connect("postgres://postgres:postgres@127.0.0.1:5432/inbox").await?;
///     let (inbox, outbox) = (PgInbox::new(pool.clone()), Outbox::new(pool));
///     inbox.migrate().await?;
///     outbox.migrate().await?;
///     // Any number of relays, in this process or others: each row is sent by one at a time.
///     tokio::spawn(outbox.relay(publisher).batch_size(500).run());
///     Consumer::new("confirm", source, inbox, ConfirmOrder { outbox }).run().await?;
///     Ok(())
/// }
/// ```
///
/// ## Delivery
///
/// At least once, with a stable ID: each row's [`MessageId`] (a UUIDv7 unless the writer gives
/// one) goes out with every publish of the row. A relay that dies (or whose database connection
/// fails) after the broker confirmed and before it committed `sent_at` leaves the row unsent, and
/// it is published again under the same ID; the consuming inbox skips the copy.
///
/// ## Order
///
/// A relay publishes the unsent rows it locked in `id` order, in one
/// [`Publish::publish_to`] call per destination, so rows written by one transaction, and by
/// transactions that ran one after the other (as one consumer lane's do), reach a destination in
/// the order written. Rows of transactions that overlap go out in the order of their `id`s among
/// those committed when the relay looks, so a transaction that commits late may see its rows
/// published after rows written later.
/// That order is kept only while nothing fails and one relay runs: after a failed publish the
/// rows go out again after newer rows may already have reached the broker, and several relays
/// publish their batches side by side. Where the consumer needs order across batches, run one
/// relay (and, in any case, key the messages: a Kafka key, an SQS FIFO group).
#[derive(Debug, Clone)]
pub struct Outbox {
    pool: PgPool,
    table: TableName,
}

impl Outbox {
    /// The outbox in table `outbox` of the connection's `search_path`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            table: TableName::new("outbox").expect("`outbox` is a plain identifier"),
        }
    }

    /// Uses another table (see [`TableName`], which refuses names that are not plain SQL
    /// identifiers).
    pub fn with_table(mut self, table: TableName) -> Self {
        self.table = table;
        self
    }

    /// The pool this outbox uses (the relay's transactions, the purge, the gauge).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Creates the outbox table and its index if missing; safe to run from many instances at
    /// once (they serialise on an advisory lock).
    pub async fn migrate(&self) -> Result<()> {
        let t = &self.table;
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(db("starting the outbox migration"))?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("inbox outbox migrate {t}"))
            .execute(&mut *tx)
            .await
            .map_err(db("taking the outbox migration lock"))?;
        let statements = [
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                    message_id text NOT NULL,
                    destination text NOT NULL,
                    key text,
                    payload bytea NOT NULL,
                    created_at timestamptz NOT NULL DEFAULT now(),
                    sent_at timestamptz)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {index} ON {t} (id) WHERE sent_at IS NULL",
                index = t.sibling_bare("unsent")
            ),
        ];
        for statement in statements {
            sqlx::query(&statement)
                .execute(&mut *tx)
                .await
                .map_err(db("creating the outbox table"))?;
        }
        tx.commit()
            .await
            .map_err(db("committing the outbox migration"))
    }

    /// Writes `payload` for `destination` under a fresh UUIDv7 ID, in `tx` (the handler's inbox
    /// transaction): the row exists if and only if `tx` commits. Returns the ID the message will
    /// carry on every publish.
    pub async fn write(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        destination: &str,
        payload: impl AsRef<[u8]>,
    ) -> Result<MessageId> {
        let message = OutgoingMessage::new(MessageId::generate(), payload.as_ref());
        self.write_message(tx, destination, &message).await?;
        Ok(message.id)
    }

    /// Writes `message` (its own ID, say one derived from the incoming message's, and key) for
    /// `destination`, in `tx`.
    pub async fn write_message(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        destination: &str,
        message: &OutgoingMessage,
    ) -> Result<()> {
        let t = &self.table;
        sqlx::query(&format!(
            "INSERT INTO {t} (message_id, destination, key, payload) VALUES ($1, $2, $3, $4)"
        ))
        .bind(message.id.as_str())
        .bind(destination)
        .bind(message.key.as_deref())
        .bind(&message.payload)
        .execute(&mut **tx)
        .await
        .map_err(db("writing an outbox row"))?;
        Ok(())
    }

    /// Writes all `messages` for `destination` in one statement, in `tx`, in slice order (the
    /// order they are published in).
    pub async fn write_all(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
        let keys: Vec<Option<&str>> = messages.iter().map(|m| m.key.as_deref()).collect();
        let payloads: Vec<&[u8]> = messages.iter().map(|m| m.payload.as_slice()).collect();
        let t = &self.table;
        sqlx::query(&format!(
            "INSERT INTO {t} (message_id, destination, key, payload)
             SELECT m, $1, k, p
             FROM unnest($2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS u(m, k, p, n)
             ORDER BY n"
        ))
        .bind(destination)
        .bind(&ids)
        .bind(&keys)
        .bind(&payloads)
        .execute(&mut **tx)
        .await
        .map_err(db("writing outbox rows"))?;
        Ok(())
    }

    /// A relay publishing this outbox's rows through `publisher`.
    pub fn relay<P: Publish>(&self, publisher: P) -> OutboxRelay<P> {
        OutboxRelay::new(self.clone(), publisher)
    }

    /// Deletes rows sent more than `older_than` ago, `batch` rows per statement (at least 1),
    /// until a statement deletes nothing, and returns how many it deleted. Unsent rows are never
    /// deleted, however old. Each statement is its own short transaction; rows another purge is
    /// deleting are skipped (`SKIP LOCKED`), so purges running at once do not wait on each
    /// other. The cutoff is taken once, from the database clock that stamped `sent_at`.
    ///
    /// Keep sent rows as long as you may want to look up what was published; the consumers'
    /// inboxes, not this table, make a second publish harmless.
    pub async fn purge_sent(&self, older_than: Duration, batch: i64) -> Result<u64> {
        let t = &self.table;
        let cutoff: DateTime<Utc> = sqlx::query_scalar("SELECT now() - make_interval(secs => $1)")
            .bind(older_than.as_secs_f64())
            .fetch_one(&self.pool)
            .await
            .map_err(db("reading the database clock"))?;
        // Through the primary key from the oldest row: sent rows are mostly the oldest ones.
        let sql = format!(
            "DELETE FROM {t} WHERE id IN (
                SELECT id FROM {t} WHERE sent_at < $1 ORDER BY id LIMIT $2
                FOR UPDATE SKIP LOCKED)"
        );
        let mut deleted = 0;
        loop {
            let n = sqlx::query(&sql)
                .bind(cutoff)
                .bind(batch.max(1))
                .execute(&self.pool)
                .await
                .map_err(db("deleting sent outbox rows"))?
                .rows_affected();
            if n == 0 {
                return Ok(deleted);
            }
            deleted += n;
        }
    }

    /// How long ago the next row to publish (the unsent row with the lowest `id`) was written;
    /// `None` when every row is sent. Sets the [`OUTBOX_OLDEST_UNSENT_GAUGE`] gauge (0 when
    /// none). One probe of the unsent-rows index: cheap enough to run every few seconds.
    pub async fn oldest_unsent(&self) -> Result<Option<Duration>> {
        let t = &self.table;
        let age: Option<f64> = sqlx::query_scalar(&format!(
            "SELECT extract(epoch FROM now() - created_at)::float8 FROM {t}
             WHERE sent_at IS NULL ORDER BY id LIMIT 1"
        ))
        .fetch_optional(&self.pool)
        .await
        .map_err(db("reading the oldest unsent outbox row"))?;
        let age = age.map(|secs| Duration::try_from_secs_f64(secs).unwrap_or_default());
        metrics::gauge!(OUTBOX_OLDEST_UNSENT_GAUGE, "outbox" => self.label())
            .set(age.unwrap_or_default().as_secs_f64());
        Ok(age)
    }

    /// The `outbox` label of this table's metrics: `schema.table`, or `table`.
    fn label(&self) -> String {
        match self.table.schema() {
            Some(schema) => format!("{schema}.{}", self.table.table()),
            None => self.table.table().to_owned(),
        }
    }
}

/// Runs [`Outbox::purge_sent`] of rows sent more than `retention` ago, then refreshes the
/// [`OUTBOX_OLDEST_UNSENT_GAUGE`] gauge, every `every` (the first right away) until the handle is
/// aborted: pick `every` for the gauge's resolution (say 15 s); a purge with nothing expired is
/// one index probe. Runs beside the relays, not in them, so the gauge keeps growing when no
/// relay runs. Failures are logged and retried next period.
pub fn spawn_outbox_purger(outbox: Outbox, retention: Duration, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every.max(Duration::from_secs(1)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match outbox
                .purge_sent(retention, crate::DEFAULT_PURGE_BATCH)
                .await
            {
                Ok(deleted) if deleted > 0 => {
                    tracing::info!(table = %outbox.table(), deleted, "outbox purge done");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(table = %outbox.table(), error = %e, "outbox purge failed; retrying next period");
                }
            }
            if let Err(e) = outbox.oldest_unsent().await {
                tracing::warn!(table = %outbox.table(), error = %e, "outbox gauge not refreshed");
            }
        }
    })
}

/// Why an [`OutboxRelay`] failed. The relay's run loops retry what [`RelayError::recovery`]
/// says may pass, and stop with the rest.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// Reading or marking the outbox failed. Nothing was lost: unmarked rows are published
    /// again under the same IDs.
    #[error("outbox relay: {0}")]
    Database(#[source] Error),
    /// The publisher failed for `destination`; the rows stay unsent.
    #[error(
        "outbox relay: publishing to `{destination}` (outbox rows from id {row}) failed; the rows \
         stay unsent and are published again under the same IDs: {source}"
    )]
    Publish {
        /// The destination of the failed rows.
        destination: String,
        /// The `id` of the first failed row.
        row: i64,
        /// The publisher's error.
        #[source]
        source: PublishError,
    },
}

impl RelayError {
    /// Whether another attempt can help: a lost connection or a broker hiccup passes; a missing
    /// table, an unknown destination or a message the broker refuses for good does not.
    pub fn recovery(&self) -> Recovery {
        match self {
            RelayError::Database(Error::Database { source, .. }) => recovery(source),
            RelayError::Database(_) => Recovery::Fatal,
            RelayError::Publish { source, .. } => source.recovery(),
        }
    }
}

/// What a relay did until it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Rows published and marked sent.
    pub published: u64,
    /// Transactions that marked at least one row sent.
    pub batches: u64,
    /// Failed batches that were retried after a backoff.
    pub errors: u64,
}

/// Publishes an [`Outbox`]'s rows through a [`Publish`] and marks them sent.
///
/// Each round is one transaction: `SELECT … WHERE sent_at IS NULL ORDER BY id LIMIT n FOR UPDATE
/// SKIP LOCKED`, one [`Publish::publish_to`] per destination of the batch (in order of each
/// destination's first row), `UPDATE … SET sent_at` for the rows whose destination confirmed,
/// `COMMIT`. Relays running at once (in one process or many) lock disjoint rows, so a row is in
/// one relay's hands at a time; only a relay that dies, or loses its database connection,
/// between the broker's confirm and its commit leaves a row to be published a second time.
///
/// While the broker is being called the batch's rows stay locked and the transaction open, so
/// keep [`batch_size`](Self::batch_size) moderate; a session limit such as
/// `idle_in_transaction_session_timeout` must exceed the slowest publish.
///
/// A full batch is followed by the next at once; a short one by a pause of
/// [`poll_interval`](Self::poll_interval) (default 100 ms), so an idle relay costs one index
/// probe per interval. Polling rather than `LISTEN`/`NOTIFY`: a `NOTIFY` in every writing
/// transaction would make each of their commits take PostgreSQL's notification-queue lock, one
/// commit at a time across the database.
///
/// Errors: a failing destination leaves its rows unsent while the other destinations of the
/// batch are marked; then the relay backs off ([`error_backoff`](Self::error_backoff), doubling
/// up to 30 s) and tries again, unless the error is [`Recovery::Fatal`] (an unknown destination,
/// a missing table), which stops the relay with [`RelayError`]: fix it and start it again. The
/// unsent rows of one destination come first in every batch, so a destination that stays down
/// with a backlog of `batch_size` rows holds back the others.
#[derive(Debug)]
pub struct OutboxRelay<P> {
    outbox: Outbox,
    publisher: P,
    batch_size: i64,
    poll_interval: Duration,
    error_backoff: Duration,
    publish_timeout: Duration,
}

/// One row as the relay reads it.
type Row = (i64, String, String, Option<String>, Vec<u8>);

impl<P: Publish> OutboxRelay<P> {
    /// A relay of `outbox` through `publisher` (see also [`Outbox::relay`]).
    pub fn new(outbox: Outbox, publisher: P) -> Self {
        Self {
            outbox,
            publisher,
            batch_size: 100,
            poll_interval: Duration::from_millis(100),
            error_backoff: Duration::from_millis(500),
            publish_timeout: Duration::from_secs(60),
        }
    }

    /// Rows per transaction (default 100, at least 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = i64::try_from(n.max(1)).unwrap_or(i64::MAX);
        self
    }

    /// The pause after a batch that found fewer rows than the batch size (default 100 ms): the
    /// longest extra delay a row written to an idle outbox waits.
    pub fn poll_interval(mut self, wait: Duration) -> Self {
        self.poll_interval = wait;
        self
    }

    /// The first wait after a failed batch (default 500 ms, doubling up to 30 s while failures
    /// repeat).
    pub fn error_backoff(mut self, wait: Duration) -> Self {
        self.error_backoff = wait;
        self
    }

    /// How long one [`Publish::publish_to`] call may take before the relay gives up on it, keeps
    /// its rows unsent and retries after a backoff (default 60 s): a broker that blocks
    /// publishers (a RabbitMQ memory alarm) or a network that swallows packets must not hold
    /// the rows' locks, or a shutdown, for good. Copies that the broker still stores after the
    /// relay gave up are published again under the same IDs.
    pub fn publish_timeout(mut self, limit: Duration) -> Self {
        self.publish_timeout = limit;
        self
    }

    /// Runs until Ctrl-C (SIGINT), then finishes the batch in flight and returns.
    pub async fn run(self) -> Result<RelayStats, RelayError> {
        self.run_until(async {
            // If no signal handler can be installed, run until the process ends.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
        .await
    }

    /// Runs until `shutdown` completes. The batch in flight is published, marked and committed
    /// first: stopping never cuts a publish short.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<RelayStats, RelayError> {
        self.run_loop(shutdown, false).await
    }

    /// Runs until a batch finds no unsent row it can lock, then returns: for draining in tools
    /// and tests. Rows another relay holds at that moment are left to it.
    pub async fn run_until_idle(self) -> Result<RelayStats, RelayError> {
        self.run_loop(std::future::pending(), true).await
    }

    async fn run_loop(
        self,
        shutdown: impl Future<Output = ()> + Send,
        until_idle: bool,
    ) -> Result<RelayStats, RelayError> {
        tokio::pin!(shutdown);
        let mut stats = RelayStats::default();
        let mut failures: u32 = 0;
        let mut stopping = false;
        loop {
            let batch = self.publish_batch();
            tokio::pin!(batch);
            let outcome = loop {
                tokio::select! {
                    outcome = &mut batch => break outcome,
                    () = &mut shutdown, if !stopping => stopping = true,
                }
            };
            let wait = match outcome {
                Ok(n) => {
                    failures = 0;
                    if n > 0 {
                        stats.published += n as u64;
                        stats.batches += 1;
                    }
                    if n == 0 && until_idle {
                        return Ok(stats);
                    }
                    if (n as i64) < self.batch_size {
                        self.poll_interval
                    } else {
                        Duration::ZERO
                    }
                }
                Err(Failed { published, error }) => {
                    if published > 0 {
                        stats.published += published as u64;
                        stats.batches += 1;
                    }
                    metrics::counter!(OUTBOX_ERRORS_COUNTER, "outbox" => self.outbox.label())
                        .increment(1);
                    if error.recovery() == Recovery::Fatal {
                        tracing::error!(table = %self.outbox.table(), error = %error, "outbox relay stops");
                        return Err(error);
                    }
                    failures = failures.saturating_add(1);
                    stats.errors += 1;
                    let wait = backoff(self.error_backoff, failures);
                    tracing::warn!(
                        table = %self.outbox.table(),
                        error = %error,
                        retry_in = ?wait,
                        "outbox relay batch failed; retrying"
                    );
                    wait
                }
            };
            if stopping {
                return Ok(stats);
            }
            if !wait.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = &mut shutdown => return Ok(stats),
                }
            }
        }
    }

    /// One round: locks up to `batch_size` unsent rows, publishes them per destination, marks
    /// those confirmed, commits. Returns how many rows it marked sent (0: nothing to lock); on
    /// error, how many it still marked, with the error.
    async fn publish_batch(&self) -> Result<usize, Failed> {
        let started = Instant::now();
        let t = self.outbox.table();
        let database = |e| Failed::new(RelayError::Database(e));
        let mut tx = self
            .outbox
            .pool
            .begin()
            .await
            .map_err(db("starting an outbox relay transaction"))
            .map_err(database)?;
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "SELECT id, message_id, destination, key, payload FROM {t}
             WHERE sent_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
        ))
        .bind(self.batch_size)
        .fetch_all(&mut *tx)
        .await
        .map_err(db("locking unsent outbox rows"))
        .map_err(database)?;
        if rows.is_empty() {
            // Nothing written: ending the transaction either way releases nothing of note.
            let _ = tx.rollback().await;
            return Ok(0);
        }

        let mut confirmed: Vec<i64> = Vec::with_capacity(rows.len());
        let mut failure: Option<RelayError> = None;
        for group in by_destination(rows) {
            let result = match group.unusable {
                None => {
                    self.publish_timed(&group.destination, &group.messages)
                        .await
                }
                Some(e) => Err(e),
            };
            match result {
                Ok(()) => confirmed.extend(group.rows),
                Err(source) => {
                    let error = RelayError::Publish {
                        row: group.rows[0],
                        destination: group.destination,
                        source,
                    };
                    // A fatal error is the one to report: it stops the relay.
                    if failure
                        .as_ref()
                        .is_none_or(|f| f.recovery() != Recovery::Fatal)
                    {
                        failure = Some(error);
                    }
                }
            }
        }

        let marked = if confirmed.is_empty() {
            let _ = tx.rollback().await;
            0
        } else {
            let mark = async {
                sqlx::query(&format!(
                    "UPDATE {t} SET sent_at = clock_timestamp() WHERE id = ANY($1)"
                ))
                .bind(&confirmed)
                .execute(&mut *tx)
                .await
                .map_err(db("marking outbox rows sent"))?;
                tx.commit().await.map_err(db("committing sent outbox rows"))
            };
            mark.await.map_err(database)?;
            metrics::counter!(OUTBOX_PUBLISHED_COUNTER, "outbox" => self.outbox.label())
                .increment(confirmed.len() as u64);
            tracing::debug!(table = %t, rows = confirmed.len(), elapsed = ?started.elapsed(), "outbox rows published");
            confirmed.len()
        };
        match failure {
            None => Ok(marked),
            Some(error) => Err(Failed {
                published: marked,
                error,
            }),
        }
    }

    /// One destination's messages, within the publish timeout.
    async fn publish_timed(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let limit = self.publish_timeout;
        match tokio::time::timeout(limit, self.publisher.publish_to(destination, messages)).await {
            Ok(result) => result,
            Err(_) => Err(PublishError::new(
                Recovery::Retry,
                format!("publishing to `{destination}`"),
                format!(
                    "the broker did not confirm {} messages within {limit:?} (the relay's \
                     publish_timeout); they are published again",
                    messages.len()
                ),
            )),
        }
    }
}

/// A failed round, with the rows it still marked sent.
struct Failed {
    published: usize,
    error: RelayError,
}

impl Failed {
    fn new(error: RelayError) -> Self {
        Self {
            published: 0,
            error,
        }
    }
}

/// The rows of one destination in a batch, in `id` order.
struct Group {
    destination: String,
    rows: Vec<i64>,
    messages: Vec<OutgoingMessage>,
    /// A row whose stored message ID is unusable (written by hand): the group is not published.
    unusable: Option<PublishError>,
}

/// The rows per destination, destinations in order of their first row.
fn by_destination(rows: Vec<Row>) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (row, message_id, destination, key, payload) in rows {
        let slot = *index.entry(destination.clone()).or_insert_with(|| {
            groups.push(Group {
                destination,
                rows: Vec::new(),
                messages: Vec::new(),
                unusable: None,
            });
            groups.len() - 1
        });
        let group = &mut groups[slot];
        group.rows.push(row);
        match MessageId::new(message_id) {
            Ok(id) => group.messages.push(OutgoingMessage { id, payload, key }),
            Err(e) => {
                group.unusable.get_or_insert_with(|| {
                    PublishError::new(
                        Recovery::Fatal,
                        format!("reading outbox row {row}"),
                        format!("its message_id is unusable ({e}); fix or delete the row"),
                    )
                });
            }
        }
    }
    groups
}

/// `initial`, doubling per repeated failure, capped at 30 s.
fn backoff(initial: Duration, failures: u32) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(16));
    initial.saturating_mul(factor).min(MAX_BACKOFF)
}
