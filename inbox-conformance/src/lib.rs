//! The scenarios every broker adapter passes, written once: each adapter implements
//! [`TestBroker`] and [`TestQueue`] in a few lines of its tests, and [`suite!`] turns every
//! scenario into a `#[tokio::test]` run against the real broker and a real inbox store:
//! PostgreSQL's by default, or any store implementing [`TestStore`] (the MySQL store's is
//! `store::MySqlDb`, feature `mysql`: `suite!(Redis, inbox_conformance::store::MySqlDb)`).
//!
//! The scenarios ([`scenarios`]) credit the [`wallet`]
//! in a schema of their own, and check what a user cares about: every message applied once,
//! nothing lost, nothing left on the broker, and what could not be applied parked in the
//! dead-letter destination with its payload and a reason. They cover duplicates, crashes at each
//! stage and of the whole process, racing members, retries, delayed redeliveries and dead letters, batches, a member
//! that loses its message to another while its handler stalls (a "zombie"), the outbox relay
//! (forwarding, a lost confirm, two relays at once, a row's headers), network faults (a black
//! hole, cut connections, a refused broker) and a broker restart.
//!
//! Every source a scenario runs is held to what it reports of itself
//! ([`MessageSource::capabilities`], see [`Checked`]):
//! a source that claims delivery counts must set
//! [`Metadata::delivery_count`](inbox_core::Metadata::delivery_count) on every delivery, and one
//! that claims lanes [`Metadata::lane`](inbox_core::Metadata::lane). The scenario of a message
//! that kills its consumer runs only where the source claims delivery counts; elsewhere it says
//! why it is skipped.
//!
//! # Writing an adapter
//!
//! The scenarios every inbox store passes are in [`store`], run with [`store_suite!`].
//!
//! The test kit's in-memory broker is [`memory::Memory`]: the suite on it runs in seconds and
//! is the PostgreSQL store's own scenario test. The five adapters of this workspace are
//! implemented here, each behind a feature of its name:
//! `kafka::Kafka` (feature `kafka`), `sqs::Sqs` (`sqs`), `rabbitmq::RabbitMq` (`rabbitmq`),
//! `redis::Redis` (`redis`) and `nats::Nats` (`nats`), each with the suite's settings (Kafka's and RabbitMQ's as their
//! `Default`); a tool that runs them longer or harder sets Kafka's partitions and timeouts and
//! RabbitMQ's delivery limit. An
//! adapter's conformance test file is then one line, with the feature on in its dev-dependency
//! on `inbox-conformance`:
//!
//! ```ignore
//! inbox_conformance::suite!(inbox_conformance::redis::Redis);
//! ```
//!
//! The feature `at-most-once` adds `TestQueue::at_most_once_source`: the queue's source
//! wrapped in the test kit's `AckOnReceive`, the ack-on-receipt anti-pattern, for tools that
//! measure what it loses.
//!
//! Three things the scenarios hold every adapter to that its broker's client may not give by
//! itself:
//! - **`receive` bounds every wait.** A pull or poll whose connection is lost may never be
//!   answered: the source gives up after its operation timeout and asks again, or the consumer
//!   hangs through a network fault.
//! - **A broker restart shows up as an error.** Where the client reconnects and resubscribes on
//!   its own, the source still reports the failed operation (a receive, an ack) at least once:
//!   the restart scenario fails when the consumer's error and ack-failure counts stay at zero
//!   through it, since an operator watching them would not see the outage either.
//! - **The broker is empty within 10 s of the consumer stopping.** Each scenario ends by
//!   checking that nothing is left unacked ([`TestQueue::left`], polled for 10 s), so an ack that
//!   failed (a connection cut, a lost confirm) must be sent again, at the next receive or when
//!   the source is dropped, rather than left for the broker's ack timeout to redeliver.
//!
//! An adapter is a [`MessageSource`], which receives, with its [`Ack`](inbox_core::Ack) handle,
//! which settles each delivery (ack, nack, and dead-letter: park the message with the
//! [`inbox_core::dead_letter`] metadata, then ack it; on failure leave it to come back), and a
//! producer. The handle carries what it needs for all three (a cheap clone of the client and
//! the dead-letter destination, shared by the source's acks). To run the whole suite against
//! a new one, add `inbox-conformance` and `tokio` as dev-dependencies, then in
//! `tests/conformance.rs` (or in a module of this crate, behind a feature, for a tool to share):
//!
//! ```ignore
//! use std::sync::Arc;
//! use std::time::Duration;
//! use inbox_conformance::{LosingSource, Proxied, TestBroker, TestQueue};
//! use inbox_core::{replay::DynDeadLetters, DynPublish};
//!
//! struct MyBroker;
//!
//! impl TestBroker for MyBroker {
//!     type Queue = MyQueue;
//!     async fn queue(&self, scenario: &str) -> MyQueue {
//!         // A queue (topic, stream) no other test uses, with its dead-letter destination.
//!         MyQueue::create(scenario).await
//!     }
//!     async fn attach(&self, name: &str) -> MyQueue { MyQueue::open(name) }
//! }
//!
//! impl TestQueue for MyQueue {
//!     type Source = MySource;
//!     fn name(&self) -> String { /* what `attach` takes, in a child process */ }
//!     async fn send(&self, id: Option<&str>, payload: &[u8]) { /* raw send, ID as given */ }
//!     async fn source(&self, member: &str) -> MySource { /* a consumer-group member */ }
//!     async fn losing_source(&self, member: &str) -> Option<LosingSource<MySource>> {
//!         /* a member whose hold on a message runs out while its handler stalls */
//!     }
//!     async fn proxied_source(&self, member: &str) -> Option<Proxied<MySource>> {
//!         /* a member connected through a `FaultProxy` in front of the broker */
//!     }
//!     fn redelivery_delay(&self) -> Duration { /* how soon a dead member's message is back */ }
//!     async fn producer(&self) -> Arc<dyn DynPublish> { /* the adapter's producer */ }
//!     fn destination(&self) -> String { /* what outbox rows name to reach this queue */ }
//!     async fn dead_letter_reader(&self) -> Option<Box<dyn DynDeadLetters>> {
//!         /* the adapter's dead-letter reader, as replay uses it */
//!     }
//!     async fn left(&self) -> u64 { /* messages not yet acked, delivered or not */ }
//!     async fn cleanup(&self) { /* delete the queue and its dead-letter destination */ }
//! }
//!
//! inbox_conformance::suite!(MyBroker);
//! ```
//!
//! `cargo test --test conformance` then runs every scenario; the kill scenario starts the test
//! binary again as its consumer process (the ignored test `conformance_child`) and SIGKILLs it.
//! An adapter that cannot offer a scenario what it needs (a broker that cannot take a message
//! away from a stalled consumer, one no proxy can stand in front of, one no test may restart)
//! returns `None` from [`TestQueue::losing_source`] or [`TestQueue::proxied_source`], or an
//! error from [`TestQueue::restartable`], and the scenario says why it is skipped. Where a proxy
//! in front of the shared broker cannot carry every connection, [`TestQueue::proxied_twin`]
//! gives the network-fault scenarios a queue on a broker of the adapter's own. The adapter keeps
//! only the tests of what is its own (rebalances, visibility heartbeats, `XAUTOCLAIM`, FIFO
//! groups).

mod checked;
pub mod child;
mod db;
mod fault_proxy;
mod fault_run;
pub mod foreign_ids;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod kill;
pub mod memory;
#[cfg(feature = "mysql")]
pub mod mysql_wallet;
#[cfg(feature = "nats")]
pub mod nats;
mod network;
mod outbox;
pub mod outbox_table;
pub mod pg_cluster;
#[cfg(any(
    feature = "kafka",
    feature = "redis",
    feature = "nats",
    feature = "rabbitmq"
))]
#[cfg_attr(
    not(any(feature = "kafka", feature = "redis", feature = "nats")),
    allow(dead_code)
)]
mod process;
pub mod provider;
pub mod python;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
mod redelivery;
#[cfg(feature = "redis")]
pub mod redis;
pub mod replay;
pub mod scenarios;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod store;
pub mod tls;
pub mod wallet;
mod zombie;

pub use checked::Checked;
pub use db::{database_url, partitioned_layout, StoreTx, TestDb, TestStore};
pub use fault_proxy::{FaultProxy, ProxyMode};
pub use fault_run::{wait_for_a_third, FaultRun, Restored};
pub use network::{Restart, Restartable};
pub use provider::TestProvider;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{DynPublish, MessageSource};
#[cfg(feature = "at-most-once")]
use inbox_testkit::AckOnReceive;

/// A name no other test uses: `prefix`, a dash and 12 random hex digits.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// A dead-letter reader as [`TestQueue::dead_letter_reader`] returns it, once connected.
#[allow(dead_code)] // unused when no broker feature is on
fn connected_reader<R: inbox_core::replay::DynDeadLetters + 'static>(
    connected: Result<R, impl std::fmt::Debug>,
) -> Option<Box<dyn inbox_core::replay::DynDeadLetters>> {
    Some(Box::new(
        connected.expect("the dead-letter reader connects"),
    ))
}

/// A message parked in a dead-letter destination, as the broker holds it.
#[derive(Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The original payload, byte for byte.
    pub payload: Vec<u8>,
    /// Why it was parked, as the consumer wrote it.
    pub reason: String,
}

impl std::fmt::Debug for DeadLetter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetter")
            .field("payload", &String::from_utf8_lossy(&self.payload))
            .field("reason", &self.reason)
            .finish()
    }
}

/// A source that loses what it holds when its handler stalls, and for how long to stall:
/// what [`TestQueue::losing_source`] returns.
#[derive(Debug)]
pub struct LosingSource<S> {
    /// The member's source.
    pub source: S,
    /// How long the handler stalls on its message: past the moment the broker hands it to
    /// another member, with time left for that member to receive it.
    pub stall: Duration,
}

/// A source connected through a fault proxy: what [`TestQueue::proxied_source`] returns.
#[derive(Debug)]
pub struct Proxied<S> {
    /// The member's source, connected through `proxy`.
    pub source: S,
    /// The proxy in front of the broker.
    pub proxy: FaultProxy,
    /// How long a black hole lasts: past the moment the source gives up on a silent
    /// connection, so that its first reconnects land in the hole too.
    pub blackhole: Duration,
    /// Whether the consumer counts the faults as errors or failed acks; `false` where the
    /// client rides them out by itself and only logs them (librdkafka reconnects and resends on
    /// its own), and the scenarios check instead that it applies again soon after.
    pub counts_faults: bool,
}

/// A broker under test: each scenario asks it for a queue of its own.
pub trait TestBroker: Send + Sync + 'static {
    /// A queue, topic or stream with its dead-letter destination.
    type Queue: TestQueue;

    /// A new, empty queue no other test uses; `scenario` is part of its name, to find it on the
    /// broker when a test fails.
    fn queue(&self, scenario: &str) -> impl Future<Output = Self::Queue> + Send;

    /// The queue [`TestQueue::name`] names, from another process: the kill scenario's consumer
    /// runs in a child process.
    fn attach(&self, name: &str) -> impl Future<Output = Self::Queue> + Send;

    /// Whether a child process can [`attach`](TestBroker::attach) to this broker's queues:
    /// `false` for a broker inside the test process ([`memory::Memory`]), and the process-kill
    /// scenario is skipped with the reason printed. Default: `true`.
    fn reaches_other_processes(&self) -> bool {
        true
    }
}

/// One queue of the broker under test, seen from its producers and consumers.
pub trait TestQueue: Send + Sync + 'static {
    /// The adapter's source, consuming this queue.
    type Source: MessageSource + Send + 'static;

    /// What [`TestBroker::attach`] finds this queue by (its name, URL, or whatever it needs).
    fn name(&self) -> String;

    /// Sends `payload` with the message ID `id` set exactly as given (not validated), or with no
    /// ID at all.
    fn send(&self, id: Option<&str>, payload: &[u8]) -> impl Future<Output = ()> + Send;

    /// A source for the consumer-group member `member`. Two sources of the same member are the
    /// same consumer restarted; of two members, the broker shares the queue between them. The
    /// source should poll briefly (about 200 ms) so that `run_until_idle` returns soon after the
    /// queue is drained, and a message a consumer died holding should come back within seconds,
    /// to the same member and to another (the kill scenario restarts under new member names).
    fn source(&self, member: &str) -> impl Future<Output = Self::Source> + Send;

    /// A source of `member` that loses a message it delivered to another member while the
    /// handler stalls on it (a Kafka `max.poll.interval.ms`, an SQS visibility timeout with the
    /// heartbeat off, a Redis `XAUTOCLAIM` after a short idle), and how long to stall; `None`
    /// where the broker cannot take a message away reliably, and the ownership-loss scenario is
    /// skipped with the reason printed.
    fn losing_source(
        &self,
        member: &str,
    ) -> impl Future<Output = Option<LosingSource<Self::Source>>> + Send;

    /// Takes away what `member` (a source of [`TestQueue::losing_source`]) holds, where the
    /// broker does not do it by itself after a time: RabbitMQ closes the member's connection.
    /// Called once the member's handler stalls. Default: nothing, the broker's timeout does it.
    fn take_away(&self, member: &str) -> impl Future<Output = ()> + Send {
        async move {
            let _ = member;
        }
    }

    /// A source of `member` whose connections to the broker go through a [`FaultProxy`] that
    /// the network-fault scenarios black-hole, cut and refuse, with how long a black hole lasts;
    /// `None` where no proxy can stand between the broker and its clients (an HTTPS endpoint,
    /// the shared Kafka broker), and those scenarios are skipped with the reason printed. The
    /// source should give up on a silent connection within seconds (an operation timeout, a
    /// heartbeat).
    ///
    /// Default: `None`.
    fn proxied_source(
        &self,
        member: &str,
    ) -> impl Future<Output = Option<Proxied<Self::Source>>> + Send {
        async move {
            let _ = member;
            None
        }
    }

    /// A queue like this one on a broker of the adapter's own, which the network-fault scenarios
    /// send to, consume through [`TestQueue::proxied_source`] and inspect instead of this one,
    /// where a proxy in front of the shared broker would not carry every connection: a Kafka
    /// client connects to the address the broker advertises, so Kafka's twin is a topic on a
    /// private Tansu that advertises its proxy (killed when the twin is dropped). Default:
    /// `None`, the scenarios run on this queue.
    fn proxied_twin(&self) -> impl Future<Output = Option<Self>> + Send
    where
        Self: Sized,
    {
        async move { None }
    }

    /// A queue like this one on a server the broker-restart scenario may stop and start again
    /// (Redis: a `redis-server` of its own with an append-only file), or why there is none, which
    /// the scenario prints as it skips. Default: none.
    fn restartable(&self) -> impl Future<Output = Result<Restartable<Self>, String>> + Send
    where
        Self: Sized,
    {
        async move { Err("the adapter offers no server a test may restart".into()) }
    }

    /// A source of `member` that acks each message as it receives it, before the handler runs:
    /// the anti-pattern, for tools that show what it loses when a consumer dies. Default:
    /// [`TestQueue::source`] in an `AckOnReceive`; Kafka's commits what it acked every 5 s, as
    /// `enable.auto.commit` does.
    #[cfg(feature = "at-most-once")]
    fn at_most_once_source(
        &self,
        member: &str,
    ) -> impl Future<Output = AckOnReceive<Self::Source>> + Send {
        async move { AckOnReceive::new(self.source(member).await) }
    }

    /// How long a message held (not acked) by a consumer that died takes to come back to
    /// another member: the broker's own timeout plus a margin (Kafka's session timeout twice,
    /// SQS's visibility timeout, RabbitMQ's notice of the closed connection, the Redis claim
    /// idle and sweep).
    fn redelivery_delay(&self) -> Duration;

    /// The adapter's producer, as the outbox relay uses it.
    fn producer(&self) -> impl Future<Output = Arc<dyn DynPublish>> + Send;

    /// What outbox rows name as their destination to reach this queue through
    /// [`TestQueue::producer`]: a topic, a queue name or URL, a stream key. Default:
    /// [`TestQueue::name`].
    fn destination(&self) -> String {
        self.name()
    }

    /// The adapter's reader of the dead-letter destination (its `XDeadLetters`, as
    /// `inbox-admin dead-letters` and [`inbox_core::replay`] use it): every scenario reads its
    /// dead letters through it, so the suite also checks what an operator would see. `None`
    /// where the adapter has none; such a queue overrides [`TestQueue::dead_letters`], and the
    /// replay scenario is skipped. Default: `None`.
    fn dead_letter_reader(
        &self,
    ) -> impl Future<Output = Option<Box<dyn inbox_core::replay::DynDeadLetters>>> + Send {
        async move { None }
    }

    /// The dead-letter destination's messages so far, oldest first, left where they are.
    /// Default: read through [`TestQueue::dead_letter_reader`].
    fn dead_letters(&self) -> impl Future<Output = Vec<DeadLetter>> + Send {
        async move {
            let mut reader = self
                .dead_letter_reader()
                .await
                .expect("a queue without a dead-letter reader overrides `dead_letters`");
            let mut read = Vec::new();
            inbox_core::replay::scan(reader.as_mut(), &mut |letter| read.push(letter.clone()))
                .await
                .expect("the dead-letter reader reads the destination");
            // Oldest first: by the time the broker gives, then in reading order.
            read.sort_by_key(|letter| letter.timestamp);
            read.into_iter()
                .map(|letter| DeadLetter {
                    reason: letter.reason.unwrap_or_default(),
                    payload: letter.payload,
                })
                .collect()
        }
    }

    /// Where `python/publish.py` publishes to this queue, for the foreign-ID scenarios
    /// ([`foreign_ids`]): `{"broker": "kafka", "brokers": .., "topic": ..}`, `{"broker":
    /// "rabbitmq", "url": .., "queue": ..}`, `{"broker": "sqs", "queue_url": ..}`, `{"broker":
    /// "redis", "url": .., "stream": ..}`. Default: `None`, and those scenarios are skipped.
    fn python_target(&self) -> Option<serde_json::Value> {
        None
    }

    /// A source of `member`, as [`TestQueue::source`], reading each message's ID as `from`;
    /// `None` where the adapter reads IDs one way only. Default: `None`.
    fn source_reading(
        &self,
        member: &str,
        from: inbox_core::IdFrom,
    ) -> impl Future<Output = Option<Self::Source>> + Send {
        async move {
            let _ = (member, from);
            None
        }
    }

    /// Messages not acked yet, delivered or not.
    fn left(&self) -> impl Future<Output = u64> + Send;

    /// Messages not acked yet, counted while consumers run: a harness's "is the queue drained
    /// yet". Default: [`TestQueue::left`]. Where the broker counts delivered, unacked messages
    /// only once their consumers are gone (RabbitMQ, whose `left` waits for that), this counts
    /// the messages waiting for delivery.
    fn waiting(&self) -> impl Future<Output = u64> + Send {
        async move { self.left().await }
    }

    /// Deletes the queue and its dead-letter destination.
    fn cleanup(&self) -> impl Future<Output = ()> + Send;
}

/// One `#[tokio::test]` per scenario of [`scenarios`], each run against `$broker` (an
/// expression of a type implementing [`TestBroker`], evaluated once per test) and the inbox
/// store `$store` (a type implementing [`TestStore`]; [`TestDb`], PostgreSQL, when left out):
/// `suite!(Redis)`, `suite!(Redis, inbox_conformance::store::MySqlDb)`.
#[macro_export]
macro_rules! suite {
    ($broker:expr) => {
        $crate::suite!($broker, $crate::TestDb);
    };
    ($broker:expr, $store:ty) => {
        $crate::suite!(@tests $broker, $store;
            the_same_id_twice_is_applied_once,
            a_crash_at_each_stage_loses_nothing_and_applies_nothing_twice,
            racing_consumers_apply_each_id_once,
            messages_without_an_id_or_with_a_bad_payload_are_dead_lettered,
            a_failing_handler_is_retried_then_dead_lettered,
            a_downstream_outage_is_ridden_out_by_delayed_redeliveries,
            a_message_that_kills_its_consumer_is_dead_lettered_by_its_delivery_count,
            batches_over_lanes_apply_everything_once,
            a_consumer_process_killed_mid_stream_loses_nothing_and_applies_nothing_twice,
            a_consumer_that_lost_its_message_mid_handler_applies_nothing_twice,
            a_handler_writes_the_outbox_the_relay_publishes_and_the_downstream_inbox_applies_each_once,
            a_lost_confirm_publishes_again_under_the_same_ids_and_the_inbox_skips_the_copies,
            two_relays_at_once_publish_every_row_once,
            headers_written_with_an_outbox_row_reach_the_consumer,
            a_black_holed_connection_is_given_up_and_replaced,
            connections_cut_again_and_again_lose_and_repeat_nothing,
            a_refused_broker_is_retried_until_it_is_back,
            a_broker_restarted_mid_stream_loses_and_repeats_nothing,
            dead_letters_replayed_after_the_fix_are_applied_once_and_none_stay_parked,
        );
        /// The consumer process of the kill scenario, started by it; not a test of its own.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "the consumer process of the kill scenario; runs only as its child"]
        async fn conformance_child() {
            $crate::scenarios::consumer_process::<_, $store>(&$broker).await;
        }
    };
    (@tests $broker:expr, $store:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::scenarios::$name::<_, $store>(&$broker).await;
            }
        )*
    };
}
