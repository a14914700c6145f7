//! The outbox table and its relay against a real PostgreSQL: what gets published, in which
//! order, what is marked sent, what a failing destination leaves behind, retention and the
//! gauge. The publisher here records what it is handed (the brokers' own tests,
//! `tests/it/outbox_relay.rs` of each adapter, publish for real).

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_conformance::TestDb;
use inbox_core::telemetry::TRACEPARENT_HEADER;
use inbox_core::{Destinations, MessageId, OutgoingMessage, Publish, PublishError, Recovery};
use inbox_postgres::{Error, Outbox, RelayError, TableName, OUTBOX_OLDEST_UNSENT_GAUGE};
use inbox_testkit::gauges::{gauge, DebuggingRecorder};
use inbox_testkit::metadata::TRACEPARENT;
use sqlx::AssertSqlSafe;

/// Keeps every batch it is handed, per destination; fails the first `fail_first` calls to
/// `failing` (after keeping them, as a broker that stored them and lost the confirm would).
#[derive(Default)]
pub(crate) struct Recorder {
    published: Mutex<Vec<(String, Vec<OutgoingMessage>)>>,
    failing: Option<String>,
    fail_first: AtomicU32,
}

impl Recorder {
    fn failing(destination: &str, times: u32) -> Self {
        Self {
            failing: Some(destination.to_owned()),
            fail_first: AtomicU32::new(times),
            ..Self::default()
        }
    }

    /// Every message handed over for `destination`, in order.
    pub(crate) fn to(&self, destination: &str) -> Vec<OutgoingMessage> {
        let published = self.published.lock().unwrap();
        published
            .iter()
            .filter(|(d, _)| d == destination)
            .flat_map(|(_, batch)| batch.iter().cloned())
            .collect()
    }
}

impl Publish for Recorder {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        self.published
            .lock()
            .unwrap()
            .push((destination.to_owned(), messages.to_vec()));
        let fails = self.failing.as_deref() == Some(destination)
            && self
                .fail_first
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if fails {
            return Err(PublishError::new(
                Recovery::Retry,
                format!("publishing to `{destination}`"),
                "the confirm was lost",
            ));
        }
        Ok(())
    }
}

async fn outbox(db: &TestDb) -> Outbox {
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    outbox
}

/// (id, message_id, destination, key, sent) of every row, by id.
async fn rows(db: &TestDb) -> Vec<(i64, String, String, Option<String>, bool)> {
    sqlx::query_as(
        "SELECT id, message_id, destination, key, sent_at IS NOT NULL FROM outbox ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

fn ids(messages: &[OutgoingMessage]) -> Vec<String> {
    messages.iter().map(|m| m.id.to_string()).collect()
}

#[tokio::test]
async fn only_committed_rows_are_published_under_the_id_write_returned_and_then_marked_sent() {
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;

    let mut rolled_back = db.pool.begin().await.unwrap();
    outbox
        .write(&mut rolled_back, "orders", b"never")
        .await
        .unwrap();
    rolled_back.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let id = outbox.write(&mut tx, "orders", b"placed").await.unwrap();
    tx.commit().await.unwrap();

    let recorder = Arc::new(Recorder::default());
    let stats = outbox
        .relay(Arc::clone(&recorder))
        .run_until_idle()
        .await
        .unwrap();

    let published = recorder.to("orders");
    assert_eq!(ids(&published), [id.to_string()]);
    assert_eq!(published[0].payload, b"placed");
    assert_eq!(stats.published, 1);
    let rows = rows(&db).await;
    assert_eq!(rows.len(), 1, "the rolled-back row was never written");
    assert!(rows[0].4, "marked sent");
    assert_eq!(
        uuid::Uuid::parse_str(id.as_str())
            .unwrap()
            .get_version_num(),
        7,
        "write generates UUIDv7 IDs"
    );
    db.drop().await;
}

#[tokio::test]
async fn rows_go_out_in_id_order_per_destination_and_a_failed_destination_is_sent_again_with_the_same_ids(
) {
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    let mut written: HashMap<&str, Vec<String>> = HashMap::new();
    for i in 0..30 {
        let destination = if i % 3 == 0 { "payments" } else { "orders" };
        let message = OutgoingMessage::generate(format!("{i}")).key(format!("k{}", i % 4));
        written
            .entry(destination)
            .or_default()
            .push(message.id.to_string());
        outbox
            .write_all(&mut tx, destination, std::slice::from_ref(&message))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    // `payments` loses its confirm once: its rows stay unsent, `orders` rows are marked.
    let recorder = Arc::new(Recorder::failing("payments", 1));
    let stats = outbox
        .relay(Arc::clone(&recorder))
        .batch_size(1000)
        .error_backoff(Duration::from_millis(10))
        .run_until_idle()
        .await
        .unwrap();

    assert_eq!(ids(&recorder.to("orders")), written["orders"]);
    let payments = ids(&recorder.to("payments"));
    assert_eq!(payments.len(), 20, "10 rows, published twice");
    assert_eq!(payments[..10], written["payments"][..], "in id order");
    assert_eq!(payments[10..], written["payments"][..], "again, same IDs");
    assert_eq!((stats.published, stats.errors), (30, 1));
    let keys: Vec<Option<String>> = recorder
        .to("orders")
        .into_iter()
        .map(|m| m.key)
        .take(3)
        .collect();
    assert_eq!(
        keys,
        [Some("k1".into()), Some("k2".into()), Some("k0".into())]
    );
    assert!(rows(&db).await.iter().all(|r| r.4), "every row marked sent");
    db.drop().await;
}

#[tokio::test]
async fn a_destination_nobody_publishes_stops_the_relay_and_keeps_its_rows_while_others_are_sent() {
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    let batch: Vec<OutgoingMessage> = (0..5).map(|i| OutgoingMessage::generate(vec![i])).collect();
    outbox.write_all(&mut tx, "orders", &batch).await.unwrap();
    outbox.write(&mut tx, "nowhere", b"lost?").await.unwrap();
    outbox.write_all(&mut tx, "orders", &batch).await.unwrap();
    tx.commit().await.unwrap();

    let orders = Arc::new(Recorder::default());
    let publisher = Destinations::new().route("orders", Arc::clone(&orders));
    let error = outbox.relay(publisher).run_until_idle().await.unwrap_err();

    assert_eq!(error.recovery(), Recovery::Fatal);
    let RelayError::Publish {
        destination, row, ..
    } = &error
    else {
        panic!("expected a publish error, got {error}");
    };
    assert_eq!((destination.as_str(), *row), ("nowhere", 6));
    assert!(
        error
            .to_string()
            .contains("add one with Destinations::route"),
        "{error}"
    );
    assert_eq!(orders.to("orders").len(), 10);
    let unsent: Vec<String> = rows(&db)
        .await
        .into_iter()
        .filter(|r| !r.4)
        .map(|r| r.2)
        .collect();
    assert_eq!(unsent, ["nowhere"]);
    db.drop().await;
}

#[tokio::test]
async fn headers_are_published_with_their_row_in_order_and_a_value_that_is_not_text_is_refused() {
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    let traced = OutgoingMessage::generate("a")
        .header(TRACEPARENT_HEADER, TRACEPARENT)
        .header("tenant", "acme");
    outbox
        .write_message(&mut tx, "orders", &traced)
        .await
        .unwrap();
    let plain = OutgoingMessage::generate("b").key("k");
    let tagged = OutgoingMessage::generate("c").header("tenant", "umbrella");
    let batch = [plain.clone(), tagged.clone()];
    outbox.write_all(&mut tx, "orders", &batch).await.unwrap();
    let binary = OutgoingMessage::generate("d").header("blob", [0xff]);
    let e = outbox
        .write_message(&mut tx, "orders", &binary)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::HeaderNotText { .. }), "{e}");
    assert!(e.to_string().contains("header `blob`"), "{e}");
    tx.commit().await.unwrap();

    let recorder = Arc::new(Recorder::default());
    let relay = outbox.relay(Arc::clone(&recorder));
    relay.run_until_idle().await.unwrap();
    assert_eq!(recorder.to("orders"), [traced, plain, tagged]);
    db.drop().await;
}

#[tokio::test]
async fn migrate_adds_the_headers_column_to_an_outbox_table_made_before_it() {
    let db = TestDb::new().await;
    sqlx::query(
        "CREATE TABLE outbox (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            message_id text NOT NULL,
            destination text NOT NULL,
            key text,
            payload bytea NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            sent_at timestamptz)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let id = MessageId::generate();
    sqlx::query("INSERT INTO outbox (message_id, destination, payload) VALUES ($1, 'orders', 'x')")
        .bind(id.as_str())
        .execute(&db.pool)
        .await
        .unwrap();

    let outbox = outbox(&db).await;
    outbox.migrate().await.unwrap(); // again: a no-op
    let recorder = Arc::new(Recorder::default());
    let relay = outbox.relay(Arc::clone(&recorder));
    relay.run_until_idle().await.unwrap();
    assert_eq!(recorder.to("orders"), [OutgoingMessage::new(id, "x")]);
    db.drop().await;
}

#[tokio::test]
async fn a_row_whose_id_or_headers_were_spoiled_by_hand_stops_the_relay_naming_the_row() {
    for (column, value, says) in [
        ("message_id", "''", "message_id is unusable"),
        (
            "headers",
            r#"'{"tenant": "acme"}'"#,
            "headers are not an array",
        ),
    ] {
        let db = TestDb::new().await;
        let outbox = outbox(&db).await;
        let mut tx = db.pool.begin().await.unwrap();
        outbox.write(&mut tx, "orders", b"x").await.unwrap();
        tx.commit().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE outbox SET {column} = {value}"
        )))
        .execute(&db.pool)
        .await
        .unwrap();

        let recorder = Arc::new(Recorder::default());
        let relay = outbox.relay(Arc::clone(&recorder));
        let e = relay.run_until_idle().await.unwrap_err();
        assert_eq!(e.recovery(), Recovery::Fatal);
        let text = e.to_string();
        assert!(text.contains("reading outbox row 1"), "{text}");
        assert!(text.contains(says), "{text}");
        assert!(recorder.to("orders").is_empty());
        db.drop().await;
    }
}

#[tokio::test]
async fn purge_removes_only_sent_rows_older_than_the_cutoff() {
    let db = TestDb::new().await;
    let outbox = outbox(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    let batch: Vec<OutgoingMessage> = (0..12)
        .map(|i| OutgoingMessage::generate(vec![i]))
        .collect();
    outbox.write_all(&mut tx, "orders", &batch).await.unwrap();
    tx.commit().await.unwrap();
    // Rows 1–5 sent 2 hours ago, 6–7 sent 30 minutes ago, 8–9 unsent since 3 hours ago,
    // 10–12 unsent and new.
    for (ids, sent_at, created_at) in [
        (
            vec![1, 2, 3, 4, 5],
            "now() - interval '2 hours'",
            "now() - interval '3 hours'",
        ),
        (
            vec![6, 7],
            "now() - interval '30 minutes'",
            "now() - interval '3 hours'",
        ),
        (vec![8, 9], "NULL", "now() - interval '3 hours'"),
    ] {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE outbox SET sent_at = {sent_at}, created_at = {created_at} WHERE id = ANY($1)"
        )))
        .bind(ids)
        .execute(&db.pool)
        .await
        .unwrap();
    }

    let deleted = outbox
        .purge_sent(Duration::from_secs(3600), 2)
        .await
        .unwrap();

    assert_eq!(deleted, 5);
    let left: Vec<i64> = rows(&db).await.into_iter().map(|r| r.0).collect();
    assert_eq!(left, (6..=12).collect::<Vec<_>>());
    assert_eq!(
        outbox
            .purge_sent(Duration::from_secs(3600), 2)
            .await
            .unwrap(),
        0
    );
    db.drop().await;
}

#[tokio::test]
async fn oldest_unsent_is_the_age_of_the_next_row_to_publish_and_feeds_the_gauge() {
    let recorder = DebuggingRecorder::new();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let gauges = recorder.snapshotter();
    let db = TestDb::new().await;
    let table = TableName::qualified(&db.schema, "events_outbox").unwrap();
    let outbox = Outbox::new(db.pool.clone()).with_table(table);
    outbox.migrate().await.unwrap();
    outbox.migrate().await.unwrap(); // again: a no-op
    let label = format!(
        "{OUTBOX_OLDEST_UNSENT_GAUGE}{{outbox={}.events_outbox}}",
        db.schema
    );

    assert_eq!(outbox.oldest_unsent().await.unwrap(), None);
    assert_eq!(gauge(&gauges, &label), Some(0.0));

    let mut tx = db.pool.begin().await.unwrap();
    outbox.write(&mut tx, "orders", b"a").await.unwrap();
    outbox.write(&mut tx, "orders", b"b").await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query("UPDATE events_outbox SET created_at = now() - interval '10 minutes' WHERE id = 1")
        .execute(&db.pool)
        .await
        .unwrap();

    let age = outbox.oldest_unsent().await.unwrap().unwrap();
    assert!(
        (Duration::from_secs(600)..Duration::from_secs(660)).contains(&age),
        "{age:?}"
    );
    let seconds = gauge(&gauges, &label).unwrap();
    assert!((600.0..660.0).contains(&seconds), "{seconds}");

    outbox
        .relay(Recorder::default())
        .run_until_idle()
        .await
        .unwrap();
    // The read above set the gauge back to 0: the 0 below must be the outbox's own.
    let table = format!("{}.events_outbox", db.schema);
    metrics::gauge!(OUTBOX_OLDEST_UNSENT_GAUGE, "outbox" => table).set(-1.0);
    assert_eq!(outbox.oldest_unsent().await.unwrap(), None);
    assert_eq!(gauge(&gauges, &label), Some(0.0));
    db.drop().await;
}

#[test]
fn outbox_table_names_must_be_plain_identifiers() {
    let e = TableName::new("outbox;drop table accounts").unwrap_err();
    assert!(
        e.to_string().contains("is not a plain SQL identifier"),
        "{e}"
    );
}

#[tokio::test]
async fn relays_and_their_futures_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    fn write_is_send(outbox: &Outbox, tx: &mut sqlx::Transaction<'static, sqlx::Postgres>) {
        assert_send(&outbox.write(tx, "orders", b"x"));
    }
    let _ = write_is_send;
    let outbox = Outbox::new(sqlx::PgPool::connect_lazy("postgres://localhost/x").unwrap());
    let relay = outbox.relay(Recorder::default());
    assert_send(&relay);
    assert_send(&relay.run_until_idle());
}
