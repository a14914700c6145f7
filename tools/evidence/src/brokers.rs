//! The four brokers, as the conformance suite drives them (`inbox_conformance`'s `TestBroker`
//! and `TestQueue`): the harness creates, fills, consumes, counts and deletes queues through
//! that one trait, so the evidence runs on exactly the adapters' configuration the suite checks.
//! What is the harness's own is here: a broker picked at run time behind one object, the
//! suite's panics turned into errors, and the Tansu workarounds.

use futures_util::future::BoxFuture;
use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::scenarios::{self, ZombiePlan, ZombieReport};
use inbox_conformance::store::MySqlDb;
use inbox_conformance::wallet::CreditEvent;
use inbox_conformance::TestDb;
use inbox_conformance::{TestBroker, TestQueue};
use inbox_core::{BoxError, MessageId, MessageSource, OutgoingMessage, Publish, StatsSnapshot};
use inbox_testkit::WithoutInbox;
use tokio::sync::Mutex;

use crate::cli::{BrokerKind, ConsumerSpec, KafkaImpl, Variant};
use crate::consume::{self, Shutdown, Watch};
use crate::effects_child::{self, ChildSpec, Role};

/// Credit event `i` ready to publish: ID `evt-<i>`, its JSON, keyed by its account (Kafka's
/// partition follows the key; [`Broker::publish`] drops it elsewhere).
pub(crate) fn credit(i: u32, event: &CreditEvent) -> OutgoingMessage {
    let id = MessageId::new(format!("evt-{i}")).expect("`evt-<n>` is a valid ID");
    OutgoingMessage::new(id, event.to_json()).key(event.account_id.to_string())
}

/// Messages per `Publish::send_batch` call while filling a queue.
const PUBLISH_CHUNK: usize = 5_000;

/// How often a draining consumer that applies nothing while the broker still holds messages is
/// replaced by a new one (see `inbox_conformance::kill::drain`), where the broker needs it.
const DRAIN_RESTARTS: u32 = 5;

/// What the harness needs from a broker: [`TestBroker`] and [`TestQueue`], with queues found by
/// name, behind one object for every broker. The methods return boxed futures because the tool
/// picks the broker at run time.
pub(crate) trait Broker: Send + Sync {
    /// Which broker this is.
    fn kind(&self) -> BrokerKind;

    /// A fresh, empty queue, topic or stream with its dead-letter destination; returns its name,
    /// which `label` is part of.
    fn create<'a>(&'a self, label: &'a str) -> BoxFuture<'a, Result<String, BoxError>>;

    /// Publishes `events` to `name`, confirmed.
    fn publish<'a>(
        &'a self,
        name: &'a str,
        events: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Result<(), BoxError>>;

    /// Runs one consumer of `spec` in this process until `shutdown`.
    fn consume<'a>(
        &'a self,
        spec: &'a ConsumerSpec,
        db: &'a TestDb,
        watch: Watch,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>>;

    /// Runs one consumer of `spec` on the MySQL store in `db` in this process until `shutdown`:
    /// variant c, per-message credits.
    fn consume_mysql<'a>(
        &'a self,
        spec: &'a ConsumerSpec,
        db: &'a MySqlDb,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>>;

    /// Messages on `name` not acked yet, as far as the broker can tell while consumers run
    /// ([`TestQueue::waiting`]).
    fn left<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<u64>, BoxError>>;

    /// How long a dead consumer's unacked messages on `name` may take to come back to another.
    fn redelivery_delay<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Duration, BoxError>>;

    /// Runs the zombie scenario ([`scenarios::zombie`]) on a fresh queue (`label` part of its
    /// name) and wallet, with the inbox (variant c) or without (b); `tick` is told the events
    /// applied and the stalls so far. `None` where the broker cannot take a message away.
    fn zombie<'a>(
        &'a self,
        label: &'a str,
        variant: Variant,
        plan: ZombiePlan,
        tick: Box<dyn Fn(i64, i64) + Send + Sync>,
    ) -> BoxFuture<'a, Result<Option<ZombieReport>, BoxError>>;

    /// How often a draining consumer that applies nothing while the broker still holds messages
    /// is replaced by a new one; 0: such a stall fails the run (see
    /// `inbox_conformance::kill::drain`).
    fn drain_restarts(&self) -> u32;

    /// Deletes `name` and its dead-letter destination (best effort).
    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, ()>;

    /// What outbox rows name as their destination to reach `name` through the broker's producer.
    fn destination<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<String, BoxError>>;

    /// Runs the `effects-test` child `spec` on its queue until it is killed or Ctrl-C: a
    /// consumer reading `spec.name`, or the relay publishing through the broker's producer.
    fn run_child<'a>(
        &'a self,
        spec: &'a ChildSpec,
        db: &'a TestDb,
    ) -> BoxFuture<'a, Result<(), BoxError>>;
}

/// The consumer-group member of `spec`: the same for a restarted consumer of one member, so that
/// it takes back what it held (a Redis consumer's pending entries).
fn member(spec: &ConsumerSpec) -> String {
    format!("wallet-{}", spec.member)
}

/// The broker `kind`, with the harness's settings; `kafka_impl` says what `KAFKA_BROKERS` points
/// at. Nothing connects before the first queue is created or opened: an unreachable broker
/// fails there, with the reason.
/// The broker `kind`, or `None` (said on stdout) when it does not answer and `required` is
/// false.
pub(crate) async fn connect_or_skip(
    kind: BrokerKind,
    kafka_impl: KafkaImpl,
    required: bool,
) -> Result<Option<Box<dyn Broker>>, BoxError> {
    match connect(kind, kafka_impl).await {
        Ok(broker) => Ok(Some(broker)),
        Err(e) if !required => {
            println!("\n{kind}: skipped, {e}");
            Ok(None)
        }
        Err(e) => Err(format!("{kind}: {e}").into()),
    }
}

pub(crate) async fn connect(
    kind: BrokerKind,
    kafka_impl: KafkaImpl,
) -> Result<Box<dyn Broker>, BoxError> {
    #[cfg(not(feature = "kafka"))]
    let _ = kafka_impl;
    Ok(match kind {
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => {
            let broker = inbox_conformance::kafka::Kafka::default()
                .partitions(6)
                .session_timeout(Duration::from_secs(6))
                .one_record_per_batch(kafka_impl.tansu_workarounds())
                // A loaded test machine once kept Tansu from acknowledging within 30 s.
                .delivery_timeout(Duration::from_secs(120));
            Box::new(On::new(kind, broker, kafka_impl.tansu_workarounds()))
        }
        #[cfg(not(feature = "kafka"))]
        BrokerKind::Kafka => {
            return Err("this evidence binary was built without the `kafka` feature".into())
        }
        BrokerKind::Sqs => Box::new(On::new(kind, inbox_conformance::sqs::Sqs, true)),
        BrokerKind::Rabbitmq => {
            let broker = inbox_conformance::rabbitmq::RabbitMq::default().no_delivery_limit();
            Box::new(On::new(kind, broker, true))
        }
        BrokerKind::Redis => Box::new(On::new(kind, inbox_conformance::redis::Redis, true)),
    })
}

/// A conformance-suite broker, its queues by name.
struct On<B: TestBroker> {
    kind: BrokerKind,
    broker: Arc<B>,
    queues: Mutex<HashMap<String, Arc<B::Queue>>>,
    /// One producer per queue published to, kept for the next chunk (a soak publishes many).
    producers: Mutex<HashMap<String, Arc<dyn inbox_core::DynPublish>>>,
    /// Whether a stalled drain may be replaced (see [`Broker::drain_restarts`]).
    restarts: bool,
}

impl<B: TestBroker> On<B> {
    fn new(kind: BrokerKind, broker: B, restarts: bool) -> Self {
        Self {
            kind,
            broker: Arc::new(broker),
            queues: Mutex::new(HashMap::new()),
            producers: Mutex::new(HashMap::new()),
            restarts,
        }
    }

    /// The queue called `name`: one this process created, else the broker's by that name (a
    /// child process's).
    async fn queue(&self, name: &str) -> Result<Arc<B::Queue>, BoxError> {
        let mut queues = self.queues.lock().await;
        if let Some(queue) = queues.get(name) {
            return Ok(queue.clone());
        }
        let (broker, owned) = (self.broker.clone(), name.to_owned());
        let queue = Arc::new(
            caught(
                "opening the queue",
                async move { broker.attach(&owned).await },
            )
            .await?,
        );
        queues.insert(name.to_owned(), queue.clone());
        Ok(queue)
    }

    /// The producer of the queue called `name`, connected on first use.
    async fn producer(&self, name: &str) -> Result<Arc<dyn inbox_core::DynPublish>, BoxError> {
        let mut producers = self.producers.lock().await;
        if let Some(producer) = producers.get(name) {
            return Ok(producer.clone());
        }
        let queue = self.queue(name).await?;
        let producer = caught(
            "connecting a producer",
            async move { queue.producer().await },
        )
        .await?;
        producers.insert(name.to_owned(), producer.clone());
        Ok(producer)
    }
}

/// The source a queue of `B` hands out.
type SourceOf<B> = <<B as TestBroker>::Queue as TestQueue>::Source;

impl<B: TestBroker> Broker for On<B>
where
    // The consumer keeps deliveries across awaits of its `Send` future.
    <SourceOf<B> as MessageSource>::Ack: Sync,
{
    fn kind(&self) -> BrokerKind {
        self.kind
    }

    fn create<'a>(&'a self, label: &'a str) -> BoxFuture<'a, Result<String, BoxError>> {
        Box::pin(async move {
            let (broker, label) = (self.broker.clone(), format!("wallet-{label}"));
            let queue = caught(
                &format!(
                    "creating a queue on {} (is it up? `cargo xtask services`)",
                    self.kind
                ),
                async move { broker.queue(&label).await },
            )
            .await?;
            let name = queue.name();
            self.queues
                .lock()
                .await
                .insert(name.clone(), Arc::new(queue));
            Ok(name)
        })
    }

    fn publish<'a>(
        &'a self,
        name: &'a str,
        events: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async move {
            let destination = self.queue(name).await?.destination();
            let producer = self.producer(name).await?;
            for chunk in events.chunks(PUBLISH_CHUNK) {
                if self.kind == BrokerKind::Kafka {
                    producer.send_batch(&destination, chunk).await?;
                    continue;
                }
                // Only Kafka's partitions follow the key; an SQS key would be a FIFO group.
                let mut unkeyed = chunk.to_vec();
                for message in &mut unkeyed {
                    message.key = None;
                }
                producer.send_batch(&destination, &unkeyed).await?;
            }
            Ok(())
        })
    }

    fn consume<'a>(
        &'a self,
        spec: &'a ConsumerSpec,
        db: &'a TestDb,
        watch: Watch,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>> {
        Box::pin(async move {
            let queue = self.queue(&spec.name).await?;
            let member = member(spec);
            if spec.variant.auto_ack() {
                let source = caught("connecting a consumer", async move {
                    queue.at_most_once_source(&member).await
                })
                .await?;
                crate::ready();
                return Ok(consume::run(source, spec, db, watch, shutdown).await?);
            }
            let source = caught("connecting a consumer", async move {
                queue.source(&member).await
            })
            .await?;
            crate::ready();
            Ok(consume::run(source, spec, db, watch, shutdown).await?)
        })
    }

    fn consume_mysql<'a>(
        &'a self,
        spec: &'a ConsumerSpec,
        db: &'a MySqlDb,
        shutdown: Shutdown,
    ) -> BoxFuture<'a, Result<StatsSnapshot, BoxError>> {
        Box::pin(async move {
            if spec.variant != Variant::C || spec.batched || spec.no_database {
                return Err(format!(
                    "the MySQL store runs variant c with the per-message credit only, not {spec:?}"
                )
                .into());
            }
            let queue = self.queue(&spec.name).await?;
            let member = member(spec);
            let source = caught("connecting a consumer", async move {
                queue.source(&member).await
            })
            .await?;
            crate::ready();
            Ok(consume::run_mysql(source, spec, db, shutdown).await?)
        })
    }

    fn left<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<u64>, BoxError>> {
        Box::pin(async move {
            let queue = self.queue(name).await?;
            Ok(Some(
                caught(
                    "counting what is left",
                    async move { queue.waiting().await },
                )
                .await?,
            ))
        })
    }

    fn redelivery_delay<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Duration, BoxError>> {
        Box::pin(async move { Ok(self.queue(name).await?.redelivery_delay()) })
    }

    fn zombie<'a>(
        &'a self,
        label: &'a str,
        variant: Variant,
        plan: ZombiePlan,
        tick: Box<dyn Fn(i64, i64) + Send + Sync>,
    ) -> BoxFuture<'a, Result<Option<ZombieReport>, BoxError>> {
        Box::pin(async move {
            let name = self.create(label).await?;
            let queue = self.queue(&name).await?;
            let report = caught("the zombie run", async move {
                let db = TestDb::new().await;
                let report = if variant == Variant::C {
                    scenarios::zombie(&*queue, &db, db.inbox(), &plan, tick).await
                } else {
                    scenarios::zombie(&*queue, &db, WithoutInbox(db.inbox()), &plan, tick).await
                };
                db.drop().await;
                report
            })
            .await;
            self.remove(&name).await;
            report
        })
    }

    fn drain_restarts(&self) -> u32 {
        if self.restarts {
            DRAIN_RESTARTS
        } else {
            0
        }
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Ok(queue) = self.queue(name).await else {
                return;
            };
            let _ = caught("deleting the queue", async move { queue.cleanup().await }).await;
            self.queues.lock().await.remove(name);
            self.producers.lock().await.remove(name);
        })
    }

    fn destination<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<String, BoxError>> {
        Box::pin(async move { Ok(self.queue(name).await?.destination()) })
    }

    fn run_child<'a>(
        &'a self,
        spec: &'a ChildSpec,
        db: &'a TestDb,
    ) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async move {
            let queue = self.queue(&spec.name).await?;
            if spec.role == Role::Relay {
                let producer = caught(
                    "connecting a producer",
                    async move { queue.producer().await },
                )
                .await?;
                return effects_child::relay(producer, db).await;
            }
            let member = format!("{}-0", spec.role.name());
            let source = caught("connecting a consumer", async move {
                queue.source(&member).await
            })
            .await?;
            effects_child::run(source, spec, db).await
        })
    }
}

/// Runs `work`, whose failures are panics (the conformance suite's style), and turns a panic
/// into an error naming `what` and the panic's message.
async fn caught<T: Send + 'static>(
    what: &str,
    work: impl Future<Output = T> + Send + 'static,
) -> Result<T, BoxError> {
    tokio::spawn(work).await.map_err(|e| {
        let message = e
            .try_into_panic()
            .map_or_else(|e| e.to_string(), |panic| panic_message(panic.as_ref()));
        format!("{what}: {message}").into()
    })
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panicked".to_owned())
}

/// Says in the output which Kafka implementation a run's figures come from.
pub(crate) fn kafka_note(kind: BrokerKind, kafka_impl: KafkaImpl) {
    if kind == BrokerKind::Kafka {
        #[cfg(feature = "kafka")]
        let brokers = inbox_conformance::kafka::brokers();
        // Built without Kafka, no run reaches here; the address is only printed.
        #[cfg(not(feature = "kafka"))]
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_default();
        match kafka_impl {
            KafkaImpl::Tansu => println!(
                "\nkafka at {brokers}: --kafka-impl tansu (one record per produced batch, a \
                 stalled drain is replaced)"
            ),
            KafkaImpl::Mock => println!(
                "\nkafka at {brokers}: --kafka-impl mock (librdkafka's mock cluster: records \
                 batched, a stalled drain fails the run, {} partitions per topic)",
                if std::env::var_os("KAFKA_MOCK_CONTROL").is_some() {
                    "6"
                } else {
                    "4"
                }
            ),
        }
    }
}
