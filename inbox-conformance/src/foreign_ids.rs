//! IDs from the producers teams already have: messages published by another ecosystem's
//! standard client ([`python`](crate::python)), their ID where a convention puts it
//! ([`IdFrom`]), consumed by the adapter's source into the PostgreSQL inbox.
//!
//! One scenario, [`foreign_ids`], runs per broker and [`Convention`]: two credits and a copy of
//! the first under the same foreign ID, then a message without that ID. The first consumer
//! stops dead after its first commit (before the ack), so a redelivered copy comes back too.
//! Each credit must be applied once, the copies skipped, and the message without the ID
//! dead-lettered with a reason that names what was missing. An adapter's
//! `tests/it/foreign_ids.rs` lists its conventions with [`foreign_ids_suite!`](crate::foreign_ids_suite).

use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_core::{Consumer, Handler, HandlerError, IdFrom, Message, MessageId, Stage};
use inbox_postgres::PgTx;
use inbox_testkit::Crash;
use serde_json::{json, Value};

use crate::checked::Checked;
use crate::scenarios::{finish, ledger_has, left, Totals, LIMIT};
use crate::wallet::{self, Credit, CreditEvent};
use crate::{TestBroker, TestQueue};

/// The identity of one event as its producer sees it: an ID, and the CloudEvents `source`.
#[derive(Debug, Clone)]
pub struct Key {
    /// The event's ID.
    pub id: String,
    /// Its CloudEvents `source`.
    pub source: String,
}

/// Makes the message of one convention, as `python/publish.py` takes it.
pub type MakeMessage = Arc<dyn Fn(&Key, &str) -> Value + Send + Sync>;

/// How one producer convention carries the ID, and what a consumer reading it expects.
#[derive(Clone)]
pub struct Convention {
    /// What the source is told.
    pub from: IdFrom,
    /// The message for a key with a body (a credit, JSON).
    pub message: MakeMessage,
    /// The message with a body and without the ID, where a producer can send one (`None`: every
    /// message of the queue carries one, as on an SQS FIFO queue).
    pub without_id: Option<fn(data: &str) -> Value>,
    /// Text the dead-letter reason of the message without the ID must contain.
    pub missing: String,
    /// The second credit shares the first one's `id` under another `source` (the CloudEvents
    /// identity is the pair): it must be applied, not skipped.
    pub same_id_other_source: bool,
    /// Whether the broker hands the published copy to the consumer at all (an SQS FIFO queue
    /// drops a copy with the same deduplication ID within 5 minutes).
    pub copies_arrive: bool,
}

impl std::fmt::Debug for Convention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Convention")
            .field("from", &self.from)
            .field("missing", &self.missing)
            .field("same_id_other_source", &self.same_id_other_source)
            .field("copies_arrive", &self.copies_arrive)
            .finish_non_exhaustive()
    }
}

fn credit(account: i64, amount: i64) -> String {
    String::from_utf8(CreditEvent::new(account, amount).to_json()).unwrap_or_default()
}

fn structured(key: &Key, data: &str, with_id: bool) -> Value {
    let data: Value = serde_json::from_str(data).unwrap_or(Value::Null);
    let mut event = json!({
        "specversion": "1.0",
        "source": key.source,
        "type": "com.example.credit",
        "datacontenttype": "application/json",
        "data": data,
    });
    if with_id {
        event["id"] = json!(key.id);
    }
    json!({"body": event.to_string(), "content_type": "application/cloudevents+json"})
}

impl Convention {
    fn new(
        from: IdFrom,
        message: impl Fn(&Key, &str) -> Value + Send + Sync + 'static,
        missing: impl Into<String>,
    ) -> Self {
        Self {
            from,
            message: Arc::new(message),
            without_id: Some(|data| json!({"body": data})),
            missing: missing.into(),
            same_id_other_source: false,
            copies_arrive: true,
        }
    }

    /// The ID in the header (attribute, entry field) `event_id`: this project's own default.
    pub fn event_id_header() -> Self {
        Self::new(
            IdFrom::header("event_id"),
            |key, data| json!({"body": data, "headers": {"event_id": key.id}}),
            "event_id is missing",
        )
    }

    /// CloudEvents in binary content mode, the attributes as headers named `<prefix><name>`
    /// (Kafka `ce_`, AMQP `cloudEvents:` or `cloudEvents_`), the credit as the body.
    pub fn cloud_events_binary(prefix: &'static str) -> Self {
        Self::new(
            IdFrom::cloud_events(),
            move |key, data| {
                let mut headers = serde_json::Map::new();
                for (name, value) in [
                    ("specversion", "1.0"),
                    ("id", &key.id),
                    ("source", &key.source),
                    ("type", "com.example.credit"),
                ] {
                    headers.insert(format!("{prefix}{name}"), json!(value));
                }
                json!({"body": data, "content_type": "application/json", "headers": headers})
            },
            format!("{prefix}id"),
        )
    }

    /// CloudEvents in structured content mode: the event is the JSON body, the credit its
    /// `data`.
    pub fn cloud_events_structured() -> Self {
        Self {
            without_id: Some(|data| {
                let key = Key {
                    id: String::new(),
                    source: "/credits".into(),
                };
                structured(&key, data, false)
            }),
            ..Self::new(
                IdFrom::cloud_events(),
                |key, data| structured(key, data, true),
                "CloudEvents id of the structured event is missing",
            )
        }
    }

    /// CloudEvents identity, `source` and `id` together, in structured mode: the second credit
    /// has the first one's `id` from another `source`.
    pub fn cloud_events_source_and_id() -> Self {
        Self::cloud_events_structured().source_and_id()
    }

    /// This CloudEvents convention read as the CloudEvents identity, `source` and `id`
    /// together: the second credit has the first one's `id` from another `source`, and must be
    /// applied.
    pub fn source_and_id(self) -> Self {
        Self {
            from: IdFrom::cloud_events_source_and_id(),
            same_id_other_source: true,
            ..self
        }
    }

    /// What the Debezium outbox event router writes: the outbox row's ID in the header `id`.
    pub fn debezium() -> Self {
        Self::new(
            IdFrom::Debezium,
            |key, data| {
                json!({"body": data, "headers": {
                    "id": key.id, "aggregatetype": "account", "type": "credit"}})
            },
            " id is missing",
        )
    }

    /// The protocol's message-ID property: AMQP `message_id`; the `MessageDeduplicationId` of
    /// an SQS FIFO queue (see [`Convention::fifo`]).
    pub fn message_id_property() -> Self {
        Self::new(
            IdFrom::MessageIdProperty,
            |key, data| json!({"body": data, "message_id": key.id, "dedup_id": key.id}),
            "property message_id is missing",
        )
    }

    /// A member of the JSON payload: `/meta/event_id`.
    pub fn json_field() -> Self {
        Self::new(
            IdFrom::json_field("/meta/event_id"),
            |key, data| {
                let mut body: Value = serde_json::from_str(data).unwrap_or(Value::Null);
                body["meta"] = json!({"event_id": key.id});
                json!({"body": body.to_string()})
            },
            "JSON field /meta/event_id of the payload is missing",
        )
    }

    /// This convention on an SQS FIFO queue: every message has a deduplication ID (content-based
    /// where the producer sets none), so there is no message without one to send, and SQS
    /// itself drops the copy.
    pub fn fifo(self) -> Self {
        Self {
            without_id: None,
            copies_arrive: false,
            ..self
        }
    }

    /// The same messages, read as `from`.
    pub fn reading(self, from: IdFrom) -> Self {
        Self { from, ..self }
    }
}

/// The wallet's credit handler, taking the credit from a structured CloudEvent's `data`.
#[derive(Clone)]
struct CreditData(Credit);

impl Handler<PgTx> for CreditData {
    async fn handle(&self, tx: &mut PgTx, id: &MessageId, m: &Message) -> Result<(), HandlerError> {
        let body: Value = m.json()?;
        if body.get("specversion").is_some() {
            let mut inner = m.clone();
            inner.payload = serde_json::to_vec(&body["data"]).unwrap_or_default();
            return self.0.handle(tx, id, &inner).await;
        }
        self.0.handle(tx, id, m).await
    }
}

/// Publishes with the broker's Python client the messages of `convention` (two credits, a copy
/// of the first, a message without the ID), consumes them with the adapter's source reading
/// the convention, and checks the wallet, the inbox, the dead letters and the queue.
pub async fn foreign_ids<B: TestBroker>(broker: &B, name: &str, convention: Convention) {
    let db = crate::TestDb::new().await;
    let queue = broker.queue(&format!("foreign-{name}")).await;
    let Some(target) = queue.python_target() else {
        println!("foreign IDs: skipped: no Python client reaches this broker");
        finish(db, queue).await;
        return;
    };
    let run = crate::unique_name("evt");
    let first = Key {
        id: format!("{run}-1"),
        source: "/credits/eu".into(),
    };
    let second = if convention.same_id_other_source {
        Key {
            id: first.id.clone(),
            source: "/credits/us".into(),
        }
    } else {
        Key {
            id: format!("{run}-2"),
            source: first.source.clone(),
        }
    };
    let no_id_body = credit(3, 30);
    let mut messages = vec![
        (convention.message)(&first, &credit(1, 10)),
        (convention.message)(&second, &credit(2, 20)),
        (convention.message)(&first, &credit(1, 10)),
    ];
    let mut no_id_payload = None;
    if let Some(without_id) = convention.without_id {
        let message = without_id(&no_id_body);
        no_id_payload = message["body"].as_str().map(|b| b.as_bytes().to_vec());
        messages.push(message);
    }
    crate::python::publish(&target, &messages).await;

    // The first consumer stops dead once its first transaction commits, before the broker is
    // told: what it committed comes back, and must be skipped.
    let handler = CreditData(Credit::new(db.clone()));
    let crash = Crash::at(Stage::Committed);
    let consumer = Consumer::new(
        "wallet",
        crash.source(reading(&queue, &convention).await),
        crash.store(db.inbox()),
        crash.handler(handler.clone()),
    );
    let crashed_run = consumer.stats();
    let crashed = crash.run(consumer.run_until_idle()).await;
    assert!(crashed.is_err(), "the first consumer should have crashed");
    // The crash stops the task that reaches it; a batch already past its commit elsewhere can
    // still be acked meanwhile, its copy skipped then and not again.
    let skipped_before = crashed_run.snapshot().skipped_duplicates;

    let dead_wanted = no_id_payload.is_some();
    let skips_wanted = 1 + u64::from(convention.copies_arrive);
    let mut totals = Totals::default();
    let start = Instant::now();
    loop {
        let source = Checked::new(reading(&queue, &convention).await);
        let stats = Consumer::new("wallet", source, db.inbox(), handler.clone())
            .run_until_idle()
            .await
            .unwrap_or_else(|e| panic!("consumer: {e}"));
        totals.add(&stats);
        // The crashed consumer may have parked the message without an ID already.
        let credited = ledger_has(&db, 2).await;
        let skipped = totals.skipped + skipped_before;
        let parked = !dead_wanted || !queue.dead_letters().await.is_empty();
        let left = queue.left().await;
        if credited && skipped >= skips_wanted && parked && left == 0 {
            break;
        }
        assert!(
            start.elapsed() < LIMIT,
            "not drained within {LIMIT:?}: {totals:?}; both credits in the ledger: {credited}, \
             skipped {skipped} of {skips_wanted} (the crashed run {skipped_before}), \
             dead letter parked: {parked}, left on the broker: {left}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let summary = wallet::summary(&db).await.expect("summary");
    let dead = queue.dead_letters().await;
    let left = left(&queue).await;
    println!(
        "foreign IDs, {name} ({}): {totals:?}, {summary:?}, dead letters {dead:?}, left {left}",
        convention.from
    );
    assert_eq!(
        (summary.ledger_rows, summary.distinct_events),
        (2, 2),
        "each credit applied once"
    );
    assert_eq!(wallet::balance(&db, 1).await, 10);
    assert_eq!(wallet::balance(&db, 2).await, 20);
    assert_eq!(
        wallet::balance(&db, 3).await,
        0,
        "nothing without an ID applied"
    );
    assert_eq!(db.inbox_rows().await, 2);
    assert!(
        totals.skipped + skipped_before >= skips_wanted,
        "the redelivered copy (and the republished one) skipped: {totals:?}, {skipped_before} \
         before the crash"
    );
    match no_id_payload {
        Some(payload) => {
            // A dead letter is published before its ack: one the crashed consumer parked but
            // did not ack is parked again.
            assert!(
                !dead.is_empty(),
                "the message without an ID is dead-lettered"
            );
            for letter in &dead {
                assert_eq!(letter.payload, payload);
                assert!(
                    letter.reason.contains(&convention.missing),
                    "the reason `{}` should name `{}`",
                    letter.reason,
                    convention.missing
                );
            }
        }
        None => assert!(dead.is_empty(), "{dead:?}"),
    }
    assert_eq!(left, 0, "everything acked");
    finish(db, queue).await;
}

/// A source of `queue` reading IDs as `convention` says.
async fn reading<Q: TestQueue>(queue: &Q, convention: &Convention) -> Q::Source {
    queue
        .source_reading("c1", convention.from.clone())
        .await
        .expect("a queue with a Python target reads IDs by a convention")
}

/// One `#[tokio::test]` per convention, each running [`foreign_ids`] against `$broker`:
/// `foreign_ids_suite!(Kafka; cloud_events_binary => Convention::cloud_events_binary("ce_"), ..)`.
#[macro_export]
macro_rules! foreign_ids_suite {
    ($broker:expr; $($name:ident => $convention:expr),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::foreign_ids::foreign_ids(&$broker, stringify!($name), $convention).await;
            }
        )*
    };
}
