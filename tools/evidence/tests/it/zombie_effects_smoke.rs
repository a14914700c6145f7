//! The zombie test and the effects tests in small, on the conformance suite's brokers: a
//! consumer that loses its messages mid-handler still writes, and the inbox must skip what it
//! wrote where variant `b` duplicates it; the effect consumer and the outbox chain, their
//! processes killed in turn, must apply each event once.
//!
//! Redis and RabbitMQ must be reachable (`cargo xtask services`); SQS and Kafka take longer to
//! hand a message over and are left to the full runs.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{evidence, one};

fn zombie(broker: &str) {
    let lines = evidence(&[
        "zombie-test",
        "--brokers",
        broker,
        "--require-brokers",
        "true",
        "--events",
        "400",
        "--stall-every",
        "100",
    ]);
    let c = one(&lines, "variant", "c");
    assert_eq!(c["broker"], broker);
    assert_eq!(c["stalls"], 4, "every stalling event stalled once: {c}");
    assert!(
        c["ownership_losses"].as_u64().unwrap() > 0,
        "no consumer lost a message it was handling: {c}"
    );
    assert_eq!(
        c["duplicates"], 0,
        "the inbox let a zombie's write through: {c}"
    );
    assert_eq!(c["lost"], 0, "{c}");
    let b = one(&lines, "variant", "b");
    assert!(
        b["duplicates"].as_i64().unwrap() > 0,
        "a zombie's write without the inbox must duplicate: {b}"
    );
    assert_eq!(b["lost"], 0, "{b}");
}

#[test]
fn redis_zombies_duplicate_without_the_inbox_and_not_with_it() {
    zombie("redis");
}

#[test]
fn rabbitmq_zombies_duplicate_without_the_inbox_and_not_with_it() {
    zombie("rabbitmq");
}

#[test]
fn redis_effects_and_the_outbox_chain_apply_each_event_once_across_kills() {
    let common = [
        "effects-test",
        "--brokers",
        "redis",
        "--events",
        "150",
        "--kills",
        "2",
        "--runs",
        "1",
        "--kill-after-ms",
        "700..1500",
    ];
    let lines = evidence(&[&common[..], &["--modes", "keys"]].concat());
    let effects = one(&lines, "test", "effects");
    assert_eq!(effects["kills"], serde_json::json!([2]), "{effects}");
    assert_eq!(effects["duplicates"], serde_json::json!([0]), "{effects}");
    assert_eq!(effects["lost"], serde_json::json!([0]), "{effects}");

    let lines = evidence(&[&common[..], &["--e2e", "true"]].concat());
    let chain = one(&lines, "test", "outbox_chain");
    assert_eq!(chain["duplicates"], serde_json::json!([0]), "{chain}");
    assert_eq!(chain["lost"], serde_json::json!([0]), "{chain}");
    assert_eq!(
        chain["balances_exact"],
        serde_json::json!([true]),
        "{chain}"
    );
    assert_eq!(chain["unsent"], serde_json::json!([0]), "{chain}");
}
