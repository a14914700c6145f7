//! Dead letters replayed once their cause is fixed: credits parked while a downstream is down,
//! replayed to their stream, then each applied once:
//! `cargo run -p inbox-examples --example replay` (`REDIS_URL`, `DATABASE_URL`).
//!
//! The same from the command line: `inbox-admin dead-letters replay --broker redis --from
//! <stream>:dlq --all`.

mod common; // the wallet table, the events and the check, shared by the examples

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{BoxError, Wallet};
use transactional_inbox::postgres::sqlx;
use transactional_inbox::postgres::PgTx;
use transactional_inbox::redis_streams::{
    RedisDeadLetters, RedisStreamProducer, RedisStreamSource,
};
use transactional_inbox::replay::{self, Selection};
use transactional_inbox::{Consumer, Handler, HandlerError, Message, MessageId, Publish};

/// Credits an account; fails while the downstream it needs is down.
#[derive(Clone)]
struct Credit {
    down: Arc<AtomicBool>,
}

impl Handler<PgTx> for Credit {
    async fn handle(&self, tx: &mut PgTx, _: &MessageId, m: &Message) -> Result<(), HandlerError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent("downstream down")); // dead-lettered at once
        }
        let (account, amount): (i64, i64) = m.json()?;
        sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
            .bind(amount)
            .bind(account)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let wallet = Wallet::open().await?;
    let stream = format!("inbox-example-{}", uuid::Uuid::new_v4());
    let producer = RedisStreamProducer::builder().connect().await?; // Redis at REDIS_URL
    let sends = wallet.sends();
    for (id, payload) in &sends {
        producer
            .send_with_id(&stream, id, payload.as_bytes())
            .await?;
    }

    // The downstream is down: every delivery is parked in `<stream>:dlq`.
    let credit = Credit {
        down: Arc::new(AtomicBool::new(true)),
    };
    let source = RedisStreamSource::builder(&stream, "example-credits")
        .connect()
        .await?;
    let consumer = Consumer::new(
        "example-credits",
        source,
        wallet.inbox.clone(),
        credit.clone(),
    );
    let seen = consumer.stats();
    let all_parked = async move {
        while seen.snapshot().dead_lettered < sends.len() as u64 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), consumer.run_until(all_parked)).await??;

    // Fixed: replay every dead letter to its stream, then consume again.
    credit.down.store(false, Ordering::SeqCst);
    let mut parked = RedisDeadLetters::builder(format!("{stream}:dlq"))
        .connect()
        .await?;
    let report = replay::replay(
        &mut parked,
        &producer,
        &Selection::all(),
        false,
        &mut |_| {},
    )
    .await?;
    println!(
        "moved {}: one copy of each of the {} IDs, the other letters of an ID removed",
        report.moved,
        report.moved - report.duplicates
    );

    let source = RedisStreamSource::builder(&stream, "example-credits")
        .connect()
        .await?;
    let consumer = Consumer::new("example-credits", source, wallet.inbox.clone(), credit);
    wallet
        .run_and_check_seeing(consumer, report.moved - report.duplicates)
        .await
}
