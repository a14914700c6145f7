//! `wallet --help` and a wrong command: what a user types first.

use std::process::Command;

fn wallet(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_wallet"))
        .args(args)
        .output()
        .expect("the wallet binary runs")
}

#[test]
fn help_lists_every_command_and_succeeds() {
    for args in [&["--help"][..], &["kill-test", "--help"], &["-h"]] {
        let out = wallet(args);
        assert!(out.status.success(), "{args:?}: {out:?}");
        let text = String::from_utf8(out.stdout).expect("utf-8");
        for command in [
            "kill-test",
            "zombie-test",
            "soak",
            "consume",
            "publish",
            "memory-demo",
            "report",
        ] {
            assert!(
                text.contains(&format!("wallet {command}")),
                "{command} missing: {text}"
            );
        }
        assert!(
            text.contains("--kafka-impl tansu|mock"),
            "--kafka-impl missing: {text}"
        );
    }
}

#[test]
fn an_unknown_kafka_implementation_fails_naming_the_choices() {
    let out = wallet(&["kill-test", "--kafka-impl", "redpanda"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(err.contains("use tansu or mock"), "{err}");
}

#[test]
fn an_unknown_command_fails_with_the_usage() {
    let out = wallet(&["bogus"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(err.contains("usage: wallet"), "{err}");
    assert!(err.contains("--help"), "{err}");
}
