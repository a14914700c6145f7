//! The scenarios every broker adapter passes, written once: each adapter implements
//! [`TestBroker`] and [`TestQueue`] in a few lines of its tests, and [`suite!`] turns every
//! scenario into a `#[tokio::test]` run against the real broker and a real PostgreSQL inbox.
//!
//! The scenarios ([`scenarios`]) credit the test kit's wallet (`inbox_testkit::wallet`)
//! in a schema of their own, and check what a user cares about: every message applied once,
//! nothing lost, nothing left on the broker, and what could not be applied parked in the
//! dead-letter destination with its payload and a reason.
//!
//! # Writing an adapter
//!
//! An adapter is a [`MessageSource`](inbox_core::MessageSource) with its
//! [`Ack`](inbox_core::Ack), and a producer. To run the whole suite against it, add
//! `inbox-conformance` and `tokio` as dev-dependencies, then in `tests/conformance.rs`:
//!
//! ```ignore
//! use inbox_conformance::{async_trait, DeadLetter, TestBroker, TestQueue};
//!
//! struct MyBroker;
//!
//! #[async_trait]
//! impl TestBroker for MyBroker {
//!     type Queue = MyQueue;
//!     async fn queue(&self, scenario: &str) -> MyQueue {
//!         // A queue (topic, stream) no other test uses, with its dead-letter destination.
//!         MyQueue::create(scenario).await
//!     }
//!     async fn attach(&self, name: &str) -> MyQueue { MyQueue::open(name) }
//! }
//!
//! #[async_trait]
//! impl TestQueue for MyQueue {
//!     type Source = MySource;
//!     fn counts_deliveries(&self) -> bool { true }
//!     fn name(&self) -> String { /* what `attach` takes, in a child process */ }
//!     async fn send(&self, id: Option<&str>, payload: &[u8]) { /* raw send, ID as given */ }
//!     async fn source(&self, member: &str) -> MySource { /* a consumer-group member */ }
//!     async fn dead_letters(&self) -> Vec<DeadLetter> { /* payload and reason of each */ }
//!     async fn left(&self) -> u64 { /* messages not yet acked, delivered or not */ }
//!     async fn cleanup(&self) { /* delete the queue and its dead-letter destination */ }
//! }
//!
//! inbox_conformance::suite!(MyBroker);
//! ```
//!
//! `cargo test --test conformance` then runs every scenario; the kill scenario starts the test
//! binary again as its consumer process (the ignored test `conformance_child`) and SIGKILLs it. The adapter keeps only the tests
//! of what is its own (rebalances, visibility heartbeats, `XAUTOCLAIM`, connection loss).

mod kill;
pub mod scenarios;

pub use async_trait::async_trait;

use inbox_core::MessageSource;

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

/// A broker under test: each scenario asks it for a queue of its own.
#[async_trait]
pub trait TestBroker: Send + Sync + 'static {
    /// A queue, topic or stream with its dead-letter destination.
    type Queue: TestQueue;

    /// A new, empty queue no other test uses; `scenario` is part of its name, to find it on the
    /// broker when a test fails.
    async fn queue(&self, scenario: &str) -> Self::Queue;

    /// The queue [`TestQueue::name`] names, from another process: the kill scenario's consumer
    /// runs in a child process.
    async fn attach(&self, name: &str) -> Self::Queue;
}

/// One queue of the broker under test, seen from its producers and consumers.
#[async_trait]
pub trait TestQueue: Send + Sync + 'static {
    /// The adapter's source, consuming this queue.
    type Source: MessageSource + Send + 'static;

    /// Whether the broker counts deliveries ([`Consumer::max_deliveries`] works): the scenario
    /// of a message that kills its consumer runs only where it does.
    ///
    /// [`Consumer::max_deliveries`]: inbox_core::Consumer::max_deliveries
    fn counts_deliveries(&self) -> bool;

    /// What [`TestBroker::attach`] finds this queue by (its name, URL, or whatever it needs).
    fn name(&self) -> String;

    /// Sends `payload` with the message ID `id` set exactly as given (not validated), or with no
    /// ID at all.
    async fn send(&self, id: Option<&str>, payload: &[u8]);

    /// A source for the consumer-group member `member`. Two sources of the same member are the
    /// same consumer restarted; of two members, the broker shares the queue between them. The
    /// source should poll briefly (about 200 ms) so that `run_until_idle` returns soon after the
    /// queue is drained, and a message a consumer died holding should come back within seconds,
    /// to the same member and to another (the kill scenario restarts under new member names).
    async fn source(&self, member: &str) -> Self::Source;

    /// The dead-letter destination's messages so far, oldest first.
    async fn dead_letters(&self) -> Vec<DeadLetter>;

    /// Messages not acked yet, delivered or not.
    async fn left(&self) -> u64;

    /// Deletes the queue and its dead-letter destination.
    async fn cleanup(&self);
}

/// One `#[tokio::test]` per scenario of [`scenarios`], each run against `$broker` (an
/// expression of a type implementing [`TestBroker`], evaluated once per test).
#[macro_export]
macro_rules! suite {
    ($broker:expr) => {
        $crate::suite!(@tests $broker;
            the_same_id_twice_is_applied_once,
            a_crash_at_each_stage_loses_nothing_and_applies_nothing_twice,
            racing_consumers_apply_each_id_once,
            messages_without_an_id_or_with_a_bad_payload_are_dead_lettered,
            a_failing_handler_is_retried_then_dead_lettered,
            a_message_that_kills_its_consumer_is_dead_lettered_by_its_delivery_count,
            batches_over_lanes_apply_everything_once,
            a_consumer_process_killed_mid_stream_loses_nothing_and_applies_nothing_twice,
        );
        /// The consumer process of the kill scenario, started by it; not a test of its own.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "the consumer process of the kill scenario; runs only as its child"]
        async fn conformance_child() {
            $crate::scenarios::consumer_process(&$broker).await;
        }
    };
    (@tests $broker:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::scenarios::$name(&$broker).await;
            }
        )*
    };
}
