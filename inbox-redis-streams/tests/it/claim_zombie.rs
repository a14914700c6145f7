//! The claim zombie: consumer A's handler stalls past `claim_idle`, consumer B takes the entry
//! over with `XAUTOCLAIM` and applies it, then A finishes its write. With the inbox the event is
//! in the ledger once; without it (the article's variant b), twice.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use inbox_conformance::wallet::{self, Credit, CreditEvent, Summary};
use inbox_conformance::TestDb;
use inbox_core::Publish;
use inbox_core::{Consumer, InboxStore, MessageId, StatsSnapshot};
use inbox_postgres::PgTx;
use inbox_testkit::WithoutInbox;

const CLAIM_IDLE: Duration = Duration::from_millis(1000);
const STALL: Duration = Duration::from_millis(3000);
const NORMAL_EVENTS: i64 = 5;

struct Observed {
    summary: Summary,
    stalled_event_rows: i64,
    a: StatsSnapshot,
    b: StatsSnapshot,
    pending: i64,
}

async fn zombie<St>(db: &TestDb, store: St, label: &str) -> Observed
where
    St: InboxStore<Tx = PgTx> + Clone,
{
    let stream = stream_key(&format!("zombie-{label}"));
    let producer = producer().await;
    let stalled = MessageId::generate();
    let event = CreditEvent {
        account_id: 1,
        amount: 1000,
        stall: true,
    };
    producer
        .send_with_id(&stream, &stalled, event.to_json().as_slice())
        .await
        .expect("send");
    for i in 0..NORMAL_EVENTS {
        producer
            .send(&stream, CreditEvent::new(2, i + 1).to_json().as_slice())
            .await
            .expect("send");
    }

    let handler = Credit::new(db.clone()).stall(STALL);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = |name: &'static str| {
        let (store, handler, stream, mut stop) = (
            store.clone(),
            handler.clone(),
            stream.clone(),
            stop_rx.clone(),
        );
        tokio::spawn(async move {
            let source = builder(&stream, name)
                .claim_idle(CLAIM_IDLE)
                .connect()
                .await
                .expect("connect");
            Consumer::new("wallet", source, store, handler)
                .run_until(async move {
                    let _ = stop.wait_for(|stop| *stop).await;
                })
                .await
        })
    };

    // A takes the stalled event first (batch size 1) and sits in its handler.
    let a = run("a");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stalls: i64 = sqlx::query_scalar("SELECT count(*) FROM wallet_stalls")
            .fetch_one(&db.pool)
            .await
            .expect("wallet_stalls");
        if stalls > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "consumer a never started the stalled event"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // B starts now: it reads the other events, and claims the stalled one once idle.
    let b = run("b");

    let expected = NORMAL_EVENTS + 1;
    loop {
        let summary = wallet::summary(db).await.expect("summary");
        if summary.distinct_events >= expected
            && pending(&stream).await == 0
            && lag(&stream).await == 0
        {
            break;
        }
        assert!(Instant::now() < deadline, "not done in time: {summary:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Graceful stop: a consumer still inside its handler (the zombie) finishes that write first.
    stop_tx.send(true).expect("stop");
    let a = a.await.expect("join").expect("consumer a");
    let b = b.await.expect("join").expect("consumer b");

    let summary = wallet::summary(db).await.expect("summary");
    let stalled_event_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger WHERE event_id = $1")
            .bind(stalled.as_str())
            .fetch_one(&db.pool)
            .await
            .expect("ledger");
    let pending = pending(&stream).await;
    cleanup(&stream).await;
    Observed {
        summary,
        stalled_event_rows,
        a,
        b,
        pending,
    }
}

fn show(label: &str, o: &Observed) {
    println!(
        "claim zombie {label}: {:?}, duplicates {}, stalled event rows {}; a received {} applied {} skipped {}; b received {} applied {} skipped {}; pending {}",
        o.summary,
        o.summary.duplicates(),
        o.stalled_event_rows,
        o.a.received,
        o.a.applied,
        o.a.skipped_duplicates,
        o.b.received,
        o.b.applied,
        o.b.skipped_duplicates,
        o.pending
    );
}

#[tokio::test]
async fn claim_zombie_with_inbox_applies_once() {
    let db = TestDb::new().await;
    let o = zombie(&db, db.inbox(), "inbox").await;
    show("with inbox", &o);
    assert_eq!(o.stalled_event_rows, 1);
    assert_eq!(o.summary.duplicates(), 0);
    assert_eq!(o.summary.distinct_events, NORMAL_EVENTS + 1);
    assert!(o.summary.balances_exact);
    assert_eq!(wallet::balance(&db, 1).await, 1000);
    // Both consumers handled the stalled entry: the claim really happened, and one copy lost
    // the race for the inbox row.
    assert_eq!(o.a.received + o.b.received, NORMAL_EVENTS as u64 + 2);
    assert_eq!(o.a.skipped_duplicates + o.b.skipped_duplicates, 1);
    assert_eq!(o.pending, 0);
    db.drop().await;
}

#[tokio::test]
async fn claim_zombie_without_inbox_applies_twice() {
    let db = TestDb::new().await;
    let o = zombie(&db, WithoutInbox(db.inbox()), "without-inbox").await;
    show("without inbox", &o);
    assert_eq!(o.stalled_event_rows, 2, "the zombie wrote a second time");
    assert!(o.summary.duplicates() > 0);
    assert_eq!(wallet::balance(&db, 1).await, 2000, "credited twice");
    db.drop().await;
}
