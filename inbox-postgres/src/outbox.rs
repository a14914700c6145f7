//! The transactional outbox: a handler writes outgoing messages into an outbox table inside its
//! inbox transaction, and an [`OutboxRelay`] publishes them to a broker through any
//! [`Publish`] implementation, marking each row sent only after the broker confirmed it.
//!
//! See [`Outbox`] for an example, delivery and order.

use std::ops::DerefMut;
use std::time::Duration;

use inbox_core::{MessageId, OutgoingMessage, Publish};
use sqlx::types::chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use tokio::task::JoinHandle;

use crate::error::db;
use crate::migration::Migration;
use crate::retention::delete_in_batches;
use crate::{Error, OutboxRelay, Result, TableName};

/// The gauge [`Outbox::oldest_unsent`] sets, per `outbox` label (`schema.table` or `table`):
/// seconds since the next row to publish was written, 0 when every row is sent. Page when it
/// keeps growing: no relay runs, or the broker refuses.
pub const OUTBOX_OLDEST_UNSENT_GAUGE: &str = "inbox_outbox_oldest_unsent_age_seconds";

/// The counter of outbox rows published and marked sent, per `outbox` label.
pub const OUTBOX_PUBLISHED_COUNTER: &str = "inbox_outbox_published_total";

/// The counter of failed relay batches (a publish or a database error), per `outbox` label.
pub const OUTBOX_ERRORS_COUNTER: &str = "inbox_outbox_errors_total";

/// The outbox table: messages to publish, written in the caller's transaction.
///
/// One row per message: `id` (`bigint` identity, the publishing order), `message_id` (`text`),
/// `destination` (`text`, a topic, queue or stream name for the relay's [`Publish`]), `key`
/// (`text`, nullable), `payload` (`bytea`), `headers` (`jsonb`, an array of `[name, value]`
/// text pairs, `[]` for none), `created_at` and `sent_at` (`timestamptz`, null until the broker
/// confirmed). A partial index on `id` over the unsent rows keeps finding them cheap
/// however many sent rows wait for [`purge_sent`](Outbox::purge_sent).
///
/// ```no_run
/// use inbox_core::{Consumer, Handler, HandlerError, Message, MessageId};
/// use inbox_core::{MessageSource, Publish};
/// use inbox_postgres::{Outbox, PgInbox, PgTx};
///
/// /// Confirms each order, and tells the shipping service, in the transaction that claims the
/// /// order's message.
/// struct ConfirmOrder {
///     outbox: Outbox,
/// }
///
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
/// /// `source`: any adapter's source; `publisher`: a `KafkaProducer`, `SqsProducer`,
/// /// `RabbitProducer` or `RedisStreamProducer`, or `Destinations` of several.
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
/// [`Publish::send_batch`] call per destination, so rows written by one transaction, and by
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
            table: TableName::default_name("outbox"),
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
        let lock = format!("inbox outbox migrate {t}");
        let mut migration = Migration::begin(&self.pool, lock, "creating the outbox table").await?;
        let statements = [
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                    message_id text NOT NULL,
                    destination text NOT NULL,
                    key text,
                    payload bytea NOT NULL,
                    headers jsonb NOT NULL DEFAULT '[]',
                    created_at timestamptz NOT NULL DEFAULT now(),
                    sent_at timestamptz)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {index} ON {t} (id) WHERE sent_at IS NULL",
                index = t.sibling_bare("unsent")
            ),
            // A table made before the column gains it. The catalog is asked first: `ALTER TABLE`
            // takes its exclusive lock even when the column is there, and would queue behind a
            // relay's open transaction, and every writer behind it.
            format!(
                "DO $$ BEGIN
                    IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = '{t}'::regclass
                                   AND attname = 'headers' AND NOT attisdropped) THEN
                        ALTER TABLE {t} ADD COLUMN IF NOT EXISTS headers jsonb NOT NULL DEFAULT '[]';
                    END IF;
                END $$"
            ),
        ];
        migration.run(statements).await?;
        migration.commit().await
    }

    /// Writes `payload` for `destination` under a fresh UUIDv7 ID, in `tx` (the handler's inbox
    /// transaction): the row exists if and only if `tx` commits. Returns the ID the message will
    /// carry on every publish.
    pub async fn write(
        &self,
        tx: &mut (impl DerefMut<Target = PgConnection> + Send),
        destination: &str,
        payload: impl AsRef<[u8]>,
    ) -> Result<MessageId> {
        let message = OutgoingMessage::new(MessageId::generate(), payload.as_ref());
        self.write_message(tx, destination, &message).await?;
        Ok(message.id)
    }

    /// Writes `message` (its own ID, say one derived from the incoming message's, key and
    /// headers) for `destination`, in `tx`. The current span's trace context is stored with it
    /// as `traceparent` unless it has one ([`OutgoingMessage::traced_headers`]), so the
    /// consumer's trace continues the writer's, not the relay's.
    ///
    /// # Errors
    /// [`Error::HeaderNotText`](crate::Error::HeaderNotText) for a header value that is not
    /// UTF-8; a database error.
    pub async fn write_message(
        &self,
        tx: &mut (impl DerefMut<Target = PgConnection> + Send),
        destination: &str,
        message: &OutgoingMessage,
    ) -> Result<()> {
        self.write_all(tx, destination, std::slice::from_ref(message))
            .await
    }

    /// Writes all `messages` for `destination` in one statement, in `tx`, in slice order (the
    /// order they are published in), their headers as [`write_message`](Self::write_message)
    /// does.
    pub async fn write_all(
        &self,
        tx: &mut (impl DerefMut<Target = PgConnection> + Send),
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
        let keys: Vec<Option<&str>> = messages.iter().map(|m| m.key.as_deref()).collect();
        let payloads: Vec<&[u8]> = messages.iter().map(|m| m.payload.as_slice()).collect();
        let headers = messages
            .iter()
            .map(headers_json)
            .collect::<Result<Vec<String>>>()?;
        let t = &self.table;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {t} (message_id, destination, key, payload, headers)
             SELECT m, $1, k, p, h::jsonb
             FROM unnest($2::text[], $3::text[], $4::bytea[], $5::text[])
                 WITH ORDINALITY AS u(m, k, p, h, n)
             ORDER BY n"
        )))
        .bind(destination)
        .bind(&ids)
        .bind(&keys)
        .bind(&payloads)
        .bind(&headers)
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
        // Every statement in a transaction, so a transaction pooler runs it whole.
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(db("reading the database clock"))?;
        let cutoff: DateTime<Utc> = sqlx::query_scalar("SELECT now() - make_interval(secs => $1)")
            .bind(older_than.as_secs_f64())
            .fetch_one(&mut *tx)
            .await
            .map_err(db("reading the database clock"))?;
        tx.commit()
            .await
            .map_err(db("reading the database clock"))?;
        // Through the primary key from the oldest row: sent rows are mostly the oldest ones.
        let sql = format!(
            "DELETE FROM {t} WHERE id IN (
                SELECT id FROM {t} WHERE sent_at < $1 ORDER BY id LIMIT $2
                FOR UPDATE SKIP LOCKED)"
        );
        let context = "deleting sent outbox rows";
        let mut conn = self.pool.acquire().await.map_err(db(context))?;
        let batches = delete_in_batches(&mut conn, &sql, (cutoff, batch), false, context).await?;
        Ok(batches.iter().sum())
    }

    /// How long ago the next row to publish (the unsent row with the lowest `id`) was written;
    /// `None` when every row is sent. Sets the [`OUTBOX_OLDEST_UNSENT_GAUGE`] gauge (0 when
    /// none). One probe of the unsent-rows index: cheap enough to run every few seconds.
    pub async fn oldest_unsent(&self) -> Result<Option<Duration>> {
        let t = &self.table;
        // No parameter: the simple query protocol, which a transaction pooler passes whole.
        let age: Option<f64> = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT extract(epoch FROM now() - created_at)::float8 FROM {t}
             WHERE sent_at IS NULL ORDER BY id LIMIT 1"
        )))
        .fetch_optional(&self.pool)
        .await
        .and_then(|row| row.map(|row| row.try_get(0)).transpose())
        .map_err(db("reading the oldest unsent outbox row"))?;
        let age = age.map(|secs| Duration::try_from_secs_f64(secs).unwrap_or_default());
        metrics::gauge!(OUTBOX_OLDEST_UNSENT_GAUGE, "outbox" => self.label())
            .set(age.unwrap_or_default().as_secs_f64());
        Ok(age)
    }

    /// The `outbox` label of this table's metrics: `schema.table`, or `table`.
    pub(crate) fn label(&self) -> String {
        match self.table.schema() {
            Some(schema) => format!("{schema}.{}", self.table.table()),
            None => self.table.table().to_owned(),
        }
    }
}

/// The `headers` column's JSON for `message`: its [`traced_headers`](OutgoingMessage::traced_headers)
/// as `[name, value]` pairs, in order.
fn headers_json(message: &OutgoingMessage) -> Result<String> {
    let mut pairs = Vec::new();
    for (name, value) in message.traced_headers() {
        let value = String::from_utf8(value.into_owned()).map_err(|_| Error::HeaderNotText {
            id: message.id.to_string(),
            name: name.to_owned(),
        })?;
        pairs.push(serde_json::json!([name, value]));
    }
    Ok(serde_json::Value::Array(pairs).to_string())
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
