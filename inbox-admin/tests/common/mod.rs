//! What the CLI tests share: running `inbox-admin` as an operator does, and reading its output.
#![allow(dead_code, unreachable_pub)] // each test file uses its own part

use std::process::{Command, Output};
use std::time::Duration;

pub const DAY: Duration = Duration::from_secs(24 * 3600);

pub fn admin(args: &[&str]) -> Output {
    admin_with(args, &[])
}

/// `inbox-admin` with these environment variables; stdout and stderr are pipes.
pub fn admin_with(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inbox-admin"))
        .args(args)
        .env_remove("INBOX_ADMIN_PROGRESS_EVERY")
        .env("DATABASE_URL", inbox_conformance::database_url())
        .envs(envs.iter().copied())
        .output()
        .expect("the inbox-admin binary runs")
}

/// Stdout as the one JSON object it must be, on one line.
pub fn json_object(out: &Output) -> serde_json::Value {
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "not one line:\n{stdout}");
    let value: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stdout}"));
    assert!(value.is_object(), "{value}");
    value
}

/// Progress redrawn in place (a carriage return, an escape sequence) has no place in a pipe.
pub fn assert_no_redrawing(out: &Output) {
    for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let output = text(bytes);
        assert!(
            !output.contains(['\r', '\x1b']),
            "{name} has a carriage return or an escape: {output:?}"
        );
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
