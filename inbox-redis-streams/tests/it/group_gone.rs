//! A consumer group (or its whole stream) deleted while the consumer runs: the source must stop
//! with an error naming the stream, the group and the fix, never re-create the group at `0`
//! and reread the whole stream behind the operator's back.

use crate::common;

use std::time::Duration;

use common::*;
use inbox_core::Publish;
use inbox_core::{Ack, Consumer, MessageSource, Recovery};
use inbox_redis_streams::redis::{self, Value};
use inbox_testkit::{MemoryStore, Sum};

/// The groups of `stream`, as `XINFO GROUPS` lists them (none if the key is gone).
async fn groups(stream: &str) -> usize {
    let v: redis::RedisResult<Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(&mut raw().await)
        .await;
    match v {
        Ok(Value::Array(groups)) => groups.len(),
        Ok(other) => panic!("XINFO GROUPS: {other:?}"),
        Err(e) if e.code() == Some("ERR") => 0, // no such key
        Err(e) => panic!("XINFO GROUPS: {e}"),
    }
}

async fn exists(key: &str) -> bool {
    let n: i64 = redis::cmd("EXISTS")
        .arg(key)
        .query_async(&mut raw().await)
        .await
        .expect("EXISTS");
    n == 1
}

#[tokio::test]
async fn a_deleted_group_is_a_fatal_error_not_a_silent_reread() {
    let stream = stream_key("group-gone");
    let producer = producer().await;
    let mut src = source(&stream, "c1").await;
    for amount in [10, 20] {
        producer
            .send(&stream, amount.to_string().as_bytes())
            .await
            .expect("send");
    }
    let batch = src.receive(10).await.expect("receive");
    assert_eq!(batch.len(), 2);
    for d in batch {
        d.ack.ack().await.expect("ack");
    }

    let _: i64 = redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(&stream)
        .arg(GROUP)
        .query_async(&mut raw().await)
        .await
        .expect("XGROUP DESTROY");
    producer.send(&stream, b"5").await.expect("send");

    let e = src.receive(10).await.expect_err("the group is gone");
    let text = format!(
        "{e} / {:?}",
        std::error::Error::source(&e).map(|s| s.to_string())
    );
    println!("after XGROUP DESTROY: recovery {:?}, {text}", e.recovery());
    assert_eq!(e.recovery(), Recovery::Fatal);
    assert!(text.contains(&stream) && text.contains(GROUP), "{text}");
    assert!(text.contains("XGROUP CREATE"), "names the fix: {text}");

    // Asked again (a caller that ignores the verdict), it still does not re-create the group.
    let again = src.receive(10).await.expect_err("still gone");
    assert_eq!(again.recovery(), Recovery::Fatal);
    assert_eq!(groups(&stream).await, 0, "the group was not re-created");
    cleanup(&stream).await;
}

#[tokio::test]
async fn a_deleted_stream_stops_the_consumer_and_is_not_re_created() {
    let stream = stream_key("stream-gone");
    let producer = producer().await;
    for amount in [10, 20, 30] {
        producer
            .send(&stream, amount.to_string().as_bytes())
            .await
            .expect("send");
    }
    let store = MemoryStore::<i64>::new();
    Consumer::new("sum", source(&stream, "c1").await, store.clone(), Sum)
        .run_until_idle()
        .await
        .expect("run");
    assert_eq!(store.state().await, 60);

    let src = source(&stream, "c1").await;
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut raw().await)
        .await
        .expect("DEL");
    let run = Consumer::new("sum", src, store.clone(), Sum)
        .error_backoff(Duration::from_millis(50))
        .run_until_idle();
    let outcome = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the consumer stops on its own");
    println!("after DEL of the stream: {outcome:?}");
    assert!(outcome.is_err(), "the consumer reports the missing group");
    assert!(!exists(&stream).await, "the stream was not re-created");
    assert_eq!(store.state().await, 60);
    cleanup(&stream).await;
}
