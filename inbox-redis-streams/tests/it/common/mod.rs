//! Helpers shared by the integration tests: a random stream per test, a raw connection to
//! look at what is left on the broker (the conformance suite's, `inbox_conformance::redis`).

#![allow(dead_code, unused_imports, unreachable_pub)]

pub use inbox_conformance::redis::{
    builder, builder_on, cleanup, dead_letters, lag, pending, pending_with, producer, raw,
    redis_url, stream_key, xadd_raw, GROUP,
};
use inbox_redis_streams::RedisStreamSource;

pub async fn source(stream: &str, consumer: &str) -> RedisStreamSource {
    builder(stream, consumer)
        .connect()
        .await
        .expect("source connects")
}
