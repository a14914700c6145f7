//! The source and the producer on a Redis Cluster of the test's own (three masters, three
//! replicas, started by [`LocalCluster`]): a master killed mid-stream loses and duplicates
//! nothing, and a dead member's entries are claimed and a poison one dead-lettered after the
//! stream's slot changed hands (a failover to its replica, or a migration to another master).
//!
//! Needs the feature `cluster` and `redis-server` and `redis-cli` on the `PATH`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inbox_conformance::redis::{
    dead_letters_with, lag_with, pending_with, stream_key, LocalCluster, GROUP,
};
use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{Consumer, MessageId, MessageSource, Publish};
use inbox_redis_streams::{RedisConnection, RedisStreamProducer, RedisStreamSourceBuilder};

const CREDITS: i64 = 300;
/// The steady pace of the producer: 300 credits over about 9 s.
const PACE: Duration = Duration::from_millis(30);
/// The credit after which the master holding the stream is killed.
const KILL_AFTER: i64 = 100;

/// The cluster's nodes, each command bounded by 2 s.
fn connection(cluster: &LocalCluster) -> RedisConnection {
    RedisConnection::cluster(cluster.urls()).operation_timeout(Duration::from_secs(2))
}

fn source(cluster: &LocalCluster, stream: &str, member: &str) -> RedisStreamSourceBuilder {
    connection(cluster)
        .source(stream, GROUP)
        .consumer_name(member)
        .poll_timeout(Duration::from_millis(200))
        .claim_interval(Duration::from_millis(200))
        .claim_idle(Duration::from_millis(1500))
}

/// Confirmed by the master's replica: a write the master acked survives its death.
async fn producer(cluster: &LocalCluster) -> RedisStreamProducer {
    connection(cluster)
        .producer()
        .wait_for_replicas(1, Duration::from_secs(1))
        .connect()
        .await
        .expect("producer connects")
}

/// Sends the credits `range` at [`PACE`], each retried under its own ID until Redis confirms
/// it; returns their IDs and the failed attempts.
async fn produce(
    producer: &RedisStreamProducer,
    stream: &str,
    range: std::ops::Range<i64>,
) -> (Vec<MessageId>, u64) {
    let mut ids = Vec::new();
    let mut failures = 0;
    for i in range {
        let id = MessageId::generate();
        let event = CreditEvent::new(i % 5 + 1, i + 1);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match producer
                .send_with_id(stream, &id, event.to_json().as_slice())
                .await
            {
                Ok(()) => break,
                Err(e) => {
                    failures += 1;
                    assert!(Instant::now() < deadline, "credit {i} not sent: {e}");
                    if failures <= 5 {
                        println!("send of credit {i} failed (retrying under its ID): {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        ids.push(id);
        tokio::time::sleep(PACE).await;
    }
    (ids, failures)
}

fn epoch(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_stream_loses_and_duplicates_nothing() {
    let mut cluster = LocalCluster::start().await;
    let db = TestDb::new().await;
    // No hash tag: the dead-letter stream gets one that hashes to the stream's slot.
    let stream = stream_key("cluster-failover");
    let source = source(&cluster, &stream, "c1")
        .connect()
        .await
        .expect("source connects");
    assert_eq!(source.dead_letter_stream(), format!("{{{stream}}}:dlq"));
    let producer = producer(&cluster).await;

    let consumer = Consumer::new("wallet", source, db.inbox(), Credit::new(db.clone()))
        .batch_size(20)
        .error_backoff(Duration::from_millis(100));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let started = Instant::now();
    let (mut ids, mut failures) = produce(&producer, &stream, 0..KILL_AFTER).await;
    let old = cluster
        .master_of(&stream)
        .await
        .expect("a master serves the stream");
    cluster.kill(old);
    let killed = Instant::now();
    let killed_at = epoch(SystemTime::now());
    let recovery = async {
        let failover = cluster
            .wait_for_new_master(&stream, old, killed, Duration::from_secs(30))
            .await
            .expect("a replica took over within 30 s");
        // The new master has no replica to confirm writes until the killed node is back, as
        // its replica (what a supervisor restarting the process does).
        cluster.restart(old).await;
        (failover, killed.elapsed())
    };
    let (((new, failover), whole), (after, more_failures)) =
        tokio::join!(recovery, produce(&producer, &stream, KILL_AFTER..CREDITS),);
    failures += more_failures;
    let first_after = after[0].clone();
    ids.extend(after);
    assert_eq!(ids.len() as i64, CREDITS);

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut conn = cluster.master_conn(&stream).await;
    loop {
        let applied = wallet::applied(&db).await;
        if applied >= CREDITS
            && pending_with(&mut conn, &stream).await == 0
            && lag_with(&mut conn, &stream).await == 0
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stuck at {applied} of {CREDITS} applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    let stats = run
        .await
        .expect("join")
        .expect("the consumer ran to its stop");

    let summary = wallet::summary(&db).await.expect("summary");
    let pending = pending_with(&mut conn, &stream).await;
    let (first_applied, next_applied): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT extract(epoch FROM min(applied_at) FILTER (WHERE event_id = $1))::float8,
                extract(epoch FROM min(applied_at) FILTER (WHERE applied_at > to_timestamp($2)))::float8
         FROM ledger",
    )
    .bind(first_after.as_str())
    .bind(killed_at)
    .fetch_one(&db.pool)
    .await
    .expect("ledger");
    let secs = |t: Option<f64>| t.map_or(f64::NAN, |t| t - killed_at);
    println!(
        "cluster failover: killed master :{old} after {KILL_AFTER} of {CREDITS} credits; replica :{new} \
         took over after {failover:?}, the killed node was back as its replica after {whole:?}; \
         send attempts failed {failures}; first credit sent after \
         the kill applied {:.2} s after it (the next applied credit of any: {:.2} s); {summary:?}, \
         duplicates {}, lost {}; consumer received {} applied {} skipped {} errors {} ack \
         failures {}; pending {pending}; total {:?}",
        secs(first_applied),
        secs(next_applied),
        summary.duplicates(),
        summary.lost(CREDITS),
        stats.received,
        stats.applied,
        stats.skipped_duplicates,
        stats.errors,
        stats.ack_failures,
        started.elapsed(),
    );
    assert_eq!(summary.lost(CREDITS), 0, "lost credits");
    assert_eq!(summary.duplicates(), 0, "credits applied twice");
    assert!(summary.balances_exact);
    assert_eq!(summary.total_balance, CREDITS * (CREDITS + 1) / 2);
    assert_eq!(pending, 0);
    db.drop().await;
}

/// How the stream's slot changes hands while a dead member's entries are pending.
#[derive(Debug, Clone, Copy)]
enum Handover {
    /// Its replica takes over (`CLUSTER FAILOVER`).
    Failover,
    /// The slot moves to another master (`MIGRATE`), pending list and all.
    Migration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_members_entries_are_claimed_and_a_poison_one_dead_lettered_after_a_failover() {
    claim_after(Handover::Failover).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_members_entries_are_claimed_and_a_poison_one_dead_lettered_after_a_slot_migration()
{
    claim_after(Handover::Migration).await;
}

async fn claim_after(handover: Handover) {
    let cluster = LocalCluster::start().await;
    let db = TestDb::new().await;
    let stream = format!("{{{}}}", stream_key("cluster-claim"));
    let producer = producer(&cluster).await;
    for amount in 1..=5 {
        producer
            .send(&stream, CreditEvent::new(1, amount).to_json().as_slice())
            .await
            .expect("send");
    }
    producer
        .send(&stream, b"not a credit")
        .await
        .expect("send the poison");

    // A member reads all six and dies without acking.
    let mut dead = source(&cluster, &stream, "dead")
        .connect()
        .await
        .expect("source connects");
    assert_eq!(dead.dead_letter_stream(), format!("{stream}:dlq"));
    let mut held = 0;
    while held < 6 {
        held += dead.receive(10).await.expect("receive").len();
    }
    drop(dead);

    // Connected before the handover, as the producer: both learn of it from `MOVED`.
    let alive = source(&cluster, &stream, "alive")
        .claim_idle(Duration::from_millis(1000))
        .connect()
        .await
        .expect("source connects");

    // The slot changes hands with the entries and the pending list: to the master's replica, or
    // to another master.
    let old = cluster.master_of(&stream).await.expect("a master");
    let new = match handover {
        Handover::Failover => cluster.fail_over(&stream).await,
        Handover::Migration => cluster.migrate(&stream).await,
    };
    producer
        .send(&stream, CreditEvent::new(1, 6).to_json().as_slice())
        .await
        .expect("send after the handover");

    let consumer = Consumer::new("wallet", alive, db.inbox(), Credit::new(db.clone()))
        .error_backoff(Duration::from_millis(100));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    let mut conn = cluster.master_conn(&stream).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if wallet::applied(&db).await == 6
            && dead_letters_with(&mut conn, &stream).await.len() == 1
            && pending_with(&mut conn, &stream).await == 0
        {
            break;
        }
        assert!(Instant::now() < deadline, "not claimed in time");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    let stats = run
        .await
        .expect("join")
        .expect("the consumer ran to its stop");

    let letters = dead_letters_with(&mut conn, &stream).await;
    let field = |name: &str| {
        letters[0]
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    println!(
        "cluster claim after {handover:?}: the slot moved from :{old} to :{new}; the member `alive` received {} \
         applied {} dead-lettered {}; dead letter: payload {:?}, reason {:?}",
        stats.received,
        stats.applied,
        stats.dead_lettered,
        field("payload"),
        field("reason"),
    );
    assert_ne!(old, new);
    assert_eq!(field("payload"), "not a credit");
    assert!(field("reason").contains("JSON"), "{}", field("reason"));
    assert_eq!(field("original_source"), stream);
    assert_eq!(wallet::balance(&db, 1).await, 21);
    assert_eq!(stats.applied, 6);
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(lag_with(&mut conn, &stream).await, 0);
    db.drop().await;
}
