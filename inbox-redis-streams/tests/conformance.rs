//! The conformance suite (`inbox-conformance`) on a real Redis stream.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use inbox_conformance::{async_trait, DeadLetter, LosingSource, Proxied, TestBroker, TestQueue};
use inbox_core::Publish;
use inbox_redis_streams::redis::{Client, ConnectionAddr, IntoConnectionInfo};
use inbox_redis_streams::RedisStreamSource;
use inbox_testkit::FaultProxy;

/// A member's pending entry goes to another after this long idle, through `XAUTOCLAIM`.
const CLAIM_IDLE: Duration = Duration::from_millis(1500);

struct Redis;

/// A stream of its own; its dead letters go to `<stream>:dlq`.
struct Stream(String);

#[async_trait]
impl TestBroker for Redis {
    type Queue = Stream;
    async fn queue(&self, scenario: &str) -> Stream {
        Stream(stream_key(scenario))
    }

    async fn attach(&self, name: &str) -> Stream {
        Stream(name.to_owned())
    }
}

#[async_trait]
impl TestQueue for Stream {
    type Source = RedisStreamSource;

    fn name(&self) -> String {
        self.0.clone()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        let payload = String::from_utf8_lossy(payload);
        match id {
            Some(id) => xadd_raw(&self.0, &[("event_id", id), ("payload", &payload)]).await,
            None => xadd_raw(&self.0, &[("payload", &payload)]).await,
        };
    }

    async fn source(&self, member: &str) -> RedisStreamSource {
        builder(&self.0, member)
            .claim_idle(CLAIM_IDLE)
            .connect()
            .await
            .expect("source connects")
    }

    async fn losing_source(&self, member: &str) -> Option<LosingSource<RedisStreamSource>> {
        // Any member loses an entry it holds for `CLAIM_IDLE` to the next sweep of another
        // (every 200 ms).
        Some(LosingSource {
            source: self.source(member).await,
            stall: CLAIM_IDLE * 3,
        })
    }

    async fn proxied_source(&self, member: &str) -> Option<Proxied<RedisStreamSource>> {
        let info = redis_url().into_connection_info().expect("REDIS_URL");
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return None; // a Unix socket or TLS: no TCP proxy can stand in front of it
        };
        let upstream: SocketAddr = tokio::net::lookup_host((host.as_str(), *port))
            .await
            .expect("resolve REDIS_URL")
            .next()?;
        let proxy = FaultProxy::start(upstream).await.expect("proxy");
        let proxied = info.clone().set_addr(ConnectionAddr::Tcp(
            proxy.addr().ip().to_string(),
            proxy.addr().port(),
        ));
        // A command on a silent connection is given up after 1 s (the blocking read gets its
        // block on top); what a lost read or a failed ack left pending is claimed after 2 s.
        let source = builder(&self.0, member)
            .claim_idle(Duration::from_secs(2))
            .operation_timeout(Duration::from_secs(1))
            .client(Client::open(proxied).expect("client"))
            .connect()
            .await
            .expect("source connects");
        Some(Proxied {
            source,
            proxy,
            blackhole: Duration::from_secs(4),
        })
    }

    async fn producer(&self) -> Arc<dyn Publish> {
        Arc::new(producer().await)
    }

    fn destination(&self) -> String {
        self.0.clone()
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        let field = |entry: &[(String, String)], name: &str| {
            entry
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        dead_letters(&self.0)
            .await
            .iter()
            .map(|entry| DeadLetter {
                payload: field(entry, "payload").into_bytes(),
                reason: field(entry, "reason"),
            })
            .collect()
    }

    async fn left(&self) -> u64 {
        // Delivered and not acked, and not delivered yet (a stream no consumer read has no
        // group: everything in it is left).
        let pending = pending(&self.0).await;
        let lag = lag(&self.0).await;
        u64::try_from(pending + lag).unwrap_or(0)
    }

    async fn cleanup(&self) {
        cleanup(&self.0).await;
    }
}

inbox_conformance::suite!(Redis);
