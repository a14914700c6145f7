//! The suite on RabbitMQ (feature `rabbitmq`): [`RabbitMq`] gives each scenario a quorum queue of
//! its own, dead-lettered to `<queue>.dlq`.
//!
//! The broker is at `AMQP_URL` (default [`LOCAL_AMQP_URL`]); closing a member's
//! connection runs `rabbitmqctl`, which must be on the `PATH`.

mod address;
mod admin;
mod restart;
pub mod tls_node;

pub use address::{amqp_url, LOCAL_AMQP_URL};
use admin::ready_on;
pub use admin::{
    admin_channel, cleanup, close_connection, close_pids, connection_pids, drain, left_on,
    passive_declare, Parked,
};

use std::sync::Arc;
use std::time::Duration;

use crate::FaultProxy;
use inbox_core::DynPublish;
use inbox_rabbitmq::lapin::BasicProperties;
use inbox_rabbitmq::{RabbitConnection, RabbitProducer, RabbitSource, RabbitSourceBuilder};

use crate::{LosingSource, Proxied, Restartable, TestBroker, TestQueue};

/// A config for a fresh, randomly named queue, `label` in its name and its connection's.
pub fn fresh_config(label: &str) -> RabbitSourceBuilder {
    fresh_config_on(&RabbitConnection::new(amqp_url()), label)
}

/// [`fresh_config`] on `connection` (the test broker with settings of a test's own).
pub fn fresh_config_on(connection: &RabbitConnection, label: &str) -> RabbitSourceBuilder {
    connection
        .source(crate::unique_name(&format!("inbox-test-{label}")))
        .poll_timeout(Duration::from_millis(500))
        .connection_name(crate::unique_name(&format!("inbox-test {label}")))
}

/// A producer for the broker of `config`, once the queue of `config` and its DLQ are declared.
pub async fn publisher(config: &RabbitSourceBuilder) -> RabbitProducer {
    config.declare_topology().await.expect("declare topology");
    config
        .connection()
        .producer()
        .connect()
        .await
        .expect("connect the producer")
}

/// RabbitMQ under test. The default is the suite's: receives that wait 200 ms, queues declared
/// with the adapter's default `x-delivery-limit`, and a broker no scenario restarts.
#[derive(Debug, Clone, Copy)]
pub struct RabbitMq {
    delivery_limit: bool,
    restarts: bool,
}

impl Default for RabbitMq {
    fn default() -> Self {
        Self {
            delivery_limit: true,
            restarts: false,
        }
    }
}

impl RabbitMq {
    /// Declares the queues without `x-delivery-limit`
    /// ([`RabbitSourceBuilder::no_delivery_limit`]): a run that kills its consumers many times
    /// requeues each prefetched message once per kill, and with a limit those messages would be
    /// parked rather than applied.
    pub fn no_delivery_limit(mut self) -> Self {
        self.delivery_limit = false;
        self
    }

    /// Lets the broker-restart scenario stop and start the broker's application
    /// (`rabbitmqctl stop_app`, 3 s, `start_app`; default off). Every other test on the broker
    /// fails meanwhile: for a test binary of its own (cargo runs them one after another), not
    /// for the suite's, whose scenarios run at once.
    pub fn restarts(mut self, on: bool) -> Self {
        self.restarts = on;
        self
    }
}

/// A quorum queue of its own; its dead letters go to `<queue>.dlq`.
#[derive(Debug)]
pub struct Queue {
    broker: RabbitMq,
    config: RabbitSourceBuilder,
    publisher: RabbitProducer,
}

impl TestBroker for RabbitMq {
    type Queue = Queue;

    async fn queue(&self, scenario: &str) -> Queue {
        self.attach(fresh_config(scenario).queue()).await
    }

    async fn attach(&self, name: &str) -> Queue {
        let mut config = RabbitConnection::new(amqp_url())
            .source(name)
            .poll_timeout(Duration::from_millis(200));
        if !self.delivery_limit {
            config = config.no_delivery_limit();
        }
        Queue {
            broker: *self,
            publisher: publisher(&config).await, // declares the queue and its DLQ
            config,
        }
    }
}

impl Queue {
    /// The broker connection name of `member`'s source.
    fn connection(&self, member: &str) -> String {
        format!("inbox-conformance {} {member}", self.config.queue())
    }

    /// The settings of `member`'s source.
    fn builder(&self, member: &str) -> RabbitSourceBuilder {
        // Members share the queue; the name tells their connections apart on the broker.
        self.config.clone().connection_name(self.connection(member))
    }
}

impl TestQueue for Queue {
    type Source = RabbitSource;

    fn name(&self) -> String {
        self.config.queue().to_owned()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        let props = match id {
            Some(id) => BasicProperties::default().with_message_id(id.into()),
            None => BasicProperties::default(),
        };
        self.publisher
            .publish_with_properties(self.config.queue(), payload, props)
            .await
            .expect("publish");
    }

    async fn source(&self, member: &str) -> RabbitSource {
        self.builder(member)
            .connect()
            .await
            .expect("connect source")
    }

    async fn losing_source(&self, member: &str) -> Option<LosingSource<RabbitSource>> {
        // RabbitMQ has no per-delivery timeout short enough for a test (`consumer_timeout` is
        // checked once a minute): `take_away` closes the member's connection, and the broker
        // requeues what it held.
        Some(LosingSource {
            source: self.source(member).await,
            stall: Duration::from_secs(8),
        })
    }

    async fn take_away(&self, member: &str) {
        close_connection(&self.connection(member)).await;
    }

    async fn proxied_source(&self, member: &str) -> Option<Proxied<RabbitSource>> {
        let proxied = FaultProxy::in_front_of_url(&amqp_url(), 5672).await;
        let (proxy, through) = proxied.expect("a proxy in front of AMQP_URL");
        // A silent peer is declared dead after two heartbeats without a frame (4 s); a
        // reconnect that lands in the hole gives up after 5 s and tries again.
        let config = RabbitConnection::new(through)
            .heartbeat(Duration::from_secs(2))
            .operation_timeout(Duration::from_secs(5))
            .source(self.config.queue())
            .poll_timeout(Duration::from_millis(200))
            .connection_name(self.connection(member));
        let source = config.connect().await.expect("connect source");
        Some(Proxied {
            source,
            proxy,
            blackhole: Duration::from_secs(10),
            counts_faults: true,
        })
    }

    async fn restartable(&self) -> Result<Restartable<Queue>, String> {
        if !self.broker.restarts {
            return Err(
                "restarting the shared broker would fail every scenario running beside \
                        it; inbox-rabbitmq's tests/it/broker_restart.rs runs this one alone"
                    .into(),
            );
        }
        Ok(Restartable {
            queue: self.broker.attach(self.config.queue()).await,
            server: Box::<restart::App>::default(),
        })
    }

    fn redelivery_delay(&self) -> Duration {
        // The broker requeues what a connection held as soon as it sees the connection close;
        // a dead process's socket closes with it.
        Duration::from_secs(3)
    }

    async fn producer(&self) -> Arc<dyn DynPublish> {
        Arc::new(publisher(&self.config).await)
    }

    async fn left(&self) -> u64 {
        // Ready messages once no consumer holds any: unacked ones are back in the queue by then.
        left_on(self.config.queue()).await.into()
    }

    async fn waiting(&self) -> u64 {
        ready_on(self.config.queue()).await.into()
    }

    async fn dead_letter_reader(&self) -> Option<Box<dyn inbox_core::replay::DynDeadLetters>> {
        let reader = self
            .config
            .connection()
            .dead_letters(self.config.dead_letter_queue());
        crate::connected_reader(reader.connect().await)
    }

    async fn cleanup(&self) {
        cleanup(&self.config).await;
    }

    fn python_target(&self) -> Option<serde_json::Value> {
        Some(
            serde_json::json!({"broker": "rabbitmq", "url": amqp_url(), "queue": self.config.queue()}),
        )
    }

    async fn source_reading(&self, member: &str, from: inbox_core::IdFrom) -> Option<RabbitSource> {
        let source = self.builder(member).id_from(from).connect().await;
        Some(source.expect("connect source"))
    }
}
