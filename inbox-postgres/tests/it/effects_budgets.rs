//! Hand-backs and attempt budgets of the effect consumer against a real PostgreSQL and a real
//! HTTP provider: a live lease hands the message back without using an attempt (and without a
//! busy loop on a broker that cannot delay), a call that surely did not apply is retried even
//! when unknowns are skipped, dead-lettered messages get a fresh budget on replay (and a copy
//! that is not a replay none), and a dead letter that fails leaves the message to come back.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common_effects;

use std::time::Duration;

use common_effects::*;
use inbox_conformance::provider::{Behaviour, ProviderMode};
use inbox_core::{Ack, Delivery, MessageId, MessageSource, SourceError, Stage, REPLAYED};
use inbox_testkit::fast_retry;
use inbox_testkit::{Crash, MemoryAck, MemoryBroker, MemorySource};

/// For the tests that count hand-backs during a dead consumer's lease: long enough that the
/// next consumer surely starts inside it.
const LONG_LEASE: Duration = Duration::from_secs(3);

#[tokio::test]
async fn a_live_lease_hands_the_message_back_without_using_its_attempts() {
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    let handler = Setup::Keys.handler(&env.provider);
    // Two attempts allowed: the dead consumer's lease and the one after it.
    let crash = Crash::at_ids(Stage::Claimed, [id("evt-1")]);
    let consumer = env
        .crashing_consumer(&crash, broker.source(), handler.clone())
        .lease(LONG_LEASE)
        .retry(fast_retry(2));
    let crashed = crash.run(consumer.run_until(std::future::pending())).await;
    assert!(crashed.is_err(), "{crashed:?}");

    let stats = patiently(
        env.consumer(broker.source(), handler)
            .lease(LONG_LEASE)
            .retry(fast_retry(2))
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    assert_eq!(env.provider.effects(&key("evt-1")), 1);
    assert!(
        broker.dead_letters().is_empty(),
        "the hand-back used up no attempt"
    );
    assert_eq!(
        stats.busy, 1,
        "handed back once, delayed by the rest of the lease: no busy loop"
    );
    assert_eq!(broker.acked(), 1, "acked once, after the done mark");
    let sent = env.sent("evt-1").await;
    assert_eq!(
        sent[0].2,
        Some(3),
        "the broker handed it out 3 times, one more than the 2 attempts allowed"
    );
    assert_eq!(env.row("evt-1").await, (2, 2, true));
    env.db.drop().await;
}

/// A source whose nack cannot delay, like a Kafka rewind: a handed-back message comes straight
/// back.
struct NoDelay(MemorySource);

#[derive(Debug)]
struct NoDelayAck(MemoryAck);

impl Ack for NoDelayAck {
    inbox_testkit::forward_ack!(0: ack, dead_letter);
    async fn nack(self, _retry_after: Duration) -> Result<(), SourceError> {
        self.0.nack(Duration::ZERO).await
    }
}

impl MessageSource for NoDelay {
    type Ack = NoDelayAck;
    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<NoDelayAck>>, SourceError> {
        let batch = self.0.receive(max).await?;
        Ok(batch
            .into_iter()
            .map(|d| Delivery {
                message: d.message,
                ack: NoDelayAck(d.ack),
            })
            .collect())
    }
}

#[tokio::test]
async fn a_broker_that_cannot_delay_a_hand_back_does_not_make_a_busy_loop() {
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    let handler = Setup::Keys.handler(&env.provider);
    let crash = Crash::at_ids(Stage::Claimed, [id("evt-1")]);
    let consumer = env
        .crashing_consumer(&crash, broker.source(), handler.clone())
        .lease(LONG_LEASE);
    let crashed = crash.run(consumer.run_until(std::future::pending())).await;
    assert!(crashed.is_err(), "{crashed:?}");

    let stats = patiently(
        env.consumer(NoDelay(broker.source()), handler)
            .lease(LONG_LEASE)
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    assert_eq!(env.provider.effects(&key("evt-1")), 1);
    assert_eq!(
        stats.busy, 1,
        "the copy that came straight back waited out the lease instead of asking again"
    );
    assert_eq!(
        env.sent("evt-1").await[0].2,
        Some(3),
        "handed out once more, not hundreds of times"
    );
    env.db.drop().await;
}

#[tokio::test]
async fn a_call_that_surely_did_not_apply_is_retried_even_when_unknowns_are_skipped() {
    let env = Env::new(ProviderMode::Neither).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    broker.publish(Some("evt-2"), "notify");
    // evt-1: "503, not applied" (the handler says `not_applied`); evt-2: "500", which could
    // mean anything, so its outcome is unknown.
    env.provider
        .next_call(&key("evt-1"), Behaviour::Refuse(503));
    env.provider
        .next_call(&key("evt-2"), Behaviour::Refuse(500));
    let stats = patiently(
        env.consumer(broker.source(), Setup::BlindSkip.handler(&env.provider))
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    assert_eq!(env.provider.effects(&key("evt-1")), 1, "retried: no loss");
    assert_eq!(env.sent("evt-1").await[0].1, "called");
    assert_eq!(
        env.provider.effects(&key("evt-2")),
        0,
        "skipped after an unknown outcome: the documented loss"
    );
    assert_eq!(env.sent("evt-2").await[0].1, "skipped");
    assert_eq!(
        (stats.applied, stats.skipped_unknown, stats.retried),
        (1, 1, 2)
    );
    env.db.drop().await;
}

#[tokio::test]
async fn failed_messages_are_dead_lettered_and_a_replay_gets_a_fresh_budget() {
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    broker.publish(Some("evt-2"), "notify");
    broker.publish(None, "notify"); // no ID
    for _ in 0..3 {
        env.provider
            .next_call(&key("evt-1"), Behaviour::Refuse(503));
    }
    env.provider
        .next_call(&key("evt-2"), Behaviour::Refuse(422));
    let handler = Setup::Keys.handler(&env.provider);
    // Runs a consumer with a budget of 3 until the broker holds nothing.
    let drain = || {
        patiently(
            env.consumer(broker.source(), handler.clone())
                .retry(fast_retry(3))
                .run_until(drained(&broker)),
        )
    };
    let stats = drain().await.unwrap();

    let dead = broker.dead_letters();
    let reason = |evt: Option<&str>| {
        dead.iter()
            .find(|(m, _)| m.id.as_ref().ok().map(MessageId::as_str) == evt)
            .map(|(_, reason)| reason.clone())
            .unwrap_or_default()
    };
    assert_eq!((dead.len(), stats.dead_lettered), (3, 3));
    assert!(reason(Some("evt-1")).contains("failed 3 time(s)"));
    assert!(reason(Some("evt-2")).contains("refused"));
    assert!(reason(None).contains("no ID"));
    assert_eq!(env.provider.calls(&key("evt-1")).len(), 3);
    assert_eq!(
        env.provider.calls(&key("evt-2")).len(),
        1,
        "permanent: not retried"
    );
    assert_eq!(env.provider.applied().len(), 0);
    assert_eq!(env.sent_total().await, 0);
    assert_eq!(
        env.row("evt-1").await,
        (3, 0, false),
        "unsettled, count reset"
    );

    // A copy that is not a replay (a producer's resend) is a duplicate of the dead letter: no
    // call, no second letter, and the replay's budget stays whole.
    broker.publish(Some("evt-1"), "notify");
    let stats = drain().await.unwrap();
    assert_eq!((stats.skipped_duplicates, stats.dead_lettered), (1, 0));
    assert_eq!(
        env.provider.calls(&key("evt-1")).len(),
        3,
        "no call for the resend"
    );
    assert_eq!(broker.dead_letters().len(), 3);

    // An operator replays the dead letter (`replay` marks its copies): it is applied, within a
    // fresh budget of 3, after failing twice more.
    for _ in 0..2 {
        env.provider
            .next_call(&key("evt-1"), Behaviour::Refuse(503));
    }
    let (mut replay, _) = dead
        .into_iter()
        .find(|(m, _)| m.id.as_ref().is_ok_and(|i| i.as_str() == "evt-1"))
        .unwrap();
    replay.headers.push((REPLAYED.to_owned(), b"true".to_vec()));
    broker.publish_message(replay);
    drain().await.unwrap();
    assert_eq!(env.provider.calls(&key("evt-1")).len(), 6);
    assert_eq!(env.provider.effects(&key("evt-1")), 1);
    assert_eq!(env.row("evt-1").await, (7, 3, true));
    env.db.drop().await;
}

#[tokio::test]
async fn a_dead_letter_that_fails_leaves_the_lease_unsettled_and_the_message_comes_back() {
    let env = Env::new(ProviderMode::Keys).await;
    let broker = MemoryBroker::new();
    broker.publish(Some("evt-1"), "notify");
    for _ in 0..2 {
        env.provider
            .next_call(&key("evt-1"), Behaviour::Refuse(422));
    }
    // The first dead letter fails: the message must come back, not be lost or marked parked.
    broker.fail_dead_letters(1);
    let stats = patiently(
        env.consumer(broker.source(), Setup::Keys.handler(&env.provider))
            .run_until(drained(&broker)),
    )
    .await
    .unwrap();

    let dead = broker.dead_letters();
    assert_eq!((dead.len(), stats.dead_lettered, stats.errors), (1, 1, 1));
    assert_eq!(
        dead[0].0.meta.delivery_count,
        Some(2),
        "parked from its second delivery"
    );
    assert_eq!(env.provider.calls(&key("evt-1")).len(), 2);
    assert_eq!(env.provider.effects(&key("evt-1")), 0);
    assert_eq!(
        env.row("evt-1").await,
        (2, 0, false),
        "leased twice, released as dead-lettered once parked"
    );
    env.db.drop().await;
}
