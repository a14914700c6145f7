//! The soak's network faults: fault proxies in the harness between the consumer children and
//! their database and broker, and the faults it rotates through.

use std::sync::Arc;
use std::time::Duration;

use inbox_conformance::database_url;
use inbox_conformance::{FaultProxy, ProxyMode};
use inbox_core::BoxError;

use crate::cli::{named, BrokerKind};

pub(crate) const DB_REFUSED_FOR: Duration = Duration::from_secs(5);
pub(crate) const BROKER_BLACKHOLED_FOR: Duration = Duration::from_secs(10);

named! {
    /// The injected faults, in the order they rotate.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Fault ("fault") {
        DbCut = "db_cut",
        DbRefused = "db_refused_5s",
        BrokerCut = "broker_cut",
        BrokerBlackholed = "broker_blackholed_10s",
    }
}

impl Fault {
    /// How long the fault lasts (a cut is instant).
    pub(crate) fn lasts(self) -> Duration {
        match self {
            Self::DbRefused => DB_REFUSED_FOR,
            Self::BrokerBlackholed => BROKER_BLACKHOLED_FOR,
            Self::DbCut | Self::BrokerCut => Duration::ZERO,
        }
    }
}

/// The proxies between the children and their database and broker.
pub(crate) struct Proxies {
    db: Arc<FaultProxy>,
    /// None on Kafka: its clients reach the advertised address after bootstrap, not the proxy.
    broker: Option<Arc<FaultProxy>>,
    /// What the children get in their environment.
    pub(crate) env: Vec<(&'static str, String)>,
}

impl Proxies {
    pub(crate) async fn start(kind: BrokerKind) -> Result<Self, BoxError> {
        let (db, db_url) = proxied("DATABASE_URL", &database_url(), 5432).await?;
        let mut env = vec![("DATABASE_URL", db_url)];
        let broker = match kind {
            BrokerKind::Redis | BrokerKind::Rabbitmq => {
                let (var, default, port) = if kind == BrokerKind::Redis {
                    ("REDIS_URL", "redis://127.0.0.1:6379", 6379)
                } else {
                    (
                        "AMQP_URL",
                        inbox_conformance::rabbitmq::LOCAL_AMQP_URL,
                        5672,
                    )
                };
                let url = std::env::var(var).unwrap_or_else(|_| default.to_owned());
                let (proxy, url) = proxied(var, &url, port).await?;
                env.push((var, url));
                Some(proxy)
            }
            BrokerKind::Kafka | BrokerKind::Sqs | BrokerKind::Nats => None,
        };
        Ok(Self { db, broker, env })
    }

    /// The faults this broker's run rotates through.
    pub(crate) fn faults(&self) -> Vec<Fault> {
        Fault::ALL
            .into_iter()
            .filter(|f| self.broker.is_some() || matches!(f, Fault::DbCut | Fault::DbRefused))
            .collect()
    }

    /// Injects `fault`; a lasting one is lifted by a task of its own, so that it ends on time
    /// even while the harness waits for a child to start.
    pub(crate) fn inject(&self, fault: Fault) {
        let proxy = match fault {
            Fault::DbCut | Fault::DbRefused => &self.db,
            Fault::BrokerCut | Fault::BrokerBlackholed => match &self.broker {
                Some(p) => p,
                None => return,
            },
        };
        let mode = match fault {
            Fault::DbCut | Fault::BrokerCut => return proxy.cut(),
            Fault::DbRefused => ProxyMode::Refuse,
            Fault::BrokerBlackholed => ProxyMode::Blackhole,
        };
        proxy.set_mode(mode);
        let proxy = Arc::clone(proxy);
        tokio::spawn(async move {
            tokio::time::sleep(fault.lasts()).await;
            // Restored for new connections; a black-holed one stays dead to its client, which
            // has to notice by itself.
            proxy.set_mode(ProxyMode::Pass);
        });
    }
}

/// A proxy in front of the server `url` (from `var`) names, and `url` pointed at the proxy.
async fn proxied(
    var: &str,
    url: &str,
    default_port: u16,
) -> Result<(Arc<FaultProxy>, String), BoxError> {
    let proxied = FaultProxy::in_front_of_url(url, default_port).await;
    let (proxy, through) = proxied.map_err(|e| format!("{var}={e}"))?;
    Ok((Arc::new(proxy), through))
}
