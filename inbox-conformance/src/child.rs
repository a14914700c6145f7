//! Child processes for hard-kill tests: the test binary runs again as the consumer.
//!
//! A kill test writes an `#[ignore]` test that is the consumer (it returns at once unless
//! [`is_child`]), starts it with [`spawn`], and ends it with `Child::kill()`, which is SIGKILL
//! on Unix: no destructor, no close, no last commit. Any other command a test runs and needs
//! to succeed is checked with one `succeeded`.

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// True inside a process started by [`spawn`].
pub fn is_child() -> bool {
    std::env::var_os("INBOX_CHILD").is_some()
}

/// The current test binary, to run only the ignored test `test_name`, with `envs`: what
/// [`spawn`] starts, and the kill scenario starts as a `tokio` process.
///
/// # Panics
/// When there is no current executable.
pub fn command(test_name: &str, envs: &[(&str, String)]) -> Command {
    let mut command = test_binary(test_name, "--ignored", envs);
    command.stdout(Stdio::null());
    command
}

/// The current test binary, running only `test_name` among the tests `which` (`--ignored`,
/// `--include-ignored`) selects, one thread, as a child ([`is_child`]) with `envs`.
fn test_binary(test_name: &str, which: &str, envs: &[(&str, String)]) -> Command {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("no current exe: {e}"));
    let test_name = full_name(&exe, test_name);
    let mut command = Command::new(exe);
    command
        .args(["--exact", &test_name, which])
        .args(["--nocapture", "--test-threads=1"])
        .env("INBOX_CHILD", "1")
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null());
    command
}

/// The harness's name of the one test of `exe` named `test_name`: an adapter's integration tests
/// are one binary with each file a module, so the test `name` of `f.rs` is `f::name`.
fn full_name(exe: &Path, test_name: &str) -> String {
    let listed = Command::new(exe)
        .args(["--list", "--format", "terse", "--include-ignored"])
        .output()
        .unwrap_or_else(|e| panic!("cannot list the tests of {}: {e}", exe.display()));
    let suffix = format!("::{test_name}");
    let matching: Vec<&str> = std::str::from_utf8(&listed.stdout)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .filter(|name| *name == test_name || name.ends_with(&suffix))
        .collect();
    match matching[..] {
        [name] => name.to_owned(),
        _ => panic!(
            "{} has {matching:?} for the test `{test_name}`",
            exe.display()
        ),
    }
}

/// Panics with `what` and the output when the process failed: for any command a test runs
/// that must succeed.
pub(crate) fn succeeded(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs the current test binary again with only the ignored test `test_name`, with `envs`.
///
/// # Panics
/// When the test binary cannot be started.
pub fn spawn(test_name: &str, envs: &[(&str, String)]) -> Child {
    command(test_name, envs)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start child {test_name}: {e}"))
}

/// What a test run by [`run`] printed, and whether it passed.
#[derive(Debug)]
pub struct Ran {
    /// The process exited with success and its test harness reported one test passed.
    pub passed: bool,
    /// Its stdout, then its stderr.
    pub printed: String,
}

/// Runs the current test binary's test `test_name` (ignored or not) to its end in a process of
/// its own, with `envs` on top of this process's environment: for testing what a client reads
/// from the environment, which a running test cannot change safely.
///
/// # Panics
/// When the test binary cannot be started.
pub async fn run(test_name: &str, envs: &[(&str, String)]) -> Ran {
    let command = test_binary(test_name, "--include-ignored", envs);
    let output = tokio::process::Command::from(command)
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run child {test_name}: {e}"));
    let printed = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    Ran {
        passed: output.status.success() && printed.contains("1 passed"),
        printed,
    }
}
