//! The consumer: the wallet's credit handler behind the variant's store, with the optional
//! crash between the DB commit and the ack.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::mysql_wallet;
use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::{BatchCredit, Credit};
use inbox_conformance::{TestBroker, TestDb, TestStore};
use inbox_core::{
    BatchHandler, BatchItem, BoxError, Consumer, HandlerError, Inbox, InboxStore, Message,
    MessageId, MessageSource, Sharded, Stage, StageHook, StatsSnapshot,
};
use inbox_testkit::{MemoryStore, MemoryTx, WithoutInbox};

use crate::bench::Progress;
use crate::brokers::{with_broker, Broker};
use crate::cli::{ConsumerSpec, KafkaImpl, StoreKind, Variant};
use crate::shards;

/// Resolves when the consumer should finish its batch and return.
pub(crate) type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Counts messages without storing anything: the benchmark's "broker alone".
#[derive(Debug)]
struct CountOnly;

impl BatchHandler<MemoryTx<()>> for CountOnly {
    type Item = ();

    fn decode(&self, _id: &MessageId, _message: &Message) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn handle_batch(
        &self,
        _tx: &mut MemoryTx<()>,
        _batch: &[BatchItem<'_, ()>],
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// Says `ready` and runs `spec`'s consumer on `source` until `shutdown`, counting in `progress`
/// each message as its transaction commits (the benchmark's clock).
async fn run<S: MessageSource + 'static>(
    source: S,
    spec: &ConsumerSpec,
    db: &TestDb,
    progress: Option<Arc<Progress>>,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, inbox_core::Error> {
    crate::ready();
    if spec.no_database {
        let consumer = Consumer::batched("wallet", source, MemoryStore::<()>::new(), CountOnly);
        return finish(consumer, spec, progress, shutdown).await;
    }
    // The consumer on `$store`, with the set-based or the per-message credit.
    macro_rules! on {
        ($store:expr) => {
            if spec.batched() {
                let consumer = Consumer::batched("wallet", source, $store, BatchCredit);
                finish(consumer, spec, progress, shutdown).await
            } else {
                let handler = Credit::new(db.clone()).work(spec.work);
                let consumer = Consumer::new("wallet", source, $store, handler);
                finish(consumer, spec, progress, shutdown).await
            }
        };
    }
    // b, and the a variants (whose ack already happened on receipt): no inbox claim.
    if spec.variant == Variant::C {
        on!(db.inbox())
    } else {
        on!(WithoutInbox(db.inbox()))
    }
}

/// Runs `spec`'s consumer on `broker` with the wallet in `db` until `shutdown`.
pub(crate) async fn consume<B: TestBroker>(
    broker: &Broker<B>,
    spec: &ConsumerSpec,
    db: &TestDb,
    progress: Option<Arc<Progress>>,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, BoxError> {
    if spec.variant.auto_ack() {
        let source = broker.at_most_once_source(spec).await?;
        return Ok(run(source, spec, db, progress, shutdown).await?);
    }
    let source = broker.source(spec).await?;
    Ok(run(source, spec, db, progress, shutdown).await?)
}

/// Runs `spec`'s consumer in this process on `broker` and the store `spec.store` of the run,
/// attached by `spec.schema`, until `shutdown`.
pub(crate) async fn attached<B: TestBroker>(
    broker: &Broker<B>,
    spec: &ConsumerSpec,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, BoxError> {
    match spec.store {
        StoreKind::Postgres => {
            let db = TestDb::attach(&spec.schema).await;
            consume(broker, spec, &db, None, shutdown).await
        }
        StoreKind::Mysql => {
            let db = MySqlDb::attach(&spec.schema).await;
            let store = mysql_wallet::inbox(&db);
            credit_only(broker, spec, db, store, shutdown).await
        }
        // Each credit claimed in its account's shard; the first shard holds the wallet.
        StoreKind::Sharded => {
            let dbs = shards::attach_shards(&spec.schema).await;
            let store = shards::sharded_inbox(&dbs);
            credit_only(broker, spec, dbs[0].clone(), store, shutdown).await
        }
    }
}

/// Runs `spec`'s consumer on `broker` with the per-message credit of the wallet in `db`, claimed
/// in `store`, until `shutdown`: variant c only (the other variants show what the inbox
/// prevents, on PostgreSQL).
async fn credit_only<B: TestBroker, D: TestStore>(
    broker: &Broker<B>,
    spec: &ConsumerSpec,
    db: D,
    store: impl Into<Sharded<D::Inbox>>,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, BoxError> {
    if spec.variant != Variant::C || spec.batched() || spec.no_database {
        return Err(format!(
            "--store {} runs variant c with the per-message credit only, not {spec:?}",
            spec.store
        )
        .into());
    }
    let source = broker.source(spec).await?;
    crate::ready();
    let consumer = Consumer::new("wallet", source, store, Credit::new(db).work(spec.work));
    Ok(finish(consumer, spec, None, shutdown).await?)
}

/// Sets `spec`'s batch size, lanes and hooks on `consumer` and runs it until `shutdown`.
async fn finish<S, St, H>(
    consumer: Consumer<S, Inbox<St, H>>,
    spec: &ConsumerSpec,
    progress: Option<Arc<Progress>>,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, inbox_core::Error>
where
    S: MessageSource + 'static,
    St: InboxStore + 'static,
    H: BatchHandler<St::Tx> + 'static,
{
    let mut consumer = consumer
        .batch_size(spec.batch.unwrap_or_else(|| spec.variant.batch()))
        .parallel_lanes(spec.lanes)
        .error_backoff(Duration::from_millis(100));
    let p = spec.crash_between_commit_and_ack;
    if p > 0.0 || progress.is_some() {
        consumer = consumer.on_stage(StageHook::new(move |stage, _id| {
            if stage == Stage::Committed {
                if let Some(progress) = &progress {
                    progress.add(1);
                }
                // The evt-2 crash: the transaction committed, the ack not yet sent.
                if p > 0.0 && rand::random_bool(p) {
                    std::process::abort();
                }
            }
        }));
    }
    consumer.run_until(shutdown).await
}

/// One consumer, until killed or Ctrl-C.
pub(crate) async fn main(spec: ConsumerSpec) -> Result<(), BoxError> {
    // A consumer neither creates nor publishes: the Kafka implementation makes no difference.
    let stats = with_broker!(spec.broker, KafkaImpl::default(), |broker| {
        attached(broker, &spec, Box::pin(crate::ctrl_c())).await?
    });
    eprintln!("{stats:?}");
    Ok(())
}
