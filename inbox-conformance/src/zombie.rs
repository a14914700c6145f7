//! Ownership loss: a consumer's handler stalls on a message long enough for the broker to hand
//! the message to another member; the stalled consumer (the "zombie") then resumes, commits and
//! acks. With the inbox the side effect is applied once and nothing is lost.
//!
//! The scenario is written once, in [`run`]: the suite asserts on its [`ZombieReport`], and
//! `evidence zombie-test` runs it over variants and runs and writes its table.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use inbox_core::{
    Consumer, Delivery, Handler, HandlerError, InboxStore, Message, MessageId, MessageSource,
    SourceError,
};
use tokio::sync::{mpsc, watch};

use crate::checked::Checked;
use crate::scenarios::{finish, left, setup};
use crate::wallet::{self, Credit, CreditEvent};
use crate::{LosingSource, StoreTx, TestBroker, TestQueue, TestStore};

/// What a zombie run does.
#[derive(Debug, Clone, Copy)]
pub struct ZombiePlan {
    /// Credit events published.
    pub events: u32,
    /// One event in this many stalls on its first handling.
    pub stall_every: u32,
    /// Consumer-group members, each a [`TestQueue::losing_source`].
    pub members: usize,
    /// Each handler's work per message.
    pub work: Duration,
}

/// What a zombie run counted.
#[derive(Debug, Clone, Copy, Default)]
pub struct ZombieReport {
    /// Events whose first handling stalled.
    pub stalls: i64,
    /// Deliveries of a stalling event after its first: the broker handed it to another member.
    pub handed_over: u64,
    /// Stalled messages handled again by another member, or skipped there by the inbox.
    pub ownership_losses: u64,
    /// Ledger rows beyond one per event.
    pub duplicates: i64,
    /// Copies the inbox skipped.
    pub skipped_duplicates: u64,
    /// Events never applied.
    pub lost: i64,
    /// Balances match the ledger and the events published.
    pub balances_exact: bool,
    /// Messages left on the broker at the end.
    pub left: u64,
}

/// What the members' handlers and sources tell the run.
#[derive(Debug)]
struct Watch {
    /// The member whose handler just began to stall.
    stalled: mpsc::UnboundedSender<usize>,
    /// Handlers asleep in a stall now.
    stalling: AtomicU64,
    second_handlings: AtomicU64,
    /// Deliveries of each stalling event.
    delivered: Mutex<HashMap<MessageId, u64>>,
}

impl Watch {
    fn handed_over(&self) -> u64 {
        let delivered = self.delivered.lock().expect("deliveries");
        delivered.values().map(|n| n.saturating_sub(1)).sum()
    }
}

/// The credit, stalling an event flagged `stall` on its first handling by any member (noted in
/// `wallet_stalls` outside the transaction) and then still writing.
struct Stalling<D> {
    credit: Credit<D>,
    db: D,
    stall: Duration,
    member: usize,
    watch: Arc<Watch>,
}

impl<D: TestStore> Handler<StoreTx<D>> for Stalling<D> {
    async fn handle(
        &self,
        tx: &mut StoreTx<D>,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        if message.json::<CreditEvent>()?.stall {
            if self.db.first_handling(id).await? {
                self.watch.stalling.fetch_add(1, Ordering::SeqCst);
                let _ = self.watch.stalled.send(self.member);
                tokio::time::sleep(self.stall).await;
                self.watch.stalling.fetch_sub(1, Ordering::SeqCst);
            } else {
                self.watch.second_handlings.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.credit.handle(tx, id, message).await
    }
}

/// A source that counts the deliveries of stalling events.
struct Noting<S> {
    inner: S,
    watch: Arc<Watch>,
}

impl<S: MessageSource> MessageSource for Noting<S> {
    type Ack = S::Ack;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<S::Ack>>, SourceError> {
        let batch = self.inner.receive(max).await?;
        let mut delivered = self.watch.delivered.lock().expect("deliveries");
        for d in &batch {
            if let (Ok(id), Ok(CreditEvent { stall: true, .. })) =
                (&d.message.id, d.message.json::<CreditEvent>())
            {
                *delivered.entry(id.clone()).or_default() += 1;
            }
        }
        Ok(batch)
    }

    inbox_testkit::forward_source!(inner: redelivery_window, system, consumer_group, capabilities);
}

/// Publishes `plan.events` credits to `queue`, one in `plan.stall_every` stalling, and runs
/// `plan.members` members of losing sources with `store` (the inbox, or a store without one)
/// until every event is applied, every stall is over and handed over and the broker holds
/// nothing more, or nothing changed for 120 s; `tick` is told the events applied and the stalls
/// so far. `None` where the broker cannot take a message away from a stalled consumer.
pub async fn run<Q, D, St>(
    queue: &Q,
    db: &D,
    store: St,
    plan: &ZombiePlan,
    tick: impl Fn(i64, i64) + Send + Sync,
) -> Option<ZombieReport>
where
    Q: TestQueue,
    D: TestStore,
    St: InboxStore<Tx = <D::Inbox as InboxStore>::Tx> + Clone + 'static,
{
    let member = |i: usize| format!("wallet-{i}");
    let mut sources = Vec::new();
    for i in 0..plan.members {
        sources.push(queue.losing_source(&member(i)).await?);
    }
    let stall = sources[0].stall;
    let mut expected_total = 0;
    // One send at a time: each record its own batch, so that a member resuming from a commit
    // inside what would be a producer batch misses nothing on Tansu (see
    // `Kafka::one_record_per_batch`).
    for i in 0..plan.events {
        let event = CreditEvent {
            stall: i % plan.stall_every == plan.stall_every / 2,
            ..CreditEvent::new(1 + i64::from(i % 100), 1 + i64::from(i % 37))
        };
        expected_total += event.amount;
        queue
            .send(Some(MessageId::generate().as_str()), &event.to_json())
            .await;
    }

    let (stalled, mut stalled_rx) = mpsc::unbounded_channel();
    let watch = Arc::new(Watch {
        stalled,
        stalling: AtomicU64::new(0),
        second_handlings: AtomicU64::new(0),
        delivered: Mutex::new(HashMap::new()),
    });
    let (stop, stopping) = watch::channel(false);
    let consumers = join_all(sources.into_iter().enumerate().map(
        |(i, LosingSource { source, .. })| {
            let handler = Stalling {
                credit: db.credit().work(plan.work),
                db: db.clone(),
                stall,
                member: i,
                watch: Arc::clone(&watch),
            };
            let source = Noting {
                inner: Checked::new(source),
                watch: Arc::clone(&watch),
            };
            let mut stopping = stopping.clone();
            Consumer::new("wallet", source, store.clone(), handler)
                .batch_size(1)
                .error_backoff(Duration::from_millis(100))
                .run_until(async move {
                    let _ = stopping.wait_for(|stop| *stop).await;
                })
        },
    ));
    tokio::pin!(consumers);
    let published = i64::from(plan.events);
    let expected_stalls = i64::from(plan.events.div_ceil(plan.stall_every));
    let redelivery = queue.redelivery_delay();
    let (mut rows, mut last_change) = (-1, Instant::now());
    let stats = loop {
        tokio::select! {
            finished = &mut consumers => break finished,
            Some(i) = stalled_rx.recv() => {
                // Give the stalled handler a moment to be inside its sleep, then take its
                // messages away where the broker needs a push.
                tokio::time::sleep(Duration::from_millis(200)).await;
                queue.take_away(&member(i)).await;
            }
            () = tokio::time::sleep(Duration::from_millis(250)) => {
                let summary = wallet::summary(db).await.expect("summary");
                if summary.ledger_rows != rows {
                    rows = summary.ledger_rows;
                    last_change = Instant::now();
                }
                let stalls = db.stalls().await.expect("wallet_stalls");
                tick(summary.distinct_events, stalls);
                let quiet = last_change.elapsed();
                // A zombie writes once its stall is over: wait for that, and for the copy
                // handed to another member (or, where none comes, the broker's own delay).
                let settled = watch.stalling.load(Ordering::SeqCst) == 0
                    && quiet >= Duration::from_secs(1)
                    && (watch.handed_over() >= stalls.unsigned_abs() || quiet >= stall + redelivery);
                let done = summary.distinct_events >= published
                    && stalls >= expected_stalls
                    && settled
                    && queue.waiting().await == 0;
                if done || quiet >= Duration::from_secs(120) {
                    let _ = stop.send(true);
                }
            }
        }
    };
    // A zombie's own end (its connection closed under it, its ack refused) is the broker's
    // business: what counts is the ledger and what is left.
    let skipped: u64 = stats
        .iter()
        .filter_map(|s| s.as_ref().ok())
        .map(|s| s.skipped_duplicates)
        .sum();
    let summary = wallet::summary(db).await.expect("summary");
    Some(ZombieReport {
        stalls: db.stalls().await.expect("wallet_stalls"),
        handed_over: watch.handed_over(),
        ownership_losses: watch.second_handlings.load(Ordering::SeqCst) + skipped,
        duplicates: summary.duplicates(),
        skipped_duplicates: skipped,
        lost: summary.lost(published),
        balances_exact: summary.balances_exact && summary.total_balance == expected_total,
        left: left(queue).await,
    })
}

/// Two members, one event of six stalling: whichever member takes it sits in its handler, its
/// transaction open, while the broker takes the message away from it
/// ([`TestQueue::losing_source`], [`TestQueue::take_away`]) and hands it to the other. The
/// other's claim waits on the zombie's open claim (the inbox row's primary key); the zombie then
/// commits and acks (or fails to ack: its hold is gone), and the other skips its copy. Every
/// credit is in the ledger once, and nothing is left on the broker.
pub async fn a_consumer_that_lost_its_message_mid_handler_applies_nothing_twice<
    B: TestBroker,
    D: TestStore,
>(
    broker: &B,
) {
    let (db, queue) = setup::<B, D>(broker, "zombie").await;
    let plan = ZombiePlan {
        events: 6,
        stall_every: 6,
        members: 2,
        work: Duration::ZERO,
    };
    let Some(r) = run(&queue, &db, db.inbox(), &plan, |_, _| {}).await else {
        println!(
            "zombie: skipped: this broker cannot take a message away from a stalled consumer \
             reliably"
        );
        finish(db, queue).await;
        return;
    };
    println!("zombie: {r:?}");
    assert_eq!(r.stalls, 1, "the stalling event stalled once");
    assert!(
        r.handed_over >= 1,
        "the broker handed the stalled message to the other member"
    );
    assert!(r.skipped_duplicates >= 1, "and the other member skipped it");
    assert_eq!((r.duplicates, r.lost), (0, 0), "every credit applied once");
    assert!(r.balances_exact);
    assert_eq!(r.left, 0);
    finish(db, queue).await;
}
