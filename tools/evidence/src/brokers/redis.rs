//! Redis Streams: a consumer group `evidence`; a1/a2 read with `XREADGROUP … NOACK`.

use std::time::Duration;

use inbox_core::{async_trait, BoxError, MessageId, Publish, StatsSnapshot};
use inbox_redis_streams::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use inbox_redis_streams::redis::streams::StreamInfoGroupsReply;
use inbox_redis_streams::redis::{self, AsyncCommands};
use inbox_redis_streams::{AckMode, RedisStreamProducer, RedisStreamSource};
use inbox_testkit::TestDb;

use super::{Broker, Outgoing};
use crate::cli::{BrokerKind, ConsumerSpec};
use crate::consume::{self, Shutdown, Watch};

const GROUP: &str = "wallet";
const CLAIM_IDLE: Duration = Duration::from_secs(5);
/// In the zombie test a stalled entry is claimed away after this.
const ZOMBIE_CLAIM_IDLE: Duration = Duration::from_secs(3);

pub(crate) struct Redis {
    url: String,
    conn: ConnectionManager,
    producer: RedisStreamProducer,
}

impl Redis {
    pub(crate) async fn connect() -> Result<Self, BoxError> {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let unreachable = |e: redis::RedisError| {
            format!("cannot reach Redis at {url}: {e}; run `cargo xtask services` or set REDIS_URL")
        };
        let client = redis::Client::open(url.as_str()).map_err(unreachable)?;
        // No reply timeout (redis-rs's default is 500 ms): a publish on a machine busy with a
        // soak run waits for its reply rather than failing the run.
        let config = ConnectionManagerConfig::new().set_response_timeout(None);
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(unreachable)?;
        let producer = RedisStreamProducer::builder()
            .connection_manager(conn.clone())
            .connect()
            .await?;
        Ok(Self {
            url,
            conn,
            producer,
        })
    }
}

#[async_trait]
impl Broker for Redis {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Redis
    }

    async fn create(&self, _name: &str) -> Result<(), BoxError> {
        // The first XADD creates the stream, the first consumer the group (from the start).
        Ok(())
    }

    async fn publish(&self, name: &str, events: &[Outgoing]) -> Result<(), BoxError> {
        for event in events {
            let id = MessageId::new(event.id.clone())?;
            self.producer
                .send_with_id(name, &id, &event.payload)
                .await?;
        }
        Ok(())
    }

    async fn consume(
        &self,
        spec: &ConsumerSpec,
        db: &TestDb,
        watch: Watch,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError> {
        let claim_idle = if spec.zombie {
            ZOMBIE_CLAIM_IDLE
        } else {
            CLAIM_IDLE
        };
        // A stable name per member: a restarted consumer rereads its own pending entries.
        let mut builder = RedisStreamSource::builder(spec.name.clone(), GROUP)
            .consumer_name(format!("wallet-{}", spec.member))
            .poll_timeout(Duration::from_millis(500))
            .claim_idle(claim_idle)
            .claim_interval(Duration::from_secs(1));
        if spec.variant.auto_ack() {
            builder = builder.ack_mode(AckMode::NoAck);
        }
        let source = builder.url(&self.url).connect().await?;
        crate::ready();
        Ok(consume::run(source, spec, db, watch, shutdown).await?)
    }

    async fn left(&self, name: &str) -> Result<Option<u64>, BoxError> {
        let mut conn = self.conn.clone();
        let groups: Result<StreamInfoGroupsReply, _> = conn.xinfo_groups(name).await;
        let Some(group) = groups
            .ok()
            .and_then(|g| g.groups.into_iter().find(|g| g.name == GROUP))
        else {
            let len: u64 = conn.xlen(name).await?;
            return Ok(Some(len));
        };
        Ok(group.lag.map(|lag| (lag + group.pending) as u64))
    }

    fn redelivery_delay(&self) -> Duration {
        CLAIM_IDLE + Duration::from_secs(2)
    }

    async fn remove(&self, name: &str) {
        let mut conn = self.conn.clone();
        let _: Result<(), _> = conn.del(&[name.to_owned(), format!("{name}:dlq")]).await;
    }
}
