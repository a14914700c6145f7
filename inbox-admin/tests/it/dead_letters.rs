//! `inbox-admin dead-letters` run as an operator runs it, on each broker: a batch dead-lettered
//! while the downstream was down is listed, dry-run, replayed after the fix and applied once,
//! and nothing stays parked. The scenario is written once (`replayed_by_the_cli`); each broker
//! test names its dead-letter destination and addresses.

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use inbox_conformance::replay::{consume_with_the_downstream_up, park_credits_while_down};
use inbox_conformance::{wallet, TestBroker, TestDb, TestQueue};

use crate::common;
use common::*;

const N: i64 = 6;

/// The scenario, on the dead-letter destination `from` of `broker`, with the broker's
/// addresses in `envs`.
async fn replayed_by_the_cli<B: TestBroker>(
    broker: &B,
    name: &str,
    from: impl Fn(&B::Queue) -> String,
    envs: &[(&str, String)],
) {
    let db = TestDb::new().await;
    let queue = broker.queue("admin-replay").await;
    let expected = park_credits_while_down(&db, &queue, N).await;
    let from = from(&queue);
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let run = |args: &[&str]| {
        let mut all = vec!["dead-letters"];
        all.extend_from_slice(&args[..1]);
        all.extend_from_slice(&["--broker", name, "--from", &from]);
        all.extend_from_slice(&args[1..]);
        let out = admin_with(&all, &envs);
        assert!(out.status.success(), "{all:?}: {out:?}");
        assert_no_redrawing(&out);
        out
    };

    let listed = json_object(&run(&["list", "--json"]));
    assert_eq!(listed["count"], N, "{listed}");
    let reasons = listed["by_reason"].as_array().unwrap();
    assert_eq!(reasons.len(), 1, "{listed}");
    let reason = reasons[0]["reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("downstream down"), "{listed}");
    let table = text(&run(&["list"]).stdout);
    assert!(table.contains(&format!("count        {N}")), "{table}");

    let dry = json_object(&run(&[
        "replay",
        "--reason",
        &reason,
        "--dry-run",
        "--json",
    ]));
    assert_eq!(
        (dry["moved"].as_u64(), dry["dry_run"].as_bool()),
        (Some(N as u64), Some(true))
    );
    assert_eq!(json_object(&run(&["list", "--json"]))["count"], N);
    assert_eq!(queue.left().await, 0, "a dry run published something");

    let replayed = text(&run(&["replay", "--all"]).stdout);
    assert!(
        replayed.contains(&format!(
            "moved {N}; the inbox will skip those already applied"
        )),
        "{replayed}"
    );
    let (applied, skipped) = consume_with_the_downstream_up(&db, &queue, N as u64).await;
    assert_eq!((applied, skipped), (N as u64, 0));
    let ledger = wallet::summary(&db).await.unwrap();
    assert_eq!((ledger.ledger_rows, ledger.distinct_events), (N, N));
    assert_eq!(ledger.total_balance, expected);
    assert_eq!(json_object(&run(&["list", "--json"]))["count"], 0);

    queue.cleanup().await;
    db.drop().await;
}

/// A variable's value, or the local default the conformance suite uses.
fn var(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_dead_letters_are_listed_and_replayed_once() {
    let envs = [("REDIS_URL", inbox_conformance::redis::redis_url())];
    replayed_by_the_cli(
        &inbox_conformance::redis::Redis,
        "redis",
        |q| format!("{}:dlq", q.name()),
        &envs,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_dead_letters_are_listed_and_replayed_once() {
    let envs = [("NATS_URL", inbox_conformance::nats::nats_url())];
    replayed_by_the_cli(
        &inbox_conformance::nats::Nats,
        "nats",
        |q| q.dead_letter_subject(),
        &envs,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_dead_letters_are_listed_and_replayed_once() {
    let envs = [("AMQP_URL", inbox_conformance::rabbitmq::amqp_url())];
    replayed_by_the_cli(
        &inbox_conformance::rabbitmq::RabbitMq::default(),
        "rabbitmq",
        |q| format!("{}.dlq", q.name()),
        &envs,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_dead_letters_are_listed_and_replayed_once() {
    let envs = [("KAFKA_BROKERS", inbox_conformance::kafka::brokers())];
    replayed_by_the_cli(
        &inbox_conformance::kafka::Kafka::default(),
        "kafka",
        |q| format!("{}.dlq", q.name()),
        &envs,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_dead_letters_are_listed_and_replayed_once() {
    let envs = [
        (
            "AWS_ENDPOINT_URL_SQS",
            var("AWS_ENDPOINT_URL_SQS", "http://127.0.0.1:4566"),
        ),
        ("AWS_REGION", var("AWS_REGION", "us-east-1")),
        ("AWS_ACCESS_KEY_ID", var("AWS_ACCESS_KEY_ID", "test")),
        (
            "AWS_SECRET_ACCESS_KEY",
            var("AWS_SECRET_ACCESS_KEY", "test"),
        ),
    ];
    // The queue's name is its URL and its dead-letter queue's URL.
    replayed_by_the_cli(
        &inbox_conformance::sqs::Sqs,
        "sqs",
        |q| q.name().split_once(' ').unwrap().1.to_owned(),
        &envs,
    )
    .await;
}

#[test]
fn an_address_left_out_is_named_with_its_flag_and_variable() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inbox-admin"))
        .args([
            "dead-letters",
            "list",
            "--broker",
            "redis",
            "--from",
            "x:dlq",
        ])
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("pass --redis-url or set REDIS_URL"),
        "{stderr}"
    );
}
