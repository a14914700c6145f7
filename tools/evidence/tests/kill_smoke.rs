//! The kill test in small, on every broker: the inbox variant `c` must show no duplicate and
//! no loss across hard kills, and variant `b` with the crash between commit and ack must show
//! duplicates (so the harness can see a failure when there is one).
//!
//! Every broker must be reachable (`cargo xtask services`).
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use serde_json::Value;

/// Runs `evidence kill-test` and returns its JSON lines.
fn kill_test(broker: &str, args: &[&str]) -> Vec<Value> {
    let chart =
        std::env::temp_dir().join(format!("wallet-smoke-{broker}-{}.svg", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_evidence"))
        .args([
            "kill-test",
            "--brokers",
            broker,
            "--runs",
            "1",
            "--throughput",
            "false",
        ])
        .args(["--require-brokers", "true", "--work-ms", "3"])
        .arg("--chart")
        .arg(&chart)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "evidence kill-test {broker} {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    let _ = std::fs::remove_file(chart);
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn one(lines: &[Value], variant: &str) -> Value {
    let found: Vec<&Value> = lines.iter().filter(|l| l["variant"] == variant).collect();
    assert_eq!(found.len(), 1, "one JSON line for {variant}: {lines:?}");
    found[0].clone()
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
    let c = one(&lines, "c");
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
    let b = one(&lines, "b");
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
