//! Strict order on an SQS FIFO queue: a message that fails blocks its message group until it is
//! applied, while the other group goes on; by default the rest of its batch overtakes it.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{client, counts, credit};
use inbox_conformance::wallet::{Credit, CreditEvent};
use inbox_conformance::TestDb;
use inbox_core::{
    Consumer, Handler, HandlerError, Message, MessageId, Order, Publish, RetryPolicy, Stage,
    StageHook,
};
use inbox_postgres::PgTx;
use inbox_sqs::SqsConnection;

/// The wallet's credit; account 1's credit of 3 fails twice. Records each group's amounts in
/// the order committed.
#[derive(Clone, Default)]
struct Ordered {
    credit: Option<Arc<Credit>>,
    tries: Arc<Mutex<u32>>,
    places: Arc<Mutex<HashMap<String, (String, i64)>>>,
    applied: Arc<Mutex<BTreeMap<String, Vec<i64>>>>,
}

impl Handler<PgTx> for Ordered {
    async fn handle(
        &self,
        tx: &mut PgTx,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let event: CreditEvent = message.json()?;
        if (event.account_id, event.amount) == (1, 3) {
            let mut tries = self.tries.lock().unwrap();
            *tries += 1;
            if *tries <= 2 {
                return Err(HandlerError::transient("the credit of 3 is not ready"));
            }
        }
        let group = message.meta.lane.clone().unwrap();
        self.places
            .lock()
            .unwrap()
            .insert(id.to_string(), (group, event.amount));
        self.credit.as_ref().unwrap().handle(tx, id, message).await
    }
}

impl Ordered {
    fn hook(&self) -> StageHook {
        let (places, applied) = (Arc::clone(&self.places), Arc::clone(&self.applied));
        StageHook::new(move |stage, id| {
            if stage == Stage::Committed {
                let (group, amount) = places.lock().unwrap()[id.as_str()].clone();
                applied
                    .lock()
                    .unwrap()
                    .entry(group)
                    .or_default()
                    .push(amount);
            }
        })
    }
}

/// Credits 1 to 5 in groups `account-1` and `account-2`, consumed in batches of 10.
async fn run(order: Order) -> BTreeMap<String, Vec<i64>> {
    let sqs = client().await;
    let url = common::fifo_queue(&sqs, "strict", 30).await;
    let db = TestDb::new().await;
    for account in [1, 2] {
        let sender = SqsConnection::new(sqs.clone())
            .producer()
            .message_group_id(format!("account-{account}"))
            .connect()
            .await
            .unwrap();
        for amount in 1..=5 {
            sender
                .send(&url, credit(account, amount).as_bytes())
                .await
                .unwrap();
        }
    }
    let source = SqsConnection::new(sqs.clone())
        .source(&url)
        .poll_timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let handler = Ordered {
        credit: Some(Arc::new(Credit::new(db.clone()))),
        ..Ordered::default()
    };
    let stats = Consumer::new("wallet", source, db.inbox(), handler.clone())
        .batch_size(10)
        .parallel_lanes(2)
        .order(order)
        .on_stage(handler.hook())
        .retry(
            RetryPolicy::default()
                .max_attempts(3)
                .backoff(Duration::from_millis(50), Duration::from_millis(100)),
        )
        .run_until_idle()
        .await
        .unwrap();
    println!("{order:?}: {stats:?}");
    assert_eq!(stats.dead_lettered, 0);
    assert_eq!(counts(&sqs, &url).await, (0, 0));
    common::delete_queue(&sqs, &url).await;
    db.drop().await;
    let applied = handler.applied.lock().unwrap().clone();
    applied
}

#[tokio::test]
async fn strict_order_holds_a_message_group_behind_its_failing_message() {
    let applied = run(Order::Strict).await;
    assert_eq!(applied["account-1"], [1, 2, 3, 4, 5]);
    assert_eq!(applied["account-2"], [1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn by_default_the_rest_of_the_batch_overtakes_a_failing_message() {
    let applied = run(Order::FailuresLast).await;
    assert_eq!(applied["account-1"], [1, 2, 4, 5, 3]);
    assert_eq!(applied["account-2"], [1, 2, 3, 4, 5]);
}
