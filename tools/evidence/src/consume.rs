//! The consumer: the wallet's credit handler behind the variant's store, with the optional
//! crash between the DB commit and the ack.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::mysql_wallet;
use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::{BatchCredit, Credit};
use inbox_conformance::{TestBroker, TestDb};
use inbox_core::{
    BatchHandler, BatchItem, BoxError, Consumer, HandlerError, Inbox, InboxStore, Message,
    MessageId, MessageSource, Stage, StageHook, StatsSnapshot,
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

/// Runs `spec`'s consumer on `source` until `shutdown`, counting in `progress` each message as
/// its transaction commits (the benchmark's clock).
pub(crate) async fn run<S: MessageSource + 'static>(
    source: S,
    spec: &ConsumerSpec,
    db: &TestDb,
    progress: Option<Arc<Progress>>,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, inbox_core::Error> {
    if spec.store == StoreKind::Sharded {
        return run_sharded(source, spec, progress, shutdown).await;
    }
    if spec.no_database {
        let consumer = Consumer::batched("wallet", source, MemoryStore::<()>::new(), CountOnly);
        return finish(consumer, spec, progress, shutdown).await;
    }
    // b, and the a variants (whose ack already happened on receipt): no inbox claim.
    let with_inbox = spec.variant == Variant::C;
    if spec.batched() {
        return if with_inbox {
            let consumer = Consumer::batched("wallet", source, db.inbox(), BatchCredit);
            finish(consumer, spec, progress, shutdown).await
        } else {
            let store = WithoutInbox(db.inbox());
            let consumer = Consumer::batched("wallet", source, store, BatchCredit);
            finish(consumer, spec, progress, shutdown).await
        };
    }
    let handler = Credit::new(db.clone()).work(spec.work);
    if with_inbox {
        let consumer = Consumer::new("wallet", source, db.inbox(), handler);
        finish(consumer, spec, progress, shutdown).await
    } else {
        let consumer = Consumer::new("wallet", source, WithoutInbox(db.inbox()), handler);
        finish(consumer, spec, progress, shutdown).await
    }
}

/// Runs `spec`'s consumer on `source` with the inbox and wallet spread over the shards in
/// `spec.schema`, each credit in its account's shard: variant c, per-message credits.
async fn run_sharded<S: MessageSource + 'static>(
    source: S,
    spec: &ConsumerSpec,
    progress: Option<Arc<Progress>>,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, inbox_core::Error> {
    if spec.variant != Variant::C || spec.batched() || spec.no_database {
        return Err(inbox_core::Error::Config(
            "--store sharded runs variant c with the per-message credit only".into(),
        ));
    }
    let dbs = shards::attach_shards(&spec.schema).await;
    let store = shards::sharded_inbox(&dbs);
    let handler = Credit::new(dbs[0].clone()).work(spec.work);
    let consumer = Consumer::new("wallet", source, store, handler);
    finish(consumer, spec, progress, shutdown).await
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
        crate::ready();
        return Ok(run(source, spec, db, progress, shutdown).await?);
    }
    let source = broker.source(spec).await?;
    crate::ready();
    Ok(run(source, spec, db, progress, shutdown).await?)
}

/// Runs `spec`'s consumer in this process on `broker` and the store `spec.store` of the run,
/// attached by `spec.schema`, until `shutdown`.
pub(crate) async fn attached<B: TestBroker>(
    broker: &Broker<B>,
    spec: &ConsumerSpec,
    shutdown: Shutdown,
) -> Result<StatsSnapshot, BoxError> {
    let db = match spec.store {
        StoreKind::Postgres => TestDb::attach(&spec.schema).await,
        // The consumer attaches to every shard; the first holds the wallet.
        StoreKind::Sharded => shards::attach_shards(&spec.schema).await.remove(0),
        StoreKind::Mysql => {
            if spec.variant != Variant::C || spec.batched() || spec.no_database {
                return Err(format!(
                    "the MySQL store runs variant c with the per-message credit only, not {spec:?}"
                )
                .into());
            }
            // The MySQL store and wallet.
            let db = MySqlDb::attach(&spec.schema).await;
            let source = broker.source(spec).await?;
            crate::ready();
            let handler = Credit::new(db.clone()).work(spec.work);
            let consumer = Consumer::new("wallet", source, mysql_wallet::inbox(&db), handler);
            return Ok(finish(consumer, spec, None, shutdown).await?);
        }
    };
    consume(broker, spec, &db, None, shutdown).await
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
