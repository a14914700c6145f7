//! The suite on Redis Streams (feature `redis`): [`Redis`] gives each scenario a stream of its
//! own, consumed by the group [`GROUP`] and dead-lettered to `<stream>:dlq`.
//!
//! Redis is found at `REDIS_URL` (default `redis://127.0.0.1:6379`).

mod cluster;
mod inspect;
mod tls_server;

pub use cluster::LocalCluster;
pub use inspect::{
    cleanup, dead_letters, dead_letters_with, lag, lag_with, pending, pending_with, raw, xadd_raw,
};
use inspect::{cleanup_with, raw_at, xadd_with};
pub use tls_server::TlsRedis;

use std::ffi::OsStr;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::FaultProxy;
use inbox_core::DynPublish;
use inbox_redis_streams::{
    RedisConnection, RedisStreamProducer, RedisStreamSource, RedisStreamSourceBuilder,
};

use crate::process::{free_port, Server};
use crate::tls::TestCa;
use crate::{LosingSource, Proxied, Restartable, TestBroker, TestQueue};

/// The consumer group of every source.
pub const GROUP: &str = "wallet";

/// `REDIS_URL`, or the local default.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A stream key no other test uses, with `test` in it.
pub fn stream_key(test: &str) -> String {
    crate::unique_name(&format!("inbox-test:{test}"))
}

/// The server at [`redis_url`].
pub fn connection() -> RedisConnection {
    RedisConnection::new(redis_url())
}

/// A source on [`connection`] of the group [`GROUP`] as `consumer`, with test-friendly timings:
/// 200 ms polls and claim sweeps.
pub fn builder(stream: &str, consumer: &str) -> RedisStreamSourceBuilder {
    builder_on(&connection(), stream, consumer)
}

/// [`builder`] on the server `redis` reaches.
pub fn builder_on(
    redis: &RedisConnection,
    stream: &str,
    consumer: &str,
) -> RedisStreamSourceBuilder {
    redis
        .source(stream, GROUP)
        .consumer_name(consumer)
        .poll_timeout(Duration::from_millis(200))
        .claim_interval(Duration::from_millis(200))
}

/// A producer on [`connection`] with the adapter's defaults.
pub async fn producer() -> RedisStreamProducer {
    connection()
        .producer()
        .connect()
        .await
        .expect("producer connects")
}

/// Redis Streams under test, with the suite's timings: an entry left pending by a member is
/// claimed by another after 1.5 s idle, sweeps and polls every 200 ms.
#[derive(Debug, Clone, Copy)]
pub struct Redis;

/// How long an entry stays pending with a member before another claims it.
const CLAIM_IDLE: Duration = Duration::from_millis(1500);
/// How often a source looks for entries to claim ([`builder`]'s).
const CLAIM_INTERVAL: Duration = Duration::from_millis(200);

/// A source on `redis` of `stream` as `member`, with the suite's timings.
fn source_builder(redis: &RedisConnection, stream: &str, member: &str) -> RedisStreamSourceBuilder {
    builder_on(redis, stream, member).claim_idle(CLAIM_IDLE)
}

/// The source of `builder`'s settings.
async fn connect(builder: RedisStreamSourceBuilder) -> RedisStreamSource {
    builder.connect().await.expect("source connects")
}

/// What a `redis-server` a scenario may restart runs with: every write is persisted to its
/// append-only file, so the stream and its group come back with it.
const PERSISTED: &[&str] = &["--appendonly", "yes", "--appendfsync", "always"];

/// A `redis-server` on loopback `port`, serving TLS only with `tls`'s server certificate (client
/// certificates not asked for) when given, with `args` on top of what every one shares: no RDB
/// snapshots, and its [`Server`] directory as its working directory (where an append-only file
/// or a cluster's `nodes.conf` goes) with its log, `redis.log`, in it. Returns once it listens.
/// `REDIS_SERVER` names the binary, default `redis-server` on the `PATH`.
///
/// # Panics
/// When `redis-server` cannot be started or does not listen within 10 s.
async fn start_server(port: u16, tls: Option<&TestCa>, args: &'static [&'static str]) -> Server {
    let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
    let with_tls = if tls.is_some() { " with TLS" } else { "" };
    let what = format!(
        "{binary}{with_tls} (run `cargo xtask services` to install it, or set REDIS_SERVER)"
    );
    let tls = tls.cloned();
    Server::start(port, "inbox-redis", &what, move |port, dir| {
        let port = port.to_string();
        let mut command = Command::new(&binary);
        match &tls {
            Some(ca) => command
                .args(["--port", "0", "--tls-port", &port])
                .arg("--tls-cert-file")
                .arg(&ca.cert)
                .arg("--tls-key-file")
                .arg(&ca.key)
                .arg("--tls-ca-cert-file")
                .arg(&ca.ca)
                .args(["--tls-auth-clients", "no"]),
            None => command.args(["--port", &port]),
        };
        command
            .args(["--bind", "127.0.0.1", "--save", ""])
            .args(args)
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"));
        command
    })
    .await
}

/// What `redis-cli` with `args` printed, and how it exited. `REDIS_CLI` names the binary,
/// default `redis-cli` on the `PATH`.
///
/// # Panics
/// When `redis-cli` cannot be run.
async fn redis_cli(args: impl IntoIterator<Item = impl AsRef<OsStr>>) -> Output {
    let cli = std::env::var("REDIS_CLI").unwrap_or_else(|_| "redis-cli".into());
    tokio::process::Command::new(&cli)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {cli}: {e}; install Redis or set REDIS_CLI"))
}

/// A stream of its own; its dead letters go to `<stream>:dlq`.
#[derive(Debug)]
pub struct Stream {
    key: String,
    /// The server: `REDIS_URL`, or a private one's.
    url: String,
}

impl Stream {
    /// The server this stream is on: the source's, the producer's and the reader's.
    fn redis(&self) -> RedisConnection {
        RedisConnection::new(&self.url)
    }
}

impl TestBroker for Redis {
    type Queue = Stream;

    async fn queue(&self, scenario: &str) -> Stream {
        self.attach(&stream_key(scenario)).await
    }

    async fn attach(&self, name: &str) -> Stream {
        Stream {
            key: name.to_owned(),
            url: redis_url(),
        }
    }
}

impl TestQueue for Stream {
    type Source = RedisStreamSource;

    fn name(&self) -> String {
        self.key.clone()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        let payload = String::from_utf8_lossy(payload);
        let conn = &mut raw_at(&self.url).await;
        match id {
            Some(id) => {
                xadd_with(conn, &self.key, &[("event_id", id), ("payload", &payload)]).await
            }
            None => xadd_with(conn, &self.key, &[("payload", &payload)]).await,
        };
    }

    async fn source(&self, member: &str) -> RedisStreamSource {
        connect(source_builder(&self.redis(), &self.key, member)).await
    }

    async fn losing_source(&self, member: &str) -> Option<LosingSource<RedisStreamSource>> {
        // Any member loses an entry it holds for the claim idle to the next sweep of another.
        Some(LosingSource {
            source: self.source(member).await,
            stall: CLAIM_IDLE * 3,
        })
    }

    async fn proxied_source(&self, member: &str) -> Option<Proxied<RedisStreamSource>> {
        let url = redis_url();
        if !url.starts_with("redis://") {
            return None; // a Unix socket or TLS: no TCP proxy can stand in front of it
        }
        let (proxy, through) = FaultProxy::in_front_of_url(&url, 6379)
            .await
            .expect("proxy");
        // A command on a silent connection is given up after 1 s (the blocking read gets its
        // block on top); what a lost read or a failed ack left pending is claimed after 2 s.
        let redis = RedisConnection::new(through).operation_timeout(Duration::from_secs(1));
        let source = source_builder(&redis, &self.key, member).claim_idle(Duration::from_secs(2));
        Some(Proxied {
            source: connect(source).await,
            proxy,
            blackhole: Duration::from_secs(4),
            counts_faults: true,
        })
    }

    async fn restartable(&self) -> Result<Restartable<Stream>, String> {
        let server = start_server(free_port(), None, PERSISTED).await;
        Ok(Restartable {
            queue: Stream {
                key: self.key.clone(),
                url: format!("redis://127.0.0.1:{}", server.port()),
            },
            server: Box::new(server),
        })
    }

    fn redelivery_delay(&self) -> Duration {
        CLAIM_IDLE + CLAIM_INTERVAL + Duration::from_secs(1)
    }

    async fn producer(&self) -> Arc<dyn DynPublish> {
        let producer = self.redis().producer().connect().await;
        Arc::new(producer.expect("producer connects"))
    }

    async fn left(&self) -> u64 {
        // Delivered and not acked, and not delivered yet (a stream no consumer read has no
        // group: everything in it is left).
        let conn = &mut raw_at(&self.url).await;
        let pending = pending_with(conn, &self.key).await;
        let lag = lag_with(conn, &self.key).await;
        u64::try_from(pending + lag).unwrap_or(0)
    }

    async fn dead_letter_reader(&self) -> Option<Box<dyn inbox_core::replay::DynDeadLetters>> {
        let reader = self.redis().dead_letters(format!("{}:dlq", self.key));
        crate::connected_reader(reader.connect().await)
    }

    async fn cleanup(&self) {
        cleanup_with(&mut raw_at(&self.url).await, &self.key).await;
    }

    fn python_target(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({"broker": "redis", "url": self.url, "stream": self.key}))
    }

    async fn source_reading(
        &self,
        member: &str,
        from: inbox_core::IdFrom,
    ) -> Option<RedisStreamSource> {
        let builder = source_builder(&self.redis(), &self.key, member).id_from(from);
        Some(connect(builder).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_redis_streams::redis;

    /// A check's write that the server answers late is waited for (see [`raw_at`]).
    #[tokio::test]
    async fn a_late_answer_is_waited_for() {
        let server = start_server(free_port(), None, PERSISTED).await;
        let url = format!("redis://127.0.0.1:{}", server.port());
        let mut pauser = raw_at(&url).await;
        redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(1000)
            .arg("WRITE")
            .query_async::<()>(&mut pauser)
            .await
            .expect("CLIENT PAUSE");
        let id = xadd_with(&mut raw_at(&url).await, "late", &[("k", "v")]).await;
        assert!(!id.is_empty());
    }
}
