//! Project tasks, run as `cargo xtask <task>`:
//!
//! - `services`: installs what is missing and starts what is not running: PostgreSQL, Redis,
//!   RabbitMQ, a Kafka-protocol broker (Tansu) and an SQS endpoint (moto). A service already
//!   listening at its address is reused; nothing is ever stopped. Safe to run twice.
//! - `test`: `services`, then `cargo fmt --check`, `cargo clippy --all-targets -D warnings`
//!   and the whole test suite, then the store's suite (`inbox-postgres`) again on the
//!   partitioned inbox layout (`INBOX_TEST_LAYOUT=partitioned`), then the examples
//!   (`examples/examples/*.rs`) against the services, then `cargo package` for every library
//!   crate.
//! - `demo`: `services`, then the wallet demo (extra arguments go to it).

mod services;

use std::process::{Command, ExitCode};

/// The programs users copy, one per broker, then the side effects outside the database: each
/// fails when an effect is lost or applied twice.
const EXAMPLES: [&str; 6] = [
    "kafka",
    "sqs",
    "rabbitmq",
    "redis_streams",
    "effect_call",
    "outbox",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("services") => services::up(),
        Some("test") => services::up().and_then(|()| test(&args[1..])),
        Some("demo") => services::up().and_then(|()| demo(&args[1..])),
        _ => {
            Err("usage: cargo xtask services | test [cargo test args] | demo [wallet args]".into())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn test(extra: &[String]) -> Result<(), String> {
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    let mut args = vec!["test", "--workspace"];
    args.extend(extra.iter().map(String::as_str));
    cargo(&args)?;
    // Both inbox layouts pass the store's whole suite: the second pass puts every test inbox of
    // `inbox-postgres` in the partitioned one.
    let mut args = vec!["test", "-p", "inbox-postgres"];
    args.extend(extra.iter().map(String::as_str));
    cargo_with(&args, &[("INBOX_TEST_LAYOUT", "partitioned")])?;
    // Built by `cargo test` already; this runs them.
    for example in EXAMPLES {
        cargo(&[
            "run",
            "--quiet",
            "-p",
            "inbox-examples",
            "--example",
            example,
        ])?;
    }
    // Every library crate packages (its manifest, its files, the versions of its workspace
    // dependencies). Without verifying: that would build each package and all its
    // dependencies once more, from scratch, for the same code `cargo test` just built.
    cargo(&[
        "package",
        "--workspace",
        "--no-verify",
        "--allow-dirty",
        "--exclude",
        "inbox-examples",
        "--exclude",
        "xtask",
    ])
}

fn demo(extra: &[String]) -> Result<(), String> {
    let mut args = vec![
        "run",
        "--quiet",
        "-p",
        "inbox-examples",
        "--bin",
        "wallet",
        "--",
        "demo",
    ];
    args.extend(extra.iter().map(String::as_str));
    cargo(&args)
}

fn cargo(args: &[&str]) -> Result<(), String> {
    cargo_with(args, &[])
}

fn cargo_with(args: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let vars: String = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    eprintln!("xtask: {vars}cargo {}", args.join(" "));
    let status = Command::new(cargo)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("cargo {} failed ({status})", args.join(" ")))
    }
}
