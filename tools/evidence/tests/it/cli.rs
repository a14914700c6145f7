//! `evidence --help`, `--version` and wrong command lines: what a user types first, and what
//! scripts rely on (a usage on stderr and a non-zero status for anything wrong).

use std::process::{Command, Output};

fn evidence(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_evidence"))
        .args(args)
        .output()
        .expect("the evidence binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("utf-8")
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).expect("utf-8")
}

#[test]
fn help_lists_every_command_and_succeeds() {
    for args in [&["--help"][..], &["-h"], &["help"]] {
        let out = evidence(args);
        assert!(out.status.success(), "{args:?}: {out:?}");
        let text = stdout(&out);
        assert!(text.contains("Usage: evidence"), "{text}");
        for command in [
            "demo",
            "kill-test",
            "zombie-test",
            "bench",
            "soak",
            "effects-test",
            "retention-bench",
            "consume",
            "publish",
            "memory-demo",
            "report",
        ] {
            assert!(
                text.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{command} "))),
                "{command} missing: {text}"
            );
        }
    }
}

#[test]
fn each_command_has_its_own_help() {
    for (command, flags) in [
        (
            "kill-test",
            &["--brokers", "--variants", "--kill-after-ms", "--kafka-impl"][..],
        ),
        (
            "soak",
            &[
                "--kill-every",
                "--max-minutes",
                "--fault-every",
                "--kafka-impl",
            ],
        ),
        ("bench", &["--events-at-batch-1", "--batches", "--lanes"]),
        ("effects-test", &["--e2e", "--modes", "--sqs-events"]),
        (
            "retention-bench",
            &["--rows-per-day", "--window-days", "--layouts"],
        ),
        ("demo", &["--full", "--brokers"]),
    ] {
        let out = evidence(&[command, "--help"]);
        assert!(out.status.success(), "{command}: {out:?}");
        let text = stdout(&out);
        assert!(
            text.contains(&format!("Usage: evidence {command}")),
            "{command}: {text}"
        );
        for flag in flags {
            assert!(text.contains(flag), "{command} {flag} missing: {text}");
        }
    }
    let text = stdout(&evidence(&["kill-test", "--help"]));
    assert!(text.contains("--kafka-impl <tansu|mock>"), "{text}");
}

/// The commands that take one `--broker` list every broker they accept.
#[test]
fn the_broker_flag_lists_every_broker() {
    for command in ["consume", "publish", "effects-child"] {
        let text = stdout(&evidence(&[command, "--help"]));
        assert!(
            text.contains("--broker <kafka|sqs|rabbitmq|redis|nats>"),
            "{command}: {text}"
        );
    }
}

#[test]
fn version_succeeds() {
    let out = evidence(&["--version"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout(&out).starts_with(&format!("evidence {}", env!("CARGO_PKG_VERSION"))),
        "{out:?}"
    );
}

#[test]
fn no_arguments_fail_with_the_usage() {
    let out = evidence(&[]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "{out:?}");
    let err = stderr(&out);
    assert!(err.contains("Usage: evidence <COMMAND>"), "{err}");
}

/// Each wrong command line fails with status 2, saying on stderr what is wrong (and, where it
/// is the command line's shape, the usage).
#[test]
fn wrong_command_lines_fail_saying_what_is_wrong() {
    for (args, says) in [
        (
            &["kill-test", "--kafka-impl", "redpanda"][..],
            &["use tansu or mock"][..],
        ),
        (&["bogus"], &["bogus", "Usage: evidence", "--help"]),
        (
            &["soak", "--kill-evry", "5..30"],
            &["--kill-evry", "Usage: evidence soak"],
        ),
        (
            &["bench", "--events", "20k"],
            &["invalid value '20k' for '--events <N>'", "invalid digit"],
        ),
        (
            &["soak", "--kill-every", "30..5"],
            &["--kill-every", "MIN is above MAX"],
        ),
        (
            &["retention-bench", "--days", "2", "--window-days", "2"],
            &[
                "--window-days must be at least 1 and below --days",
                "Usage: evidence retention-bench",
            ],
        ),
    ] {
        let out = evidence(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = stderr(&out);
        for said in says {
            assert!(err.contains(said), "{args:?}: `{said}` missing: {err}");
        }
    }
}
