//! Inbox, then outbox: a handler writes outbox rows ([`Outbox`]) in its inbox transaction, an
//! [`OutboxRelay`](inbox_postgres::OutboxRelay) publishes them through the adapter's producer
//! ([`TestQueue::producer`]), and a downstream inbox consumer applies each once: also when a
//! lost confirm makes the relay publish a batch again, and when two relays run at once. A row's
//! headers (its writer's `traceparent`) reach the consumer with it.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::outbox_table::{migrated, unsent, write_credits};
use crate::wallet::{self, Credit, CreditEvent};
use crate::{TestDb, TestStore};
use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{
    Ack, Consumer, Handler, HandlerError, Message, MessageId, OutgoingMessage, Publish,
    PublishError, Recovery, TraceParent,
};
use inbox_postgres::sqlx;
use inbox_postgres::{Outbox, PgTx};
use inbox_testkit::metadata::{assert_traced, TRACEPARENT};
use inbox_testkit::{eventually, receive};

use crate::scenarios::{drain, finish, left, setup, source, Totals};
use crate::{TestBroker, TestQueue};

/// The upstream handler: forwards each credit to another queue through the outbox, in the
/// inbox transaction.
#[derive(Clone)]
struct Forward {
    outbox: Outbox,
    to: String,
}

impl Handler<PgTx> for Forward {
    async fn handle(
        &self,
        tx: &mut PgTx,
        _: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        self.outbox.write(tx, &self.to, &message.payload).await?;
        Ok(())
    }
}

/// Publishes through `inner`, except that its first batch reaches the broker only in part (its
/// first `reaching` messages; all of them when `None`) and then fails with `recovery`, as when
/// the connection is lost before the confirms: a lost confirm, a replay stopped between
/// publishing and removing.
pub(crate) struct FailsFirst {
    inner: Arc<dyn inbox_core::DynPublish>,
    reaching: Option<usize>,
    recovery: Recovery,
    failed: AtomicBool,
}

impl FailsFirst {
    pub(crate) fn new(
        inner: Arc<dyn inbox_core::DynPublish>,
        reaching: Option<usize>,
        recovery: Recovery,
    ) -> Self {
        let failed = AtomicBool::new(false);
        Self {
            inner,
            reaching,
            recovery,
            failed,
        }
    }
}

impl Publish for FailsFirst {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        if self.failed.swap(true, Ordering::SeqCst) {
            return self.inner.send_batch(destination, messages).await;
        }
        let reaching = &messages[..self.reaching.unwrap_or(messages.len())];
        self.inner.send_batch(destination, reaching).await?;
        Err(PublishError::new(
            self.recovery,
            format!("publishing to `{destination}`"),
            "the connection was lost before the confirms arrived",
        ))
    }
}

/// Publishes for real, then waits a little, as a broker across a network takes: a relay holds
/// its rows locked long enough for another relay to take the next ones. Its first batch waits
/// (up to 10 s) until the other relay has a batch too, so that the two overlap even when one
/// starts late on a loaded machine and could otherwise send every row alone.
struct Slow {
    publish: Arc<dyn inbox_core::DynPublish>,
    both: Arc<tokio::sync::Barrier>,
    first: std::sync::atomic::AtomicBool,
}

impl Publish for Slow {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        if self.first.swap(false, std::sync::atomic::Ordering::Relaxed) {
            let _ = tokio::time::timeout(Duration::from_secs(10), self.both.wait()).await;
        }
        self.publish.send_batch(destination, messages).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(())
    }
}

/// Whether the outbox scenarios are skipped on the store `D` (printed as they skip): the outbox
/// and its relay are PostgreSQL's.
fn no_outbox<D: TestStore>(name: &str) -> bool {
    if D::has_outbox() {
        return false;
    }
    println!("{name}: skipped: the outbox and its relay are PostgreSQL's (inbox-postgres)");
    true
}

/// The IDs of the outbox rows.
async fn outbox_ids(db: &TestDb) -> HashSet<String> {
    ids(db, "SELECT message_id FROM outbox").await
}

/// The event IDs of the ledger rows.
async fn ledger_ids(db: &TestDb) -> HashSet<String> {
    ids(db, "SELECT event_id FROM ledger").await
}

async fn ids(db: &TestDb, query: &'static str) -> HashSet<String> {
    let ids = sqlx::query_scalar(query).fetch_all(&db.pool).await;
    ids.unwrap_or_else(|e| panic!("{query}: {e}"))
        .into_iter()
        .collect()
}

/// Drains `queue` with the wallet's handler until `done`.
async fn apply_downstream<Q, D, G>(db: &TestDb, queue: &Q, done: D) -> Totals
where
    Q: TestQueue,
    D: Fn(Totals) -> G,
    G: Future<Output = bool>,
{
    let handler = Credit::new(db.clone());
    drain(
        queue,
        "wallet",
        Totals::default(),
        |source| {
            Consumer::new("wallet", source, db.inbox(), handler.clone())
                .batch_size(50)
                .run_until_idle()
        },
        done,
    )
    .await
}

/// Upstream messages (some sent twice) are forwarded by a handler through the outbox; the relay
/// publishes each row once and the downstream inbox applies each, under the rows' IDs.
pub async fn a_handler_writes_the_outbox_the_relay_publishes_and_the_downstream_inbox_applies_each_once<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    if no_outbox::<D>("outbox") {
        return;
    }
    const EVENTS: i64 = 100;
    const RESENT: i64 = 20;
    let (db, upstream) = setup::<B, TestDb>(broker, "outbox-in").await;
    let downstream = broker.queue("outbox-out").await;
    let outbox = migrated(&db).await;
    let mut total = 0;
    for i in 0..EVENTS {
        let event = CreditEvent::new(1 + i % 5, i + 1);
        total += event.amount;
        let id = MessageId::generate();
        upstream.send(Some(id.as_str()), &event.to_json()).await;
        if i < RESENT {
            // The upstream producer resent some: its inbox forwards them once.
            upstream.send(Some(id.as_str()), &event.to_json()).await;
        }
    }

    let forward = Forward {
        outbox: outbox.clone(),
        to: downstream.destination(),
    };
    let forwarded = drain(
        &upstream,
        "forward",
        Totals::default(),
        |source| {
            Consumer::new("forward", source, db.inbox(), forward.clone())
                .batch_size(50)
                .run_until_idle()
        },
        |t| async move { t.applied + t.skipped >= (EVENTS + RESENT) as u64 },
    )
    .await;
    let relayed = outbox
        .relay(downstream.producer().await)
        .batch_size(64)
        .run_until_idle()
        .await
        .expect("relay");
    let applied = apply_downstream(
        &db,
        &downstream,
        |t| async move { t.applied >= EVENTS as u64 },
    )
    .await;

    let written = outbox_ids(&db).await;
    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&downstream).await;
    println!(
        "outbox: forwarded {forwarded:?}; relayed {relayed:?}; applied downstream {applied:?}; \
         {summary:?}; left downstream {left}"
    );
    assert_eq!(
        forwarded.skipped, RESENT as u64,
        "the resent ones forwarded once"
    );
    assert_eq!(
        written.len(),
        EVENTS as usize,
        "one outbox row per upstream event"
    );
    assert_eq!(relayed.published, EVENTS as u64);
    assert_eq!(unsent(&db).await, 0);
    assert_eq!(
        (applied.applied, applied.skipped),
        (EVENTS as u64, 0),
        "each row reached the queue once"
    );
    assert_eq!(ledger_ids(&db).await, written, "under the rows' IDs");
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, total);
    assert_eq!(left, 0);
    downstream.cleanup().await;
    finish(db, upstream).await;
}

/// The broker stores a batch but its confirms are lost: the relay keeps the rows unsent and
/// publishes them again under the same IDs; the downstream inbox applies each once and skips
/// the copies.
pub async fn a_lost_confirm_publishes_again_under_the_same_ids_and_the_inbox_skips_the_copies<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    if no_outbox::<D>("lost confirm") {
        return;
    }
    const ROWS: i64 = 40;
    let (db, queue) = setup::<B, TestDb>(broker, "outbox-lost-confirm").await;
    let outbox = migrated(&db).await;
    let total = write_credits(&db, &outbox, &queue.destination(), ROWS).await;

    // The broker stores the batch; its confirms are lost.
    let publisher = FailsFirst::new(queue.producer().await, None, Recovery::Reconnect);
    let relayed = outbox
        .relay(publisher)
        .batch_size(100)
        .error_backoff(Duration::from_millis(20))
        .run_until_idle()
        .await
        .expect("relay");
    let applied = apply_downstream(&db, &queue, |t| async move {
        t.applied + t.skipped >= 2 * ROWS as u64
    })
    .await;

    let summary = wallet::summary(&db).await.expect("summary");
    let left = left(&queue).await;
    println!("lost confirm: relayed {relayed:?}; applied {applied:?}; {summary:?}; left {left}");
    assert_eq!((relayed.published, relayed.errors), (ROWS as u64, 1));
    assert_eq!(
        (applied.applied, applied.skipped),
        (ROWS as u64, ROWS as u64),
        "the batch went out twice, the second time under the same IDs"
    );
    assert_eq!(ledger_ids(&db).await, outbox_ids(&db).await);
    assert_eq!(summary.duplicates(), 0);
    assert_eq!(summary.ledger_rows, ROWS);
    assert_eq!(summary.total_balance, total);
    assert_eq!(left, 0);
    finish(db, queue).await;
}

/// Two relays on one outbox at once: each row is locked by one of them, so each is published
/// once, and both do part of the work.
pub async fn two_relays_at_once_publish_every_row_once<B: TestBroker, D: TestStore>(broker: &B) {
    if no_outbox::<D>("two relays") {
        return;
    }
    const ROWS: i64 = 300;
    let (db, queue) = setup::<B, TestDb>(broker, "outbox-two-relays").await;
    let outbox = migrated(&db).await;
    let total = write_credits(&db, &outbox, &queue.destination(), ROWS).await;

    // Both producers connect before either relay starts: otherwise the first relay can send
    // every row while the second is still connecting.
    let producers = [queue.producer().await, queue.producer().await];
    let mut relays = Vec::new();
    let mut stops = Vec::new();
    let both = Arc::new(tokio::sync::Barrier::new(2));
    for publish in producers {
        let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop);
        relays.push(tokio::spawn(
            outbox
                .relay(Slow {
                    publish,
                    both: Arc::clone(&both),
                    first: true.into(),
                })
                .batch_size(20)
                .poll_interval(Duration::from_millis(10))
                .run_until(async {
                    let _ = stopping.await;
                }),
        ));
    }
    let start = Instant::now();
    let sent = eventually(Duration::from_secs(60), || async { unsent(&db).await == 0 }).await;
    assert!(sent, "the relays did not send every row within 60 s");
    for stop in stops {
        let _ = stop.send(());
    }
    let mut published = Vec::new();
    for relay in relays {
        published.push(relay.await.expect("relay task").expect("relay").published);
    }
    let applied = apply_downstream(&db, &queue, |t| async move { t.applied >= ROWS as u64 }).await;

    let summary = wallet::summary(&db).await.expect("summary");
    // A row published twice would be a copy skipped by the inbox, or one still on the broker.
    let left = left(&queue).await;
    println!(
        "two relays: published {published:?} in {:?}; applied {applied:?}; {summary:?}; left {left}",
        start.elapsed()
    );
    assert_eq!(published.iter().sum::<u64>(), ROWS as u64);
    assert!(
        published.iter().all(|&n| n > 0),
        "both relays published: {published:?}"
    );
    assert_eq!(
        (applied.applied, applied.skipped),
        (ROWS as u64, 0),
        "no row published twice"
    );
    assert_eq!(ledger_ids(&db).await, outbox_ids(&db).await);
    assert_eq!(summary.total_balance, total);
    assert_eq!(left, 0);
    finish(db, queue).await;
}

/// A row written with a `traceparent` and an application header reaches the consumer with both,
/// through the relay and the adapter's producer; a row written without headers gets none.
pub async fn headers_written_with_an_outbox_row_reach_the_consumer<B: TestBroker, D: TestStore>(
    broker: &B,
) {
    if no_outbox::<D>("outbox headers") {
        return;
    }
    let (db, queue) = setup::<B, TestDb>(broker, "outbox-headers").await;
    let outbox = migrated(&db).await;
    let traced = OutgoingMessage::generate(CreditEvent::new(1, 5).to_json())
        .header(TRACEPARENT_HEADER, TRACEPARENT)
        .header("tenant", "acme");
    let plain = OutgoingMessage::generate(CreditEvent::new(2, 7).to_json());
    let mut tx = db.pool.begin().await.expect("begin");
    let rows = [traced.clone(), plain.clone()];
    outbox
        .write_all(&mut tx, &queue.destination(), &rows)
        .await
        .expect("outbox rows");
    tx.commit().await.expect("commit");
    let relayed = outbox
        .relay(queue.producer().await)
        .run_until_idle()
        .await
        .expect("relay");

    let mut source = source(&queue, "reader").await;
    let deliveries = receive(&mut source, 2, Duration::from_secs(60)).await;
    let received = |id: &MessageId| {
        let found = deliveries.iter().find(|d| d.message.id.as_ref() == Ok(id));
        &found.unwrap_or_else(|| panic!("{id} not received")).message
    };
    let (got_traced, got_plain) = (received(&traced.id), received(&plain.id));
    let shown = |message: &Message| -> Vec<String> {
        let text = |value: &[u8]| String::from_utf8_lossy(value).into_owned();
        message
            .headers
            .iter()
            .map(|(k, v)| format!("{k}={}", text(v)))
            .collect()
    };
    println!(
        "outbox headers: relayed {relayed:?}; received {:?} and {:?}",
        shown(got_traced),
        shown(got_plain)
    );
    assert_eq!(relayed.published, 2);
    assert_traced(got_traced);
    assert_eq!(got_traced.header("tenant"), Some(&b"acme"[..]));
    assert_eq!(TraceParent::from_message(got_plain), None);
    assert_eq!(got_plain.header("tenant"), None);
    for delivery in deliveries {
        delivery.ack.ack().await.expect("ack");
    }
    finish(db, queue).await;
}
