//! Runs the `evidence` binary as a user would and reads its JSON lines.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used, unreachable_pub)]

use std::process::Command;

use serde_json::Value;

/// Runs `evidence <args>`, fails the test with its output unless it succeeds, and returns the
/// JSON lines it printed.
pub fn evidence(args: &[&str]) -> Vec<Value> {
    let output = Command::new(env!("CARGO_BIN_EXE_evidence"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "evidence {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The one JSON line whose `key` is `value`.
pub fn one<'a>(lines: &'a [Value], key: &str, value: &str) -> &'a Value {
    let found: Vec<&Value> = lines.iter().filter(|l| l[key] == value).collect();
    assert_eq!(
        found.len(),
        1,
        "one JSON line with {key} {value}: {lines:?}"
    );
    found[0]
}
