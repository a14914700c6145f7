//! The children of `effects-test`: an effect consumer calling the parent's test provider, and
//! the three processes of the outbox chain (forwarder, relay, wallet credit). Each takes its
//! broker source from the conformance suite's broker (`brokers.rs`), says `ready`, and runs
//! until killed or Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::provider::{CallStatus, ProviderClient};
use inbox_conformance::wallet::Credit;
use inbox_conformance::TestDb;
use inbox_core::effect::{not_applied, Effect, EffectHandler, Landed, OnUnknown};
use inbox_core::{
    BoxError, Consumer, DynPublish, Handler, HandlerError, Message, MessageId, MessageSource,
};
use inbox_postgres::{Outbox, PgLeases, PgTx};
use inbox_testkit::fast_retry;

use crate::cli::{child_args, millis, named, BrokerKind, KafkaImpl};

/// The environment variable the parent passes the provider's address in.
pub(crate) const PROVIDER_ENV: &str = "EFFECTS_PROVIDER";
/// The effect consumer's name: part of every idempotency key.
pub(crate) const EFFECT_CONSUMER: &str = "notify";
/// A lease longer than any call (the slow first call included) on a busy machine.
pub(crate) const LEASE: Duration = Duration::from_secs(2);

named! {
    /// What the provider offers and what the handler does after an unknown outcome.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Mode ("mode") {
        Keys = "keys",
        Lookup = "lookup",
        NeitherRetry = "neither+retry",
        NeitherSkip = "neither+skip",
    }
}

named! {
    /// Which process a child is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Role ("role") {
        /// The effect consumer of the kill test.
        Effect = "effect",
        /// Consumer A: reads X, writes a forwarded event into the outbox in its inbox transaction.
        Forward = "forward",
        /// The outbox relay, publishing to Y.
        Relay = "relay",
        /// Consumer B: the wallet credit on Y.
        Credit = "credit",
    }
}

/// A child's command line: `evidence effects-child`, started by `effects-test` (see
/// [`ChildSpec::to_args`]).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ChildSpec {
    /// Which process this child is.
    #[arg(long, value_name = "effect|forward|relay|credit")]
    pub(crate) role: Role,
    /// The broker it reads or writes.
    #[arg(long, value_name = "kafka|sqs|rabbitmq|redis|nats")]
    pub(crate) broker: BrokerKind,
    /// The queue, topic or stream read (the relay: the one written).
    #[arg(long, value_name = "QUEUE")]
    pub(crate) name: String,
    /// Where the forwarder's outbox rows go (its destination), for `Forward`.
    #[arg(long, value_name = "QUEUE", default_value = "")]
    pub(crate) destination: String,
    /// The Postgres schema of the run.
    #[arg(long)]
    pub(crate) schema: String,
    /// What the provider offers and what the handler does after an unknown outcome.
    #[arg(long, value_name = "MODE", default_value = "keys")]
    pub(crate) mode: Mode,
    /// The provider's slow first call (effects), the handlers' sleep (the outbox chain).
    #[arg(long, value_name = "MS", default_value = "0", value_parser = millis)]
    pub(crate) work_ms: u64,
}

impl ChildSpec {
    pub(crate) fn to_args(&self) -> Vec<String> {
        let flags = [
            ("--role", self.role.to_string()),
            ("--broker", self.broker.to_string()),
            ("--name", self.name.clone()),
            ("--destination", self.destination.clone()),
            ("--schema", self.schema.clone()),
            ("--mode", self.mode.to_string()),
            ("--work-ms", self.work_ms.to_string()),
        ];
        child_args("effects-child", flags)
    }
}

/// `evidence effects-child …`: one child, until killed or Ctrl-C.
pub(crate) async fn main(spec: &ChildSpec) -> Result<(), BoxError> {
    let db = TestDb::attach(&spec.schema).await;
    crate::brokers::with_broker!(spec.broker, KafkaImpl::default(), |broker| {
        broker.run_child(spec, &db).await
    })
}

/// Runs the consumer of `spec` (not the relay) on `source`.
pub(crate) async fn run<S: MessageSource + 'static>(
    source: S,
    spec: &ChildSpec,
    db: &TestDb,
) -> Result<(), BoxError> {
    let work = Duration::from_millis(spec.work_ms);
    match spec.role {
        Role::Effect => {
            let addr: SocketAddr = std::env::var(PROVIDER_ENV)
                .map_err(|_| format!("{PROVIDER_ENV} is not set"))?
                .parse()?;
            let handler = Notify {
                client: ProviderClient::new(addr),
                mode: spec.mode,
            };
            let leases = PgLeases::new(db.inbox())?;
            crate::ready();
            Consumer::effects(EFFECT_CONSUMER, source, leases, handler)
                .lease(LEASE)
                .retry(fast_retry(10))
                .error_backoff(Duration::from_millis(100))
                .run_until(crate::ctrl_c())
                .await?;
        }
        Role::Forward => {
            let handler = Forward {
                outbox: Outbox::new(db.pool.clone()),
                destination: spec.destination.clone(),
                work,
            };
            on_inbox("forward", source, db, handler).await?;
        }
        Role::Credit => on_inbox("wallet", source, db, Credit::new(db.clone()).work(work)).await?,
        Role::Relay => return Err("the relay reads no source".into()),
    }
    Ok(())
}

/// Consumer A or B: `handler` on the run's inbox, in batches of 10.
async fn on_inbox<S: MessageSource + 'static, H: Handler<PgTx> + 'static>(
    name: &str,
    source: S,
    db: &TestDb,
    handler: H,
) -> Result<(), BoxError> {
    crate::ready();
    Consumer::new(name, source, db.inbox(), handler)
        .batch_size(10)
        .error_backoff(Duration::from_millis(100))
        .run_until(crate::ctrl_c())
        .await?;
    Ok(())
}

/// The relay child: the outbox through `publisher`, the broker's producer.
pub(crate) async fn relay(publisher: Arc<dyn DynPublish>, db: &TestDb) -> Result<(), BoxError> {
    let outbox = Outbox::new(db.pool.clone());
    crate::ready();
    outbox
        .relay(publisher)
        .batch_size(50)
        .poll_interval(Duration::from_millis(100))
        .error_backoff(Duration::from_millis(200))
        .run_until(crate::ctrl_c())
        .await?;
    Ok(())
}

/// Calls the parent's provider once per message, as the mode allows.
#[derive(Debug, Clone)]
struct Notify {
    client: ProviderClient,
    mode: Mode,
}

impl EffectHandler<PgTx> for Notify {
    fn on_unknown(&self) -> OnUnknown {
        match self.mode {
            Mode::Keys | Mode::NeitherRetry => OnUnknown::Retry,
            Mode::Lookup | Mode::NeitherSkip => OnUnknown::Skip,
        }
    }

    async fn call(&self, effect: &Effect, message: &Message) -> Result<(), HandlerError> {
        let reply = match self
            .client
            .call(effect.idempotency_key(), effect.token(), &message.payload)
            .await
        {
            Ok(reply) => reply,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(not_applied(e))
            }
            Err(e) => return Err(HandlerError::transient(e)),
        };
        match reply.status {
            200 => Ok(()),
            status => Err(HandlerError::transient(format!(
                "provider answered {status}: {}",
                reply.body
            ))),
        }
    }

    async fn landed(&self, effect: &Effect, _message: &Message) -> Result<Landed, HandlerError> {
        if self.mode != Mode::Lookup {
            return Ok(Landed::Unknown);
        }
        Ok(match self.client.status(effect.idempotency_key()).await? {
            CallStatus::Applied => Landed::Yes,
            CallStatus::Pending => Landed::Pending,
            CallStatus::NotApplied => Landed::No,
        })
    }
}

/// Consumer A: forwards each event, unchanged, through the outbox, under a fresh ID (so a
/// forward applied twice would show as a duplicate credit at B).
#[derive(Debug, Clone)]
struct Forward {
    outbox: Outbox,
    destination: String,
    work: Duration,
}

impl Handler<PgTx> for Forward {
    async fn handle(
        &self,
        tx: &mut PgTx,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        self.outbox
            .write(tx, &self.destination, &message.payload)
            .await
            .map_err(HandlerError::transient)?;
        Ok(())
    }
}
