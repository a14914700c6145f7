//! The broker closes a consumer's connection: acks fail, the source reconnects, the message comes
//! back (to another consumer), and the inbox keeps the side effect single.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use inbox_conformance::wallet::{self, Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{
    Ack, Consumer, InboxStore, MessageId, MessageSource, Publish, Recovery, Stage, StageHook, Stats,
};
use inbox_postgres::PgTx;
use inbox_testkit::WithoutInbox;
use tokio::sync::{mpsc, watch};

#[tokio::test]
async fn an_ack_on_a_closed_connection_fails_and_receive_reconnects() {
    let config = fresh_config("reconnect");
    let publisher = publisher(&config).await;
    let id = publisher.send(config.queue(), b"hello").await.unwrap();

    let mut source = config.clone().connect().await.unwrap();
    let first = source.receive(1).await.unwrap().pop().expect("a delivery");
    assert_eq!(first.message.id.as_ref().ok(), Some(&id));
    assert_eq!(
        (
            first.message.meta.redelivered,
            first.message.meta.delivery_count
        ),
        (false, Some(1))
    );

    close_connection(&config.effective_connection_name()).await;
    // lapin notices the close asynchronously.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = first.ack.ack().await.expect_err("the channel is gone");
    println!("ack after close: {err}");
    assert_eq!(err.recovery(), Recovery::Reconnect);

    let mut again = Vec::new();
    for _ in 0..20 {
        match source.receive(1).await {
            Ok(batch) if !batch.is_empty() => {
                again = batch;
                break;
            }
            Ok(_) => {}
            Err(e) => {
                println!("receive: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let second = again
        .pop()
        .expect("the message comes back after reconnecting");
    println!("redelivered: {:?}", second.message.meta);
    assert_eq!(second.message.id.as_ref().ok(), Some(&id));
    assert!(second.message.meta.redelivered);
    assert_eq!(second.message.meta.delivery_count, Some(2));
    second.ack.ack().await.unwrap();
    source.close().await;
    assert_eq!(left_on(config.queue()).await, 0);
    cleanup(&config).await;
}

/// What one zombie run observed.
#[derive(Debug)]
struct ZombieRun {
    ledger_rows: i64,
    distinct_events: i64,
    stall_rows: i64,
    /// Which consumer had its connection closed.
    zombie: String,
    zombie_ack_failures: u64,
    other_received_copy: bool,
    balances_exact: bool,
}

const EVENTS: i64 = 12;
/// How long the zombie's handler sleeps mid-write, on its first handling of the stalling event.
/// Long enough for the close to land and for the client to notice it before the write ends: on
/// a machine loaded with other work, `rabbitmqctl close_connection` once took 7 s to return.
const STALL: Duration = Duration::from_secs(15);

async fn zombie_run<St>(label: &str, db: &TestDb, store: St) -> ZombieRun
where
    St: InboxStore<Tx = PgTx> + Clone,
{
    let config = fresh_config(label).prefetch(1);
    let publisher = publisher(&config).await;
    let mut stall_id = None;
    for i in 0..EVENTS {
        let event = CreditEvent {
            account_id: 1 + i % 3,
            amount: 10 + i,
            stall: i == 0,
        };
        let id = publisher
            .send(config.queue(), &event.to_json())
            .await
            .unwrap();
        stall_id.get_or_insert(id);
    }
    let stall_id: MessageId = stall_id.unwrap();

    // Whoever claims the stalling event first reports it; every delivery is counted.
    let (claimed_tx, mut claimed_rx) = mpsc::unbounded_channel::<&'static str>();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut stats: Vec<(&'static str, Vec<String>, Arc<Stats>)> = Vec::new();
    for name in ["a", "b"] {
        let conn_name = format!("{} {name}", config.effective_connection_name());
        let source = (config.clone().connection_name(conn_name.clone()))
            .connect()
            .await
            .unwrap();
        let tx = claimed_tx.clone();
        let watched = stall_id.clone();
        let hook = StageHook::new(move |stage, id| {
            if stage == Stage::Claimed && *id == watched {
                let _ = tx.send(name);
            }
        });
        let handler = Credit::new(db.clone()).stall(STALL);
        let consumer = Consumer::new("wallet", source, store.clone(), handler)
            .on_stage(hook)
            .error_backoff(Duration::from_millis(200));
        // Look the connection up now: rabbitmqctl is slow to start, and the close must land
        // while the handler sleeps.
        let pids = connection_pids(&conn_name).await;
        stats.push((name, pids, consumer.stats()));
        let mut stop = stop_rx.clone();
        tasks.push(tokio::spawn(consumer.run_until(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }

    let zombie = tokio::time::timeout(Duration::from_secs(20), claimed_rx.recv())
        .await
        .expect("someone claims the stalling event")
        .expect("claim report");
    let claimed_at = tokio::time::Instant::now();
    let zombie_pids = &stats.iter().find(|(n, ..)| *n == zombie).expect("zombie").1;
    // The handler is asleep inside its transaction: cut the zombie's connection.
    close_pids(zombie_pids).await;
    let closed_after = claimed_at.elapsed();
    println!("{label}: closed {zombie}'s connection {closed_after:?} into its {STALL:?} stall");
    assert!(
        closed_after < STALL,
        "the close came too late to test anything"
    );

    // Every event applied, and the copy of the stalling event handled (skipped or re-applied).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        let handled: u64 = stats
            .iter()
            .map(|(.., s)| {
                let s = s.snapshot();
                s.applied + s.skipped_duplicates
            })
            .sum();
        if handled > EVENTS as u64 || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(true);
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let summary = wallet::summary(db).await.unwrap();
    let stall_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE event_id = $1")
        .bind(stall_id.as_str())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let snap = |n: &str| {
        stats
            .iter()
            .find(|(x, ..)| *x == n)
            .map(|(.., s)| s.snapshot())
    };
    let zombie_stats = snap(zombie).expect("zombie stats");
    let other = snap(if zombie == "a" { "b" } else { "a" }).expect("other stats");
    println!("{label}: zombie {zombie} {zombie_stats:?}\n{label}: other {other:?}");
    assert_eq!(
        left_on(config.queue()).await,
        0,
        "nothing left on the queue"
    );
    cleanup(&config).await;
    ZombieRun {
        ledger_rows: summary.ledger_rows,
        distinct_events: summary.distinct_events,
        stall_rows,
        zombie: zombie.to_owned(),
        zombie_ack_failures: zombie_stats.ack_failures,
        // The other consumer saw the stalling event's copy: it skipped it, or (without the
        // inbox) applied it a second time.
        other_received_copy: other.skipped_duplicates + other.applied > 0,
        balances_exact: summary.balances_exact,
    }
}

#[tokio::test]
async fn a_zombie_whose_connection_is_closed_mid_write_does_not_double_apply() {
    let db = TestDb::new().await;
    let run = zombie_run("zombie-inbox", &db, db.inbox()).await;
    println!("with the inbox (zombie {}): {run:?}", run.zombie);
    assert_eq!(run.ledger_rows, EVENTS, "one ledger row per event");
    assert_eq!(run.distinct_events, EVENTS);
    assert_eq!(run.stall_rows, 1);
    assert!(
        run.zombie_ack_failures >= 1,
        "the zombie's ack after commit failed"
    );
    assert!(run.other_received_copy);
    assert!(run.balances_exact);
    db.drop().await;

    let db = TestDb::new().await;
    let run = zombie_run("zombie-without", &db, WithoutInbox(db.inbox())).await;
    println!("without the inbox: {run:?}");
    assert_eq!(run.distinct_events, EVENTS, "nothing lost either way");
    assert!(
        run.ledger_rows > EVENTS,
        "without the inbox the redelivered copy is applied again"
    );
    assert_eq!(run.stall_rows, 2);
    db.drop().await;
}
