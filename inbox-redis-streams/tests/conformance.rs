//! The conformance suite (`inbox-conformance`) on a real Redis stream.

mod common;

use std::time::Duration;

use common::*;
use inbox_conformance::{async_trait, DeadLetter, TestBroker, TestQueue};
use inbox_redis_streams::RedisStreamSource;

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

    fn counts_deliveries(&self) -> bool {
        true // XPENDING's delivery counter
    }

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
        // A dead member's pending entries go to another after 1.5 s idle, through XAUTOCLAIM.
        builder(&self.0, member)
            .claim_idle(Duration::from_millis(1500))
            .connect()
            .await
            .expect("source connects")
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
