//! The kill test in small, on every broker: the inbox variant `c` must show no duplicate and
//! no loss across hard kills, and variant `b` with the crash between commit and ack must show
//! duplicates (so the harness can see a failure when there is one).
//!
//! Every broker must be reachable (`cargo xtask services`).
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{evidence, one};
use serde_json::Value;

/// Runs `evidence kill-test` on `broker`, one run, and returns its JSON lines.
fn kill_test(broker: &str, args: &[&str]) -> Vec<Value> {
    let chart =
        std::env::temp_dir().join(format!("wallet-smoke-{broker}-{}.svg", std::process::id()));
    let chart = chart.to_str().unwrap();
    let base = [
        "kill-test",
        "--brokers",
        broker,
        "--runs",
        "1",
        "--throughput",
        "false",
        "--require-brokers",
        "true",
        "--work-ms",
        "3",
        "--chart",
        chart,
    ];
    let lines = evidence(&[&base[..], args].concat());
    let _ = std::fs::remove_file(chart);
    lines
}

fn smoke(broker: &str) {
    let lines = kill_test(
        broker,
        &[
            "--variants",
            "c",
            "--events",
            "200",
            "--kills",
            "2",
            "--kill-after-ms",
            "700..1500",
        ],
    );
    let c = one(&lines, "variant", "c");
    assert_eq!(c["broker"], broker);
    assert_eq!(c["kills"], 2);
    assert_eq!(c["duplicates"], 0, "the inbox let a duplicate through: {c}");
    assert_eq!(c["lost"], 0, "the inbox lost a message: {c}");
    assert_eq!(c["balances_exact"], true, "{c}");

    let lines = kill_test(
        broker,
        &[
            "--variants",
            "b",
            "--events",
            "150",
            "--kills",
            "1",
            "--kill-after-ms",
            "8000..8000",
            "--crash-between-commit-and-ack",
            "0.5",
        ],
    );
    let b = one(&lines, "variant", "b");
    assert!(
        b["self_crashes"].as_u64().unwrap() > 0,
        "the consumer never crashed: {b}"
    );
    assert!(
        b["duplicates"].as_i64().unwrap() > 0,
        "crashing between commit and ack without the inbox must duplicate: {b}"
    );
    assert_eq!(b["lost"], 0, "{b}");
    assert_eq!(b["balances_exact"], false, "{b}");
}

#[test]
fn rabbitmq_inbox_survives_kills_and_b_duplicates() {
    smoke("rabbitmq");
}

#[test]
fn sqs_inbox_survives_kills_and_b_duplicates() {
    smoke("sqs");
}

#[test]
fn redis_inbox_survives_kills_and_b_duplicates() {
    smoke("redis");
}

#[test]
fn kafka_inbox_survives_kills_and_b_duplicates() {
    smoke("kafka");
}
