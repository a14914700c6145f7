//! The five brokers, as the conformance suite drives them (`inbox_conformance`'s `TestBroker`
//! and `TestQueue`): the harness creates, fills, consumes, counts and deletes queues through
//! them, so the evidence runs on exactly the adapters' configuration the suite checks. The
//! broker is picked once, at the top of each command ([`with_broker!`]), and the commands are
//! generic over it. What is the harness's own is here: queues found by name, the suite's panics
//! turned into errors, and the Tansu workarounds.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use inbox_conformance::scenarios::{self, ZombiePlan, ZombieReport};
use inbox_conformance::wallet::CreditEvent;
use inbox_conformance::TestDb;
use inbox_conformance::{TestBroker, TestQueue};
use inbox_core::{BoxError, DynPublish, MessageId, OutgoingMessage, Publish};
use inbox_testkit::WithoutInbox;
use tokio::sync::Mutex;

use crate::cli::{BrokerKind, ConsumerSpec, KafkaImpl, Variant};
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

/// What a binary built without Kafka says when asked for it.
pub(crate) const NO_KAFKA: &str = "this evidence binary was built without the `kafka` feature";

/// Evaluates `$body` with `$broker` bound to a [`Broker`] of the broker `$kind` (with the
/// harness's settings; `$kafka_impl` says what `KAFKA_BROKERS` points at): the one place the
/// tool picks a broker, the code in `$body` generic over it. Nothing connects before the first
/// queue is created or opened: an unreachable broker fails there, with the reason.
macro_rules! with_broker {
    ($kind:expr, $kafka_impl:expr, |$broker:ident| $body:expr) => {{
        use $crate::brokers::Broker;
        use $crate::cli::BrokerKind;
        let (kind, kafka_impl): (BrokerKind, $crate::cli::KafkaImpl) = ($kind, $kafka_impl);
        match kind {
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => {
                let $broker = &Broker::kafka(kafka_impl);
                $body
            }
            #[cfg(not(feature = "kafka"))]
            BrokerKind::Kafka => {
                let _ = kafka_impl;
                return Err($crate::brokers::NO_KAFKA.into());
            }
            BrokerKind::Sqs => {
                let $broker = &Broker::new(kind, inbox_conformance::sqs::Sqs, true);
                $body
            }
            BrokerKind::Rabbitmq => {
                let broker = inbox_conformance::rabbitmq::RabbitMq::default().no_delivery_limit();
                let $broker = &Broker::new(kind, broker, true);
                $body
            }
            BrokerKind::Redis => {
                let $broker = &Broker::new(kind, inbox_conformance::redis::Redis, true);
                $body
            }
            BrokerKind::Nats => {
                let $broker = &Broker::new(kind, inbox_conformance::nats::Nats, true);
                $body
            }
        }
    }};
}
pub(crate) use with_broker;

/// Whether `kind` is left out of this run, said on stdout: Kafka, in a binary built without
/// it; an error instead when `required`.
pub(crate) fn left_out(kind: BrokerKind, required: bool) -> Result<bool, BoxError> {
    if cfg!(feature = "kafka") || kind != BrokerKind::Kafka {
        Ok(false)
    } else if required {
        Err(format!("{kind}: {NO_KAFKA}").into())
    } else {
        println!("\n{kind}: skipped, {NO_KAFKA}");
        Ok(true)
    }
}

/// The consumer-group member of `spec`: the same for a restarted consumer of one member, so that
/// it takes back what it held (a Redis consumer's pending entries).
fn member(spec: &ConsumerSpec) -> String {
    format!("wallet-{}", spec.member)
}

/// The source a queue of `B` hands out.
pub(crate) type SourceOf<B> = <<B as TestBroker>::Queue as TestQueue>::Source;

/// A conformance-suite broker, its queues by name.
pub(crate) struct Broker<B: TestBroker> {
    kind: BrokerKind,
    broker: B,
    queues: Mutex<HashMap<String, Arc<B::Queue>>>,
    /// One producer per queue published to, kept for the next chunk (a soak publishes many).
    producers: Mutex<HashMap<String, Arc<dyn DynPublish>>>,
    /// Whether a stalled drain may be replaced (see [`Broker::drain_restarts`]).
    restarts: bool,
}

#[cfg(feature = "kafka")]
impl Broker<inbox_conformance::kafka::Kafka> {
    /// Kafka with the harness's settings; `kafka_impl` says what `KAFKA_BROKERS` points at.
    pub(crate) fn kafka(kafka_impl: KafkaImpl) -> Self {
        let broker = inbox_conformance::kafka::Kafka::default()
            .partitions(6)
            .session_timeout(Duration::from_secs(6))
            .one_record_per_batch(kafka_impl.tansu_workarounds())
            // A loaded test machine once kept Tansu from acknowledging within 30 s.
            .delivery_timeout(Duration::from_secs(120));
        Self::new(BrokerKind::Kafka, broker, kafka_impl.tansu_workarounds())
    }
}

impl<B: TestBroker> Broker<B> {
    pub(crate) fn new(kind: BrokerKind, broker: B, restarts: bool) -> Self {
        Self {
            kind,
            broker,
            queues: Mutex::new(HashMap::new()),
            producers: Mutex::new(HashMap::new()),
            restarts,
        }
    }

    /// Which broker this is.
    pub(crate) fn kind(&self) -> BrokerKind {
        self.kind
    }

    /// The queue called `name`: one this process created, else the broker's by that name (a
    /// child process's).
    pub(crate) async fn queue(&self, name: &str) -> Result<Arc<B::Queue>, BoxError> {
        let mut queues = self.queues.lock().await;
        if let Some(queue) = queues.get(name) {
            return Ok(queue.clone());
        }
        let queue = Arc::new(caught("opening the queue", self.broker.attach(name)).await?);
        queues.insert(name.to_owned(), queue.clone());
        Ok(queue)
    }

    /// The producer of the queue called `name`, connected on first use.
    async fn producer(&self, name: &str) -> Result<Arc<dyn DynPublish>, BoxError> {
        let mut producers = self.producers.lock().await;
        if let Some(producer) = producers.get(name) {
            return Ok(producer.clone());
        }
        let queue = self.queue(name).await?;
        let producer = caught("connecting a producer", queue.producer()).await?;
        producers.insert(name.to_owned(), producer.clone());
        Ok(producer)
    }

    /// A fresh, empty queue, topic or stream with its dead-letter destination; returns its name,
    /// which `label` is part of.
    pub(crate) async fn create(&self, label: &str) -> Result<String, BoxError> {
        let what = format!(
            "creating a queue on {} (is it up? `cargo xtask services`)",
            self.kind
        );
        let queue = caught(&what, self.broker.queue(&format!("wallet-{label}"))).await?;
        let name = queue.name();
        self.queues
            .lock()
            .await
            .insert(name.clone(), Arc::new(queue));
        Ok(name)
    }

    /// Publishes `events` to `name`, confirmed.
    pub(crate) async fn publish(
        &self,
        name: &str,
        events: &[OutgoingMessage],
    ) -> Result<(), BoxError> {
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
    }

    /// A source of `spec`'s member on `spec.name`, connected.
    pub(crate) async fn source(&self, spec: &ConsumerSpec) -> Result<SourceOf<B>, BoxError> {
        let queue = self.queue(&spec.name).await?;
        caught("connecting a consumer", queue.source(&member(spec))).await
    }

    /// A source of `spec`'s member on `spec.name` that acks on receipt (the variants a1, a2).
    pub(crate) async fn at_most_once_source(
        &self,
        spec: &ConsumerSpec,
    ) -> Result<inbox_testkit::AckOnReceive<SourceOf<B>>, BoxError> {
        let queue = self.queue(&spec.name).await?;
        caught(
            "connecting a consumer",
            queue.at_most_once_source(&member(spec)),
        )
        .await
    }

    /// Messages on `name` not acked yet, as far as the broker can tell while consumers run
    /// ([`TestQueue::waiting`]).
    pub(crate) async fn waiting(&self, name: &str) -> Result<u64, BoxError> {
        caught("counting what is left", self.queue(name).await?.waiting()).await
    }

    /// How long a dead consumer's unacked messages on `name` may take to come back to another.
    pub(crate) async fn redelivery_delay(&self, name: &str) -> Result<Duration, BoxError> {
        Ok(self.queue(name).await?.redelivery_delay())
    }

    /// Runs the zombie scenario ([`scenarios::zombie`]) on a fresh queue (`label` part of its
    /// name) and wallet, with the inbox (variant c) or without (b); `tick` is told the events
    /// applied and the stalls so far. `None` where the broker cannot take a message away.
    pub(crate) async fn zombie(
        &self,
        label: &str,
        variant: Variant,
        plan: ZombiePlan,
        tick: impl Fn(i64, i64) + Send + Sync + 'static,
    ) -> Result<Option<ZombieReport>, BoxError> {
        let name = self.create(label).await?;
        let queue = self.queue(&name).await?;
        let report = caught("the zombie run", async {
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
    }

    /// How often a draining consumer that applies nothing while the broker still holds messages
    /// is replaced by a new one; 0: such a stall fails the run (see
    /// `inbox_conformance::kill::drain`).
    pub(crate) fn drain_restarts(&self) -> u32 {
        if self.restarts {
            DRAIN_RESTARTS
        } else {
            0
        }
    }

    /// Deletes `name` and its dead-letter destination (best effort).
    pub(crate) async fn remove(&self, name: &str) {
        let Ok(queue) = self.queue(name).await else {
            return;
        };
        let _ = caught("deleting the queue", queue.cleanup()).await;
        self.queues.lock().await.remove(name);
        self.producers.lock().await.remove(name);
    }

    /// What outbox rows name as their destination to reach `name` through the broker's producer.
    pub(crate) async fn destination(&self, name: &str) -> Result<String, BoxError> {
        Ok(self.queue(name).await?.destination())
    }

    /// Runs the `effects-test` child `spec` on its queue until it is killed or Ctrl-C: a
    /// consumer reading `spec.name`, or the relay publishing through the broker's producer.
    pub(crate) async fn run_child(&self, spec: &ChildSpec, db: &TestDb) -> Result<(), BoxError> {
        if spec.role == Role::Relay {
            return effects_child::relay(self.producer(&spec.name).await?, db).await;
        }
        let queue = self.queue(&spec.name).await?;
        let member = format!("{}-0", spec.role.name());
        let source = caught("connecting a consumer", queue.source(&member)).await?;
        effects_child::run(source, spec, db).await
    }
}

/// Runs `work`, whose failures are panics (the conformance suite's style), and turns a panic
/// into an error naming `what` and the panic's message.
async fn caught<T>(what: &str, work: impl Future<Output = T>) -> Result<T, BoxError> {
    AssertUnwindSafe(work)
        .catch_unwind()
        .await
        .map_err(|panic| format!("{what}: {}", panic_message(panic.as_ref())).into())
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
