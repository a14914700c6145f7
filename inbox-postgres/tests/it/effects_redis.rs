//! A call that outlives its lease, with the effect consumer and `PgLeases` against a real
//! PostgreSQL, a real HTTP provider and a real Redis stream: with idempotency keys or a status
//! lookup the late call lands once; with neither, it is duplicated (retry) or the retry is
//! skipped (skip).

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common_effects;

use std::time::Duration;

use common_effects::*;
use inbox_conformance::provider::Behaviour;
use inbox_core::{Consumer, StatsSnapshot};
use inbox_core::{MessageId, Publish};
use inbox_redis_streams::redis::{self, Value};
use inbox_redis_streams::RedisConnection;
use inbox_testkit::fast_retry;

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

async fn redis_pending(conn: &mut redis::aio::MultiplexedConnection, stream: &str) -> i64 {
    let v: Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(CONSUMER)
        .query_async(conn)
        .await
        .unwrap();
    match v {
        Value::Array(parts) => match parts.first() {
            Some(Value::Int(n)) => *n,
            other => panic!("XPENDING {other:?}"),
        },
        other => panic!("XPENDING {other:?}"),
    }
}

struct RedisRun {
    effects: usize,
    calls: usize,
    settled: String,
    stats: [StatsSnapshot; 2],
}

/// Consumer `a` takes the message and calls a provider that takes three leases to apply; its
/// call is dropped when its lease ends, but the provider applies it anyway, late. Consumer `b`
/// (or `a` again) reclaims the entry with `XAUTOCLAIM` and takes the next lease.
async fn call_outliving_its_lease_on_redis(setup: Setup) -> RedisRun {
    let env = Env::new(setup.mode()).await;
    let stream = format!("inbox-test:effects:{}", uuid::Uuid::new_v4().simple());
    let producer = RedisConnection::new(redis_url())
        .producer()
        .connect()
        .await
        .unwrap();
    let evt = MessageId::generate();
    let evt_key = evt.idempotency_key(CONSUMER);
    env.provider.next_call(&evt_key, Behaviour::Slow(LEASE * 3));
    producer
        .send_with_id(&stream, &evt, b"notify")
        .await
        .unwrap();

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let start = |name: &'static str| {
        let (handler, leases, stream, mut stop) = (
            setup.handler(&env.provider),
            env.leases.clone(),
            stream.clone(),
            stop_rx.clone(),
        );
        tokio::spawn(async move {
            let source = RedisConnection::new(redis_url())
                .source(stream, CONSUMER)
                .consumer_name(name)
                .poll_timeout(Duration::from_millis(100))
                .claim_idle(Duration::from_millis(300))
                .claim_interval(Duration::from_millis(100))
                .connect()
                .await
                .unwrap();
            Consumer::effects(CONSUMER, source, leases, handler)
                .lease(LEASE)
                .retry(fast_retry(20))
                .run_until(async move {
                    let _ = stop.wait_for(|stop| *stop).await;
                })
                .await
        })
    };
    let a = start("a");
    assert!(env.provider.wait_for_calls(&evt_key, 1, PATIENCE).await);
    let b = start("b");

    let mut conn = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    patiently(async {
        loop {
            let done: Option<bool> = sqlx::query_scalar(
                "SELECT done_at IS NOT NULL FROM inbox_effects WHERE message_id = $1",
            )
            .bind(evt.as_str())
            .fetch_optional(&env.db.pool)
            .await
            .unwrap();
            if done == Some(true) && redis_pending(&mut conn, &stream).await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    stop_tx.send_replace(true);
    let stats = [a.await.unwrap().unwrap(), b.await.unwrap().unwrap()];
    assert!(
        env.provider.wait_settled(PATIENCE).await,
        "the late call has landed"
    );

    let sent = env.sent(evt.as_str()).await;
    assert_eq!(sent.len(), 1, "one done mark, one set of writes");
    let calls = env.provider.calls(&evt_key);
    assert!(calls.windows(2).all(|w| w[0].token < w[1].token));
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .arg(format!("{stream}:dlq"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let run = RedisRun {
        effects: env.provider.effects(&evt_key),
        calls: calls.len(),
        settled: sent[0].1.clone(),
        stats,
    };
    env.db.drop().await;
    run
}

#[tokio::test]
async fn a_call_outliving_its_lease_lands_once_with_keys_or_a_lookup_on_redis() {
    let keys = call_outliving_its_lease_on_redis(Setup::Keys).await;
    assert_eq!(
        keys.effects, 1,
        "the late call and the retry were one effect"
    );
    assert!(
        keys.calls >= 2,
        "retried with the same key while the first was still in progress"
    );
    assert_eq!(keys.settled, "called");

    let lookup = call_outliving_its_lease_on_redis(Setup::Lookup).await;
    assert_eq!(lookup.effects, 1);
    assert_eq!(
        lookup.calls, 1,
        "the lookup said pending, then applied: never called again"
    );
    assert_eq!(lookup.settled, "landed");
    let confirmed: u64 = lookup.stats.iter().map(|s| s.confirmed).sum();
    assert_eq!(confirmed, 1);
}

#[tokio::test]
async fn a_call_outliving_its_lease_without_keys_or_lookup_duplicates_or_is_skipped_on_redis() {
    let retry = call_outliving_its_lease_on_redis(Setup::BlindRetry).await;
    assert_eq!(
        retry.effects, 2,
        "retry: the late call and the retry both applied"
    );

    let skip = call_outliving_its_lease_on_redis(Setup::BlindSkip).await;
    assert_eq!(
        (skip.effects, skip.calls),
        (1, 1),
        "skip: not called again; the late call is the only effect (it could have been none)"
    );
    assert_eq!(skip.settled, "skipped");
    let skipped: u64 = skip.stats.iter().map(|s| s.skipped_unknown).sum();
    assert_eq!(skipped, 1);
}
