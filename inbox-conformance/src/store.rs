//! The scenarios every [`InboxStore`] passes, written once, as [`suite!`](crate::suite!) is for
//! brokers: each runs on a fresh database of the one test-support trait, [`TestStore`] (its
//! inbox the store under test, the wallet's credit its effect), and
//! [`store_suite!`](crate::store_suite!) turns every scenario into a `#[tokio::test]`.
//!
//! What they check is what the consumer relies on: a claim is seen once across concurrent
//! transactions (the second waits for the first, and skips after its commit or takes the ID
//! over after its rollback); a rollback takes the claim and the effect with it; a transaction a
//! handler broke (a failed statement it swallowed) never commits as applied; odd IDs are kept
//! apart exactly; an ID the store's claim refuses ([`RefusedId`]) is dead-lettered; a batch
//! claim answers as one-by-one claims do; a purged claim is forgotten while a recent one still
//! deduplicates; a store outage uses up no delivery budget; and a commit whose outcome the
//! consumer never learns (the connection cut around it) is retried with nothing lost or
//! applied twice.
//!
//! ```ignore
//! inbox_conformance::store_suite!(text, inbox_conformance::TestDb::keyed(KeyMode::Text));
//! ```

use std::time::Duration;

use inbox_core::{
    Consumer, ConsumerBinding, Handler, HandlerError, InboxStore, Message, MessageId, RefusedId,
    Stage, StageHook, StatsSnapshot, Transaction as _,
};
use inbox_testkit::MemoryBroker;

use crate::wallet::CreditEvent;
use crate::{ProxyMode, StoreTx, TestStore};

#[cfg(feature = "mysql")]
pub use crate::mysql_wallet::{mysql_url, MySqlDb};

/// A handler writing a credit of 1 to account 1 as the store's effect; a message whose payload
/// is `swallow` breaks its transaction first, one whose payload is `swallow last` after the
/// effect, as its last statement (then only the commit can find out).
struct Apply<D>(D);

impl<D: TestStore> Handler<StoreTx<D>> for Apply<D> {
    async fn handle(
        &self,
        tx: &mut StoreTx<D>,
        id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        if message.payload == b"swallow" {
            self.0.fail_and_swallow(tx).await;
        }
        apply::<D>(tx, id).await?;
        if message.payload == b"swallow last" {
            self.0.fail_and_swallow(tx).await;
        }
        Ok(())
    }
}

/// The effect of `id`, written through `tx`: it commits with the claim or not at all.
async fn apply<D: TestStore>(tx: &mut StoreTx<D>, id: &MessageId) -> Result<(), sqlx::Error> {
    D::apply(tx, id, &CreditEvent::new(1, 1)).await
}

fn id(text: &str) -> MessageId {
    MessageId::new(text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
}

/// Runs a consumer named `consumer` on `broker` until it is idle.
async fn drain<D: TestStore>(
    db: &D,
    broker: &MemoryBroker,
    consumer: &str,
    batch: usize,
) -> StatsSnapshot {
    let consumer = Consumer::new(consumer, broker.source(), db.inbox(), Apply(db.clone()));
    within(
        consumer
            .batch_size(batch)
            .retry(inbox_testkit::fast_retry(2))
            .run_until_idle(),
    )
    .await
}

/// Publishes `n` messages with fresh IDs to `broker`; returns the IDs.
fn published(broker: &MemoryBroker, n: usize) -> Vec<MessageId> {
    let ids: Vec<MessageId> = (0..n).map(|_| MessageId::generate()).collect();
    for each in &ids {
        broker.publish(Some(each.as_str()), "ok");
    }
    ids
}

/// A consumer run to idle, failing the test instead of hanging when it loops or stalls.
async fn within(
    run: impl std::future::Future<Output = Result<StatsSnapshot, inbox_core::Error>>,
) -> StatsSnapshot {
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the consumer got through the queue within 60 s")
        .expect("the consumer runs")
}

/// Two transactions claim one ID: the second waits while the first is open, then skips it
/// after the first commits; in the other order of events, takes it over after the first rolls
/// back.
pub async fn a_claim_is_seen_once_across_concurrent_transactions<D: TestStore>(db: D) {
    let store = db.inbox().bind(&ConsumerBinding::new("c"));
    for commit_first in [true, false] {
        let claimed = MessageId::generate();
        let mut first = store.begin().await.expect("begin");
        assert!(claim_one(&store, &mut first, &claimed).await);
        let second = {
            let (store, claimed) = (store.clone(), claimed.clone());
            tokio::spawn(async move {
                let mut tx = store.begin().await.expect("begin");
                let new = claim_one(&store, &mut tx, &claimed).await;
                (tx, new)
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !second.is_finished(),
            "the second claim waits while the first transaction is open"
        );
        if commit_first {
            first.commit().await.expect("commit");
        } else {
            first.rollback().await.expect("rollback");
        }
        let (tx, new) = tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .expect("the second claim returns once the first transaction ended")
            .expect("the second claim");
        tx.rollback().await.expect("rollback");
        assert_eq!(
            new,
            !commit_first,
            "after a {}, the second claim {}",
            if commit_first { "commit" } else { "rollback" },
            if commit_first {
                "skips"
            } else {
                "takes the ID over"
            }
        );
    }
    db.remove().await;
}

/// A rolled-back claim and its effect are gone: the ID claims as new, and once committed it
/// skips.
pub async fn a_rollback_releases_the_claim_and_its_effect<D: TestStore>(db: D) {
    let store = db.inbox().bind(&ConsumerBinding::new("c"));
    let claimed = MessageId::generate();
    let mut tx = store.begin().await.expect("begin");
    assert!(claim_one(&store, &mut tx, &claimed).await);
    apply::<D>(&mut tx, &claimed).await.expect("apply");
    tx.rollback().await.expect("rollback");
    assert_eq!(db.applied(&claimed).await, 0, "the effect rolled back");

    let mut tx = store.begin().await.expect("begin");
    assert!(claim_one(&store, &mut tx, &claimed).await, "new again");
    apply::<D>(&mut tx, &claimed).await.expect("apply");
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    assert!(!claim_one(&store, &mut tx, &claimed).await, "seen");
    tx.rollback().await.expect("rollback");
    assert_eq!(db.applied(&claimed).await, 1);
    db.remove().await;
}

/// A handler that swallowed a failed statement returns `Ok`, but its transaction cannot commit
/// what it did: the message is not counted applied, its effect is not there, and it is
/// dead-lettered after its retries; the messages around it are applied once. The failure comes
/// once before the effect (the next statement fails too) and once as the handler's last
/// statement, which only the commit can find out: a store whose commit reports success for a
/// transaction the server aborted loses that message (acked, its effect rolled back).
pub async fn a_transaction_a_handler_broke_never_reports_success<D: TestStore>(db: D) {
    let broker = MemoryBroker::new();
    let (before, broken, broken_last, after) = (
        MessageId::generate(),
        MessageId::generate(),
        MessageId::generate(),
        MessageId::generate(),
    );
    broker.publish(Some(before.as_str()), "ok");
    broker.publish(Some(broken.as_str()), "swallow");
    broker.publish(Some(broken_last.as_str()), "swallow last");
    broker.publish(Some(after.as_str()), "ok");
    let stats = drain(&db, &broker, "c", 4).await;
    println!("broken transactions: {stats:?}");
    assert_eq!(
        db.applied(&broken_last).await,
        0,
        "the effect of a transaction broken by its last statement is rolled back"
    );
    assert_eq!((stats.applied, stats.dead_lettered), (2, 2), "{stats:?}");
    assert_eq!(db.applied(&broken).await, 0);
    assert_eq!(db.applied(&before).await, 1);
    assert_eq!(db.applied(&after).await, 1);
    assert_eq!(broker.pending(), 0);
    db.remove().await;
}

/// IDs that differ only in case, spacing, accents or quoting are different IDs; each copy of
/// each is applied once, the longest ID accepted included.
pub async fn odd_ids_are_kept_apart_and_each_applied_once<D: TestStore>(db: D) {
    let broker = MemoryBroker::new();
    let long = "x".repeat(MessageId::MAX_LEN);
    let store = db.inbox().bind(&ConsumerBinding::new("c"));
    let mut kept = Vec::new();
    for text in [
        "evt-1",
        "evt-1 ",
        " evt-1",
        "EVT-1",
        "ünï✓ 🚀",
        "a'b\"c;--",
        "\t\n",
        long.as_str(),
    ] {
        if refusal(&store, &id(text)).await.is_none() {
            kept.push(text);
        }
    }
    let ids = kept;
    if ids.is_empty() {
        println!("odd IDs: skipped: this store refuses them all");
        db.remove().await;
        return;
    }
    for &text in &ids {
        broker.publish(Some(text), "ok");
        broker.publish(Some(text), "ok");
    }
    let stats = drain(&db, &broker, "c", 5).await;
    assert_eq!(
        (stats.applied, stats.skipped_duplicates, stats.dead_lettered),
        (ids.len() as u64, ids.len() as u64, 0),
        "{stats:?}"
    );
    for &text in &ids {
        assert_eq!(db.applied(&id(text)).await, 1, "{text:?}");
    }
    db.remove().await;
}

/// An ID the store refuses is dead-lettered with the store's reason; the messages of its batch
/// before and after it are applied.
pub async fn an_id_the_store_refuses_is_dead_lettered<D: TestStore>(db: D) {
    let Some(refused) = db.refused_id() else {
        println!("refused IDs: skipped: this store keeps every ID");
        db.remove().await;
        return;
    };
    let store = db.inbox().bind(&ConsumerBinding::new("c"));
    let reason = refusal(&store, &refused)
        .await
        .expect("the claim refuses it with RefusedId");
    let broker = MemoryBroker::new();
    let (before, after) = (MessageId::generate(), MessageId::generate());
    for id in [&before, &refused, &after] {
        broker.publish(Some(id.as_str()), "ok");
    }
    let stats = drain(&db, &broker, "c", 3).await;
    let dead = broker.dead_letters();
    println!("refused ID: {stats:?}; {dead:?}");
    assert_eq!((stats.applied, stats.dead_lettered), (2, 1), "{stats:?}");
    assert!(dead[0].1.contains(&reason), "{}", dead[0].1);
    assert_eq!(db.applied(&before).await, 1);
    assert_eq!(db.applied(&after).await, 1);
    db.remove().await;
}

/// Why `store`'s claim of `id` alone refuses it ([`RefusedId`]), or `None` when it keeps it;
/// the transaction is rolled back either way.
async fn refusal<S: InboxStore>(store: &S, id: &MessageId) -> Option<String> {
    let mut tx = store.begin().await.expect("begin");
    let claimed = store.claim(&mut tx, std::slice::from_ref(id)).await;
    tx.rollback().await.expect("rollback");
    let e = claimed.err()?;
    let refused = RefusedId::of(&e).unwrap_or_else(|| panic!("claiming {id:?} failed: {e}"));
    Some(refused.reason.to_string())
}

/// [`InboxStore::claim`] of a batch answers as claims one by one would: new IDs `true`, IDs
/// claimed before `false`, per consumer.
pub async fn a_batch_claim_answers_as_one_by_one_claims<D: TestStore>(db: D) {
    let store = db.inbox().bind(&ConsumerBinding::new("c"));
    let other_store = db.inbox().bind(&ConsumerBinding::new("other"));
    // Its name is resolved at its first transaction.
    other_store
        .begin()
        .await
        .expect("begin")
        .rollback()
        .await
        .expect("rollback");
    let ids: Vec<MessageId> = (0..10).map(|_| MessageId::generate()).collect();
    let mut tx = store.begin().await.expect("begin");
    for seen in ids.iter().step_by(3) {
        assert!(claim_one(&store, &mut tx, seen).await);
    }
    tx.commit().await.expect("commit");

    let mut tx = store.begin().await.expect("begin");
    let batch = store.claim(&mut tx, &ids).await.expect("claim");
    let other = other_store.claim(&mut tx, &ids).await.expect("claim");
    tx.rollback().await.expect("rollback");
    let mut tx = store.begin().await.expect("begin");
    let mut one_by_one = Vec::new();
    for each in &ids {
        one_by_one.push(claim_one(&store, &mut tx, each).await);
    }
    tx.rollback().await.expect("rollback");
    let expected: Vec<bool> = (0..ids.len()).map(|i| i % 3 != 0).collect();
    assert_eq!(batch, expected);
    assert_eq!(one_by_one, expected);
    assert_eq!(
        other,
        vec![true; ids.len()],
        "another consumer's claims are its own"
    );
    db.remove().await;
}

/// Claims older than the store keeps are purged and their IDs are new again (the retention
/// window is what the guarantee covers); a recent claim still skips its copy.
pub async fn a_purged_claim_is_forgotten_and_a_recent_one_kept<D: TestStore>(db: D) {
    let broker = MemoryBroker::new();
    let (old, recent) = (MessageId::generate(), MessageId::generate());
    broker.publish(Some(old.as_str()), "ok");
    drain(&db, &broker, "c", 2).await;
    let Some(purged) = db.age_and_purge().await else {
        println!("retention: skipped: this store forgets nothing");
        db.remove().await;
        return;
    };
    assert_eq!(purged, 1, "the aged claim was purged");
    broker.publish(Some(recent.as_str()), "ok");
    drain(&db, &broker, "c", 2).await;
    broker.publish(Some(old.as_str()), "ok");
    broker.publish(Some(recent.as_str()), "ok");
    let stats = drain(&db, &broker, "c", 2).await;
    assert_eq!(
        (stats.applied, stats.skipped_duplicates),
        (1, 1),
        "{stats:?}"
    );
    assert_eq!(db.applied(&old).await, 2, "past the window, applied again");
    assert_eq!(db.applied(&recent).await, 1);
    db.remove().await;
}

/// The store refuses connections for 3 s: the consumer waits it out at its error backoff, and
/// no try counts as a delivery (`max_deliveries(2)` dead-letters nothing), since the batch is
/// never handed back to the broker.
pub async fn a_store_outage_uses_up_no_delivery_budget<D: TestStore>(db: D) {
    let Some((store, proxy)) = db.proxied().await else {
        println!("store outage: skipped: no proxy can stand in front of this store");
        db.remove().await;
        return;
    };
    let broker = MemoryBroker::new();
    let ids = published(&broker, 3);
    proxy.set_mode(ProxyMode::Refuse);
    let run = Consumer::new("c", broker.source(), store, Apply(db.clone()))
        .batch_size(3)
        .max_deliveries(2)
        .error_backoff(Duration::from_millis(100))
        .run_until_idle();
    let outage = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        proxy.set_mode(ProxyMode::Pass);
    };
    let (stats, ()) = tokio::join!(within(run), outage);
    println!("store outage: {stats:?}");
    assert_eq!((stats.applied, stats.dead_lettered), (3, 0), "{stats:?}");
    assert!(stats.errors >= 3, "the outage was seen: {stats:?}");
    for each in &ids {
        assert_eq!(db.applied(each).await, 1);
    }
    db.remove().await;
}

/// The store's connections are cut just before, during or just after some commits, whose
/// outcome the consumer then does not learn: it tries again, and every message is applied
/// exactly once, nothing dead-lettered.
pub async fn a_commit_whose_outcome_is_unknown_is_retried_safely<D: TestStore>(db: D) {
    let Some((store, proxy)) = db.proxied().await else {
        println!("unknown commits: skipped: no proxy can stand in front of this store");
        db.remove().await;
        return;
    };
    let broker = MemoryBroker::new();
    let ids = published(&broker, 200);
    // After the last handler of some batches, every connection is cut a moment later: once
    // per message, so that its retry can commit. Cut again on every retry, a batch could fail
    // for as long as its commit takes longer than the delay, as on a loaded machine.
    let (cutter, cut_after) = (proxy.clone(), ids.clone());
    let cut_once = std::sync::Mutex::new(std::collections::HashSet::new());
    let hook = StageHook::new(move |stage, id| {
        let n = cut_after.iter().position(|each| each == id).unwrap_or(0);
        let first = || cut_once.lock().expect("not poisoned").insert(id.clone());
        if stage == Stage::Applied && n % 9 == 4 && first() {
            let proxy = cutter.clone();
            let delay = Duration::from_micros(rand::random::<u64>() % 1500);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                proxy.cut();
            });
        }
    });
    let run = Consumer::new("c", broker.source(), store, Apply(db.clone()))
        .batch_size(10)
        .error_backoff(Duration::from_millis(50))
        .on_stage(hook)
        .run_until_idle();
    let stats = within(run).await;
    let mut counts = Vec::new();
    for each in &ids {
        counts.push(db.applied(each).await);
    }
    let (lost, twice) = (
        counts.iter().filter(|&&n| n == 0).count(),
        counts.iter().filter(|&&n| n > 1).count(),
    );
    println!("unknown commits: {stats:?}; lost {lost}, applied twice {twice}");
    assert_eq!((lost, twice), (0, 0), "{stats:?}");
    assert!(stats.errors > 0, "some cuts hit a transaction: {stats:?}");
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.pending(), 0);
    db.remove().await;
}

/// One `#[tokio::test]` per store scenario, in a module `$name`, each on a fresh store made by
/// `$make` (an async expression of a type implementing [`TestStore`]).
#[macro_export]
macro_rules! store_suite {
    ($name:ident, $make:expr) => {
        $crate::store_suite!(@tests $name, $make;
            a_claim_is_seen_once_across_concurrent_transactions,
            a_rollback_releases_the_claim_and_its_effect,
            a_transaction_a_handler_broke_never_reports_success,
            odd_ids_are_kept_apart_and_each_applied_once,
            an_id_the_store_refuses_is_dead_lettered,
            a_batch_claim_answers_as_one_by_one_claims,
            a_purged_claim_is_forgotten_and_a_recent_one_kept,
            a_store_outage_uses_up_no_delivery_budget,
            a_commit_whose_outcome_is_unknown_is_retried_safely,
        );
    };
    (@tests $name:ident, $make:expr; $($scenario:ident),* $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    $crate::store::$scenario($make.await).await;
                }
            )*
        }
    };
}

/// One ID claimed through `store` (bound), as the consumer claims a batch of one.
async fn claim_one<S: InboxStore>(store: &S, tx: &mut S::Tx, id: &MessageId) -> bool {
    let claimed = store
        .claim(tx, std::slice::from_ref(id))
        .await
        .expect("claim");
    claimed == [true]
}
