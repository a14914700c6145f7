//! `kafka-mock`: librdkafka's mock cluster as a process of its own, a second Kafka-protocol broker
//! for the tests next to the one `cargo xtask services` starts.
//!
//! ```text
//! cargo run -p inbox-evidence --bin kafka-mock -- --address-file target/kafka-mock.addr &
//! KAFKA_BROKERS=$(cat target/kafka-mock.addr) cargo run -p inbox-evidence -- \
//!     kill-test --brokers kafka --kafka-impl mock
//! ```
//!
//! The mock (librdkafka's `rd_kafka_mock_cluster`) serves produce, fetch (from any offset, in the
//! middle of a record batch too), consumer groups with offset commits, metadata and list-offsets,
//! on 127.0.0.1 ports of its choosing. It has no admin API (a `CreateTopics` request times out),
//! so topics come from `--topic NAME:PARTITIONS` at start, from a `create-topic NAME PARTITIONS`
//! line sent to `--control ADDR`, or are created on first use (a metadata request that allows
//! it, as producers send) with librdkafka's fixed default of 4 partitions. Everything lives in
//! memory and is gone when the process ends.

use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Duration;

use clap::Parser;
use inbox_kafka::rdkafka::mocking::MockCluster;
use inbox_kafka::rdkafka::producer::DefaultProducerContext;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// librdkafka's mock Kafka cluster on TCP, until SIGTERM or Ctrl-C.
///
/// Prints the bootstrap servers (one line, comma-separated) on stdout once it listens. Topics:
/// `--topic`, or created on first use with 4 partitions (the mock has no CreateTopics).
#[derive(Debug, Parser)]
#[command(name = "kafka-mock", version)]
struct Args {
    /// Brokers in the cluster. Consumer groups work with 1 and with 3; with 3 the partition
    /// leaders and the group coordinator are spread over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=16))]
    brokers: i32,
    /// Also write the bootstrap servers to this file (replaced atomically once the cluster
    /// listens), for scripts that start the mock in the background.
    #[arg(long, value_name = "PATH")]
    address_file: Option<PathBuf>,
    /// A topic to create at start, `NAME:PARTITIONS`; repeat for more.
    #[arg(long = "topic", value_name = "NAME:PARTITIONS", value_parser = topic)]
    topics: Vec<(String, i32)>,
    /// Also listen here for lines `create-topic NAME PARTITIONS` (answered `ok` or `error: …`),
    /// the CreateTopics the mock lacks; the evidence tool uses it when KAFKA_MOCK_CONTROL names it.
    #[arg(long, value_name = "HOST:PORT")]
    control: Option<String>,
}

fn topic(value: &str) -> Result<(String, i32), String> {
    let (name, partitions) = value
        .rsplit_once(':')
        .ok_or("use NAME:PARTITIONS, e.g. credits:6")?;
    let partitions: i32 = partitions
        .parse()
        .map_err(|e| format!("partitions `{partitions}`: {e}"))?;
    if name.is_empty() || partitions < 1 {
        return Err("a topic needs a name and at least 1 partition".into());
    }
    Ok((name.to_owned(), partitions))
}

// The mock cluster is not `Send`: one thread holds it (its brokers run on librdkafka's threads).
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kafka-mock: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mock = MockCluster::new(args.brokers)
        .map_err(|e| format!("starting a mock cluster of {} brokers: {e}", args.brokers))?;
    for (name, partitions) in &args.topics {
        mock.create_topic(name, *partitions, args.brokers.min(3))
            .map_err(|e| format!("creating topic `{name}`: {e}"))?;
    }
    let servers = mock.bootstrap_servers();
    if let Some(path) = &args.address_file {
        // Written whole, then renamed: a reader polling for the file never sees half a line.
        let partial = path.with_extension("partial");
        std::fs::write(&partial, format!("{servers}\n"))
            .and_then(|()| std::fs::rename(&partial, path))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let control = match &args.control {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .map_err(|e| format!("listening for control lines on {address}: {e}"))?,
        ),
        None => None,
    };
    println!("{servers}");
    eprintln!(
        "kafka-mock: {} broker(s) at {servers}; SIGTERM or Ctrl-C stops it",
        args.brokers
    );
    let stop = stopped();
    tokio::pin!(stop);
    loop {
        let accepted = async {
            match &control {
                Some(listener) => listener.accept().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = &mut stop => break result?,
            accepted = accepted => match accepted {
                // One connection at a time: the cluster handle stays on this thread.
                Ok((stream, _)) => serve(stream, &mock, args.brokers).await,
                Err(e) => eprintln!("kafka-mock: accepting a control connection: {e}"),
            },
        }
    }
    if let Some(path) = &args.address_file {
        let _ = std::fs::remove_file(path);
    }
    drop(mock);
    Ok(())
}

/// Answers the control lines of one connection, until it closes or is idle for 10 s.
async fn serve(stream: TcpStream, mock: &MockCluster<'_, DefaultProducerContext>, brokers: i32) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Ok(Some(line))) =
        tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await
    {
        let answer = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["create-topic", name, partitions] => match partitions.parse::<i32>() {
                Ok(partitions) if partitions >= 1 => {
                    match mock.create_topic(name, partitions, brokers.min(3)) {
                        Ok(()) => "ok".to_owned(),
                        Err(e) => format!("error: creating topic `{name}`: {e}"),
                    }
                }
                _ => format!("error: `{partitions}` is not a partition count of 1 or more"),
            },
            _ => format!("error: unknown command `{line}`; use `create-topic NAME PARTITIONS`"),
        };
        if write
            .write_all(format!("{answer}\n").as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
async fn stopped() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => Ok(()),
            result = tokio::signal::ctrl_c() => result,
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}
