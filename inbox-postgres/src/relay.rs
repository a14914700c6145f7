//! [`OutboxRelay`]: publishes the committed rows of an [`Outbox`] and marks them sent.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use inbox_core::{MessageId, OutgoingMessage, Publish, PublishError, Recovery};
use sqlx::AssertSqlSafe;

use crate::error::{db, recovery};
use crate::outbox::{OUTBOX_ERRORS_COUNTER, OUTBOX_PUBLISHED_COUNTER};
use crate::{Error, Outbox};

/// The longest wait between attempts while errors repeat.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

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
/// SKIP LOCKED`, one [`Publish::send_batch`] per destination of the batch (in order of each
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
#[must_use = "a relay does nothing until it is run or spawned"]
pub struct OutboxRelay<P> {
    outbox: Outbox,
    publisher: P,
    batch_size: i64,
    poll_interval: Duration,
    error_backoff: Duration,
    publish_timeout: Duration,
}

/// One row as the relay reads it: id, message ID, destination, key, payload, headers (JSON).
type Row = (i64, String, String, Option<String>, Vec<u8>, String);

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
    /// repeat, each wait shortened by up to half as [`inbox_core::backoff`] does, so relays in
    /// several processes do not retry in lockstep).
    pub fn error_backoff(mut self, wait: Duration) -> Self {
        self.error_backoff = wait;
        self
    }

    /// How long one [`Publish::send_batch`] call may take before the relay gives up on it, keeps
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
            let (published, failed) = match outcome {
                Ok(n) => (n, None),
                Err(Failed { published, error }) => (published, Some(error)),
            };
            if published > 0 {
                stats.published += published as u64;
                stats.batches += 1;
            }
            let wait = match failed {
                None => {
                    failures = 0;
                    if published == 0 && until_idle {
                        return Ok(stats);
                    }
                    if (published as i64) < self.batch_size {
                        self.poll_interval
                    } else {
                        Duration::ZERO
                    }
                }
                Some(error) => {
                    metrics::counter!(OUTBOX_ERRORS_COUNTER, "outbox" => self.outbox.label())
                        .increment(1);
                    if error.recovery() == Recovery::Fatal {
                        tracing::error!(table = %self.outbox.table(), error = %error, "outbox relay stops");
                        return Err(error);
                    }
                    failures = failures.saturating_add(1);
                    stats.errors += 1;
                    let wait = inbox_core::backoff(self.error_backoff, MAX_BACKOFF, failures);
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
        let database = |e| Failed {
            published: 0,
            error: RelayError::Database(e),
        };
        let mut tx = self
            .outbox
            .pool()
            .begin()
            .await
            .map_err(db("starting an outbox relay transaction"))
            .map_err(database)?;
        let rows: Vec<Row> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, message_id, destination, key, payload, headers::text FROM {t}
             WHERE sent_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
        )))
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
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {t} SET sent_at = clock_timestamp() WHERE id = ANY($1)"
                )))
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
        match tokio::time::timeout(limit, self.publisher.send_batch(destination, messages)).await {
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

/// The rows of one destination in a batch, in `id` order.
struct Group {
    destination: String,
    rows: Vec<i64>,
    messages: Vec<OutgoingMessage>,
    /// A row whose stored message ID or headers are unusable (written by hand): the group is
    /// not published.
    unusable: Option<PublishError>,
}

/// The rows per destination, destinations in order of their first row.
fn by_destination(rows: Vec<Row>) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (row, message_id, destination, key, payload, headers) in rows {
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
        match message(message_id, payload, key, &headers) {
            Ok(message) => group.messages.push(message),
            Err(e) => {
                group.unusable.get_or_insert_with(|| {
                    PublishError::new(
                        Recovery::Fatal,
                        format!("reading outbox row {row}"),
                        format!("{e}; fix or delete the row"),
                    )
                });
            }
        }
    }
    groups
}

/// The message a row stores, or what is wrong with it.
fn message(
    id: String,
    payload: Vec<u8>,
    key: Option<String>,
    headers: &str,
) -> Result<OutgoingMessage, String> {
    let id = MessageId::new(id).map_err(|e| format!("its message_id is unusable ({e})"))?;
    let headers: Vec<(String, String)> = serde_json::from_str(headers)
        .map_err(|e| format!("its headers are not an array of [name, value] text pairs ({e})"))?;
    let mut message = OutgoingMessage::new(id, payload);
    message.key = key;
    message.headers = headers
        .into_iter()
        .map(|(name, value)| (name, value.into_bytes()))
        .collect();
    Ok(message)
}
