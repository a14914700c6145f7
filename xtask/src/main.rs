//! Project tasks, run as `cargo xtask <task>`:
//!
//! - `services`: installs what is missing and starts what is not running: PostgreSQL, MariaDB,
//!   Redis, RabbitMQ, NATS with JetStream, a Kafka-protocol broker (Tansu) and an SQS endpoint
//!   (moto), and each broker's standard Python client in a virtual environment (the foreign-ID
//!   tests publish with them), and `promtool` (Debian's `prometheus` package, whose server it
//!   does not leave running). A
//!   service already listening at its address is reused and never stopped. Safe to run twice.
//! - `test`: `services` with the workspace's test build beside the installs, then
//!   `cargo fmt --check`, `cargo clippy --all-targets -D warnings`, `cargo doc` with broken links
//!   refused, and the whole test suite. Then two lines side by side: the doc tests, the store's
//!   suite (`inbox-postgres`) again on the partitioned inbox layout
//!   (`INBOX_TEST_LAYOUT=partitioned`) and one broker's suite with the store behind PgBouncer;
//!   and the examples (`examples/examples/*.rs`) against the services, the demo on NATS,
//!   `promtool check rules` and `promtool test rules` on the alert rules (`docs/alerts`) and
//!   `cargo package` for every library crate.
//! - `demo`: the services with the evidence tool's build beside the installs, then its wallet demo
//!   (extra arguments go to it). Where no Kafka broker listens and Tansu is not built yet, the
//!   demo's Kafka is librdkafka's mock cluster (the `kafka-mock` program), started for the demo
//!   and stopped after it, rather than a wait of several minutes for Tansu to compile.

mod services;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// The programs users copy, one per broker, the second store, a foreign producer's messages,
/// then the side effects outside the database and a dead-letter replay: each fails when an
/// effect is lost or applied twice.
const EXAMPLES: [&str; 10] = [
    "kafka",
    "sqs",
    "rabbitmq",
    "redis_streams",
    "nats",
    "mysql",
    "cloud_events",
    "effect_call",
    "outbox",
    "replay",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("services") => services::up(None),
        Some("test") => test(&args[1..]),
        Some("demo") => demo(&args[1..]),
        _ => Err(
            "usage: cargo xtask services | test [cargo test args] | demo [evidence demo args]"
                .into(),
        ),
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
    services::up(Some(&["test", "--workspace", "--no-run", "--quiet"]))?;
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    // The API docs build without a broken link.
    cargo_with(
        &["doc", "--workspace", "--no-deps", "--quiet"],
        &[("RUSTDOCFLAGS", "-D warnings")],
        None,
    )?;
    // nextest runs the test binaries' tests side by side, each in a process of its own
    // (`.config/nextest.toml` says which run alone); the doc tests are cargo's.
    services::nextest()?;
    let mut args = vec!["nextest", "run", "--workspace"];
    args.extend(extra.iter().map(String::as_str));
    cargo(&args)?;
    after_main_pass(extra)
}

/// The rest, in two lines side by side: the doc tests and the two passes over the store (each
/// test in a schema or stream of its own); and the examples, the demo, the alert rules and the
/// packaging, run from the programs the test build made (not `cargo run`, so that no build in
/// the first line replaces a binary the second runs), their output printed when both end.
fn after_main_pass(extra: &[String]) -> Result<(), String> {
    let programs_dir = built_programs()?;
    let programs = Line::start(
        "the examples, the demo, the alert rules and the packaging",
        move |log| programs(&programs_dir, log),
    );
    store_passes(extra).and(programs.finish())
}

/// Work on a thread of its own, its output in a log printed when it ends.
struct Line {
    what: &'static str,
    log: PathBuf,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

impl Line {
    fn start(
        what: &'static str,
        work: impl FnOnce(&std::fs::File) -> Result<(), String> + Send + 'static,
    ) -> Self {
        static LINES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = LINES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = std::env::temp_dir().join(format!("inbox-xtask-{}-{n}.log", std::process::id()));
        let file = std::fs::File::create(&log);
        let thread = std::thread::spawn(move || {
            work(&file.map_err(|e| format!("cannot create the log of {what}: {e}"))?)
        });
        Self { what, log, thread }
    }

    fn finish(self) -> Result<(), String> {
        let result = self
            .thread
            .join()
            .unwrap_or_else(|_| Err(format!("the line of {} panicked", self.what)));
        let printed = std::fs::read_to_string(&self.log).unwrap_or_default();
        eprintln!("xtask: {}:\n{printed}", self.what);
        let _ = std::fs::remove_file(&self.log);
        result
    }
}

/// The examples and the evidence tool as the workspace's test build made them, hard-linked into
/// a directory of their own: a later build may replace the originals, never these.
fn built_programs() -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--quiet",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo test --no-run failed ({})", out.status));
    }
    let mut dir = None;
    let mut wanted: Vec<&str> = EXAMPLES.iter().copied().chain(["evidence"]).collect();
    for line in out.stdout.split(|&b| b == b'\n') {
        let Ok(artifact) = serde_json::from_slice::<serde_json::Value>(line) else {
            continue;
        };
        let target = &artifact["target"];
        let kind = target["kind"][0].as_str().unwrap_or_default();
        let name = target["name"].as_str().unwrap_or_default();
        let program = match (kind, artifact["profile"]["test"].as_bool()) {
            ("example", Some(false)) => EXAMPLES.contains(&name),
            ("bin", Some(false)) => name == "evidence",
            _ => false,
        };
        let Some(executable) = artifact["executable"].as_str().filter(|_| program) else {
            continue;
        };
        let executable = Path::new(executable);
        let dir = dir.get_or_insert_with(|| {
            executable
                .ancestors()
                .find(|a| a.file_name().is_some_and(|n| n == "debug"))
                .unwrap_or(executable)
                .join("xtask-programs")
        });
        std::fs::create_dir_all(&*dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::fs::hard_link(executable, &link).map_err(|e| {
            format!(
                "linking {} to {}: {e}",
                executable.display(),
                link.display()
            )
        })?;
        wanted.retain(|w| *w != name);
    }
    match (dir, wanted.is_empty()) {
        (Some(dir), true) => Ok(dir),
        _ => Err(format!(
            "the test build made no program named {}",
            wanted.join(", ")
        )),
    }
}

/// The doc tests, the store's suite on the partitioned layout and one broker's suite behind
/// PgBouncer.
fn store_passes(extra: &[String]) -> Result<(), String> {
    cargo(&["test", "--workspace", "--doc", "--quiet"])?;
    // Both inbox layouts pass the store's whole suite: the second pass puts every test inbox of
    // `inbox-postgres` in the partitioned one.
    // Selected with a filter over the workspace, not `-p`: the dependencies keep the features
    // the workspace build gave them, so nothing is compiled again.
    let mut args = vec![
        "nextest",
        "run",
        "--profile",
        "partitioned",
        "--workspace",
        "-E",
        "package(inbox-postgres)",
    ];
    args.extend(extra.iter().map(String::as_str));
    cargo_with(&args, &[("INBOX_TEST_LAYOUT", "partitioned")], None)?;
    // The store behind PgBouncer in transaction mode: one broker's whole suite, the hard kill
    // among it, with every inbox transaction through the pooler and the checks straight to the
    // database (`inbox_conformance::TestDb`).
    let pooler = std::env::var("INBOX_PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:6432/inbox".into());
    let mut args = vec![
        "nextest",
        "run",
        "--profile",
        "pooler",
        "--workspace",
        "-E",
        "package(inbox-redis-streams) & test(/^conformance::/)",
    ];
    args.extend(extra.iter().map(String::as_str));
    cargo_with(&args, &[("INBOX_TEST_POOLER_URL", pooler.as_str())], None)
}

/// The examples against the services, the demo on the newest broker, the alert rules and the
/// packaging, each writing to `log`.
fn programs(dir: &Path, log: &std::fs::File) -> Result<(), String> {
    let env = example_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for example in EXAMPLES {
        run(&dir.join(example), &[], &env, Some(log))?;
    }
    // The demo on the newest broker, as `cargo xtask demo` runs it on all five: it fails unless
    // variant c applied every credit once.
    let demo = ["demo", "--brokers", "nats", "--require-brokers", "true"];
    run(&dir.join("evidence"), &demo, &env, Some(log))?;
    alert_rules(log)?;
    // Every library crate packages (its manifest, its files, the versions of its workspace
    // dependencies). Without verifying: that would build each package and all its
    // dependencies once more, from scratch, for the same code `cargo test` just built.
    cargo_with(
        &[
            "package",
            "--workspace",
            "--no-verify",
            "--allow-dirty",
            "--exclude",
            "inbox-examples",
            "--exclude",
            "inbox-evidence",
            "--exclude",
            "xtask",
        ],
        &[],
        Some(log),
    )
}

/// The alert rules load in Prometheus (`promtool check rules`) and each fires, with its labels
/// and annotations, on the series of its unit tests and not on the others (`promtool test
/// rules`).
fn alert_rules(log: &std::fs::File) -> Result<(), String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for args in [
        ["check", "rules", "docs/alerts/inbox.rules.yml"],
        ["test", "rules", "docs/alerts/inbox.rules.test.yml"],
    ] {
        let command = format!("promtool {}", args.join(" "));
        say(Some(log), &format!("xtask: {command}"));
        let status = Command::new("promtool")
            .args(args)
            .current_dir(&root)
            .stdout(output(log)?)
            .stderr(output(log)?)
            .status()
            .map_err(|e| {
                format!("cannot run promtool (`cargo xtask services` installs it): {e}")
            })?;
        if !status.success() {
            return Err(format!("{command} failed ({status})"));
        }
    }
    Ok(())
}

/// What the examples need beyond the environment. They find their brokers as a user's program
/// does, with no local default: Kafka from `KAFKA_BROKERS`, Redis from `REDIS_URL`, RabbitMQ
/// from `AMQP_URL`, and SQS through the AWS SDK's own chain. Where the environment names none,
/// these name the services `services` starts (and moto's dummy credentials); set any of them to
/// run an example against another broker, or the SQS example against AWS.
fn example_env() -> Vec<(&'static str, String)> {
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    let mut env = Vec::new();
    for (name, local) in [
        ("KAFKA_BROKERS", "127.0.0.1:9092"),
        ("REDIS_URL", "redis://127.0.0.1:6379"),
        ("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
        ("NATS_URL", "nats://127.0.0.1:4222"),
    ] {
        if !set(name) {
            env.push((name, local.to_owned()));
        }
    }
    if !set("AWS_ENDPOINT_URL_SQS") && !set("AWS_ENDPOINT_URL") {
        env.push(("AWS_ENDPOINT_URL_SQS", "http://127.0.0.1:4566".to_owned()));
    }
    if !set("AWS_REGION") && !set("AWS_DEFAULT_REGION") && !set("AWS_PROFILE") {
        env.push(("AWS_REGION", "us-east-1".to_owned()));
    }
    let credentials = [
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ];
    if !credentials.iter().any(|name| set(name)) {
        env.push(("AWS_ACCESS_KEY_ID", "test".to_owned()));
        env.push(("AWS_SECRET_ACCESS_KEY", "test".to_owned()));
    }
    env
}

fn demo(extra: &[String]) -> Result<(), String> {
    let build = ["build", "--quiet", "-p", "inbox-evidence", "--bins"];
    let kafka = services::up_for_demo(&build)?;
    let mut args = vec![
        "run",
        "--quiet",
        "-p",
        "inbox-evidence",
        "--bin",
        "evidence",
        "--",
        "demo",
    ];
    args.extend(extra.iter().map(String::as_str));
    match kafka {
        services::DemoKafka::Ready => cargo(&args),
        services::DemoKafka::Mock => {
            let mock = MockKafka::start()?;
            eprintln!(
                "xtask: no Kafka broker listens and Tansu is not built yet (`cargo xtask services` \
                 builds it); the demo's Kafka is librdkafka's mock cluster at {}",
                mock.servers
            );
            if !extra.iter().any(|a| a.starts_with("--kafka-impl")) {
                args.extend(["--kafka-impl", "mock"]);
            }
            let env = [
                ("KAFKA_BROKERS", mock.servers.as_str()),
                ("KAFKA_MOCK_CONTROL", mock.control.as_str()),
            ];
            cargo_with(&args, &env, None)
        }
    }
}

/// librdkafka's mock cluster in a process of its own, for the length of the demo.
struct MockKafka {
    servers: String,
    control: String,
    address_file: std::path::PathBuf,
    _process: Background,
}

impl Drop for MockKafka {
    fn drop(&mut self) {
        // Stopped with SIGKILL, the mock leaves its address file behind.
        let _ = std::fs::remove_file(&self.address_file);
    }
}

impl MockKafka {
    fn start() -> Result<Self, String> {
        let dir = std::env::temp_dir();
        let address_file = dir.join(format!("inbox-kafka-mock-{}.addr", std::process::id()));
        let address = address_file
            .to_str()
            .ok_or("the temporary directory is not UTF-8")?;
        let control = free_port()?;
        let process = Background::cargo_logged(
            &[
                "run",
                "--quiet",
                "-p",
                "inbox-evidence",
                "--bin",
                "kafka-mock",
                "--",
                "--address-file",
                address,
                "--control",
                &control,
            ],
            &dir.join("inbox-kafka-mock.log"),
        )?;
        let start = Instant::now();
        let servers = loop {
            if let Ok(text) = std::fs::read_to_string(&address_file) {
                break text.trim().to_owned();
            }
            if start.elapsed() > Duration::from_secs(120) {
                return Err("kafka-mock did not write its address within 120 s".into());
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        Ok(Self {
            servers,
            control,
            address_file,
            _process: process,
        })
    }
}

/// A `127.0.0.1` port nothing listens on now.
fn free_port() -> Result<String, String> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| format!("finding a free port: {e}"))?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    Ok(address.to_string())
}

/// A cargo command running beside this process; stopped if dropped before [`Background::wait`].
pub(crate) struct Background {
    child: Option<Child>,
    what: String,
}

impl Background {
    /// Output on this process's stdout and stderr.
    pub(crate) fn cargo(args: &[&str]) -> Result<Self, String> {
        Self::spawn(args, None)
    }

    /// Output in `log`, which the error names if it fails.
    pub(crate) fn cargo_logged(args: &[&str], log: &Path) -> Result<Self, String> {
        Self::spawn(args, Some(log))
    }

    fn spawn(args: &[&str], log: Option<&Path>) -> Result<Self, String> {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut what = format!("cargo {}", args.join(" "));
        eprintln!("xtask: {what} (in the background)");
        let mut command = Command::new(cargo);
        command.args(args).stdin(Stdio::null());
        if let Some(log) = log {
            let out = std::fs::File::create(log)
                .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
            let err = out.try_clone().map_err(|e| e.to_string())?;
            command.stdout(out).stderr(err);
            what = format!("{what} (log: {})", log.display());
        }
        let child = command
            .spawn()
            .map_err(|e| format!("cannot run {what}: {e}"))?;
        Ok(Self {
            child: Some(child),
            what,
        })
    }

    pub(crate) fn wait(mut self) -> Result<(), String> {
        let mut child = self.child.take().expect("waited once");
        let status = child
            .wait()
            .map_err(|e| format!("waiting for {}: {e}", self.what))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("{} failed ({status})", self.what))
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn cargo(args: &[&str]) -> Result<(), String> {
    cargo_with(args, &[], None)
}

/// Runs cargo with `args` and `env`, its output to the terminal or to `log`.
fn cargo_with(
    args: &[&str],
    env: &[(&str, &str)],
    log: Option<&std::fs::File>,
) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Path::new(&cargo), args, env, log)
}

/// Runs `program` with `args` and `env` in the workspace, its output to the terminal or to `log`.
fn run(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    log: Option<&std::fs::File>,
) -> Result<(), String> {
    let name = program.file_name().unwrap_or_default().to_string_lossy();
    let line = [name.as_ref()]
        .into_iter()
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    let vars: String = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    say(log, &format!("xtask: {vars}{line}"));
    let started = Instant::now();
    let mut command = Command::new(program);
    command
        .args(args)
        .envs(env.iter().copied())
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    if let Some(log) = log {
        command.stdout(output(log)?).stderr(output(log)?);
    }
    let status = command
        .status()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    say(
        log,
        &format!(
            "xtask: {line} took {:.0} s",
            started.elapsed().as_secs_f64()
        ),
    );
    if status.success() {
        Ok(())
    } else {
        Err(format!("{line} failed ({status})"))
    }
}

/// A line to stderr or to `log`.
fn say(log: Option<&std::fs::File>, line: &str) {
    match log {
        Some(mut log) => {
            use std::io::Write;
            let _ = writeln!(log, "{line}");
        }
        None => eprintln!("{line}"),
    }
}

/// A child's stdout or stderr into `log`.
fn output(log: &std::fs::File) -> Result<Stdio, String> {
    log.try_clone()
        .map(Stdio::from)
        .map_err(|e| format!("cannot share the log: {e}"))
}
