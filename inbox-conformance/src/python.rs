//! Another ecosystem's producers: each broker's standard Python client (confluent-kafka, pika,
//! boto3, redis-py, nats-py) in a virtual environment of the tests' own, and a script that
//! publishes with them ([`publish`]).
//!
//! The environment is made on first use (`python3 -m venv`, then `pip install` of
//! `python/requirements.txt`), at `INBOX_PYTHON_CLIENTS`, else `$XDG_CACHE_HOME/inbox/python-clients`
//! (`~/.cache/inbox/python-clients`); `cargo xtask services` makes the same one ahead of the
//! tests. A copy of the requirements in it says what it holds: a changed list installs again.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use tokio::sync::OnceCell;

use crate::child::succeeded;

/// The pinned clients, one a line.
pub const REQUIREMENTS: &str = include_str!("../python/requirements.txt");

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python/publish.py");

/// Where the environment is: `INBOX_PYTHON_CLIENTS`, else under the user's cache directory.
pub fn clients_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("INBOX_PYTHON_CLIENTS").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("inbox").join("python-clients")
}

/// The environment's interpreter, made and filled first where it is missing or out of date.
///
/// # Panics
/// When `python3 -m venv` or `pip install` fails, with their output and the fix.
pub async fn interpreter() -> PathBuf {
    static READY: OnceCell<PathBuf> = OnceCell::const_new();
    READY.get_or_init(prepare).await.clone()
}

async fn prepare() -> PathBuf {
    let dir = clients_dir();
    let python = dir.join("bin").join("python");
    let stamp = dir.join("requirements.txt");
    let current = std::fs::read_to_string(&stamp).is_ok_and(|s| s == REQUIREMENTS);
    if current && python.exists() {
        return python;
    }
    println!("installing the Python clients into {}", dir.display());
    run(
        Command::new("python3").arg("-m").arg("venv").arg(&dir),
        "python3 -m venv (on Debian or Ubuntu: apt-get install python3-venv)",
    )
    .await;
    let requirements = dir.join("requirements.in");
    std::fs::write(&requirements, REQUIREMENTS).expect("write the requirements");
    run(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(["--disable-pip-version-check", "-r"])
            .arg(&requirements),
        "pip install of python/requirements.txt (is PyPI reachable?)",
    )
    .await;
    std::fs::write(&stamp, REQUIREMENTS).expect("write the requirements stamp");
    python
}

async fn run(command: &mut Command, what: &str) {
    let out = command
        .output()
        .await
        .unwrap_or_else(|e| panic!("{what}: cannot start it: {e}"));
    succeeded(&out, what);
}

/// Publishes `messages` to `target` with the broker's Python client (see
/// `python/publish.py` for both shapes), and waits until the broker has confirmed them all.
///
/// # Panics
/// When the script fails, with its output.
pub async fn publish(target: &serde_json::Value, messages: &[serde_json::Value]) {
    let python = interpreter().await;
    let job = serde_json::json!({ "target": target, "messages": messages });
    let mut child = Command::new(python)
        .arg(SCRIPT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start python/publish.py");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(job.to_string().as_bytes())
        .await
        .expect("hand the messages to python/publish.py");
    drop(stdin);
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        child.wait_with_output(),
    )
    .await
    .expect("python/publish.py did not finish within 120 s")
    .expect("python/publish.py");
    succeeded(&out, &format!("python/publish.py for {target}"));
}
