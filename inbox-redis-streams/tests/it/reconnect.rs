//! Redis drops every connection of the consumer (`CLIENT KILL`) mid-run: the source reconnects
//! and nothing is lost or applied twice.
//!
//! A test binary of its own, on its own database number (9 on the `REDIS_URL` server), so the
//! kill reaches only this test's connections.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use inbox_core::{Consumer, MessageId, Publish};
use inbox_redis_streams::redis::aio::ConnectionManager;
use inbox_redis_streams::redis::{self, Client, IntoConnectionInfo};
use inbox_redis_streams::{RedisConnection, RedisStreamProducer};
use inbox_testkit::{MemoryStore, Sum};

const DB: i64 = 9;

async fn wait_for(store: &MemoryStore<i64>, total: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.state().await != total {
        assert!(
            Instant::now() < deadline,
            "stuck at {} of {total}",
            store.state().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends with retries under one ID, as a producer should: a retry that did reach Redis twice
/// is still applied once.
async fn send(producer: &RedisStreamProducer, stream: &str, amount: i64) {
    let id = MessageId::generate();
    for attempt in 1..=10 {
        match producer
            .send_with_id(stream, &id, amount.to_string().as_bytes())
            .await
        {
            Ok(_) => return,
            Err(e) => {
                println!("send attempt {attempt} failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    panic!("could not send after 10 attempts");
}

#[tokio::test]
async fn the_source_reconnects_after_redis_drops_its_connections() {
    let info = redis_url()
        .into_connection_info()
        .expect("REDIS_URL parses");
    let db = info.redis_settings().clone().set_db(DB);
    let client = Client::open(info.set_redis_settings(db)).expect("client");
    let stream = stream_key("reconnect");
    let producer = RedisStreamProducer::builder()
        .connection_manager(
            ConnectionManager::new(client.clone())
                .await
                .expect("connect"),
        )
        .connect()
        .await
        .expect("producer");
    let source = builder_on(&RedisConnection::from_client(client.clone()), &stream, "c1")
        .connect()
        .await
        .expect("connect");
    let store = MemoryStore::<i64>::new();
    let consumer =
        Consumer::new("sum", source, store.clone(), Sum).error_backoff(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    for amount in [1, 2, 3] {
        send(&producer, &stream, amount).await;
    }
    wait_for(&store, 6).await;

    let mut admin = client
        .get_multiplexed_async_connection()
        .await
        .expect("admin");
    let me: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut admin)
        .await
        .expect("CLIENT ID");
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut admin)
        .await
        .expect("CLIENT LIST");
    let mut killed = 0;
    for line in list.lines() {
        let field = |name: &str| {
            line.split(' ')
                .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        };
        let (Some(id), Some(db)) = (field("id"), field("db")) else {
            continue;
        };
        if db == DB.to_string() && id != me.to_string() {
            let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query_async(&mut admin)
                .await;
            killed += 1;
        }
    }
    assert!(
        killed >= 3,
        "the source's two connections and the producer's: {killed}"
    );

    for amount in [10, 20, 30] {
        send(&producer, &stream, amount).await;
    }
    wait_for(&store, 66).await;
    let _ = stop.send(());
    let stats = run.await.expect("join").expect("run");
    let left = pending_with(&mut admin, &stream).await;
    println!(
        "reconnect: killed {killed} connections; total {} of 66; received {} applied {} skipped {}; recovered errors {}, ack failures {}; pending {left}",
        store.state().await,
        stats.received,
        stats.applied,
        stats.skipped_duplicates,
        stats.errors,
        stats.ack_failures
    );
    assert_eq!(stats.applied, 6);
    assert_eq!(left, 0);
    // The stream lives in database 9, which `cleanup` does not see.
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut admin)
        .await
        .expect("DEL");
}
