//! What the CLI tests share: running `inbox-admin` as an operator does, and reading its output.
#![allow(dead_code, unreachable_pub)] // each test file uses its own part

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const DAY: Duration = Duration::from_secs(24 * 3600);

pub fn admin(args: &[&str]) -> Output {
    admin_with(args, &[])
}

/// `inbox-admin` with these environment variables; stdout and stderr are pipes.
pub fn admin_with(args: &[&str], envs: &[(&str, &str)]) -> Output {
    command(args, envs)
        .output()
        .expect("the inbox-admin binary runs")
}

fn command(args: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_inbox-admin"));
    command
        .args(args)
        .env_remove("INBOX_ADMIN_PROGRESS_EVERY")
        .env("DATABASE_URL", inbox_conformance::database_url())
        .envs(envs.iter().copied());
    command
}

/// [`admin_with`], and how long it ran; killed, and the test failed, past `limit`: a command
/// that cannot reach its broker must say so, not hang.
pub fn admin_within(args: &[&str], envs: &[(&str, &str)], limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    let mut child = command(args, envs)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the inbox-admin binary runs");
    // Read on threads of their own, so that a full pipe cannot stall the command.
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = read(Box::new(child.stdout.take().expect("piped")));
    let stderr = read(Box::new(child.stderr.take().expect("piped")));
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for inbox-admin") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("inbox-admin {args:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = Output {
        status,
        stdout: stdout.join().expect("stdout read"),
        stderr: stderr.join().expect("stderr read"),
    };
    (output, started.elapsed())
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
