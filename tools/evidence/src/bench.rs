//! `evidence bench`: the consumer's throughput beside the limits of its parts, in one run.
//!
//! For each broker: the broker alone (consume and ack, an in-memory store, no database), then
//! every configuration (variant b or c, per-message or batch handler, batch size, lanes) on a
//! freshly filled queue, topic or stream; and once, the database alone (the claim and the batch
//! handler's SQL from a generator, no broker). A consumer is timed from its first applied message
//! to its last, so group joins and publishing are left out.

use inbox_admin::progress;
use inbox_core::Transaction as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_conformance::wallet::{self, BatchCredit, CreditEvent};
use inbox_conformance::{TestBroker, TestDb};
use inbox_core::{BatchItem, BoxError, ConsumerBinding, InboxStore, MessageId, OutgoingMessage};
use inbox_postgres::PgInbox;
use serde_json::json;
use tokio::sync::oneshot;

use crate::brokers::{self, with_broker, Broker};
use crate::cli::{
    positive, BrokerKind, ConsumerSpec, HandlerKind, KafkaImpl, Variant, KAFKA_IMPL_HELP,
    KAFKA_IMPL_LONG_HELP,
};
use crate::kill;

/// The flags of `bench`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchSettings {
    /// Brokers to measure.
    #[arg(
        long,
        alias = "broker",
        value_delimiter = ',',
        value_name = "BROKER,…",
        default_value = "kafka,redis,rabbitmq"
    )]
    pub(crate) brokers: Vec<BrokerKind>,
    /// Events per run at batch sizes above 1.
    #[arg(long, value_name = "N", default_value = "200000", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) events: u32,
    /// Events per run at batch size 1 (a transaction per message is ~100× slower).
    #[arg(long, value_name = "N", default_value = "5000")]
    pub(crate) events_at_batch_1: u32,
    /// Messages per transaction.
    #[arg(long, value_delimiter = ',', value_name = "N,…", default_value = "1,100,1000", value_parser = positive)]
    pub(crate) batches: Vec<usize>,
    /// The per-message handler, the set-based batch handler, or both.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "message|batch,…",
        default_value = "message,batch"
    )]
    pub(crate) handlers: Vec<HandlerKind>,
    /// Variants to compare: b, c or both.
    #[arg(long, value_delimiter = ',', value_name = "b|c,…", default_value = "b,c", value_parser = b_or_c)]
    pub(crate) variants: Vec<Variant>,
    /// Lanes (`Consumer::parallel_lanes`): Kafka partitions side by side; on a queue or a stream,
    /// messages spread over that many transactions in no order.
    #[arg(long, value_delimiter = ',', value_name = "N,…", default_value = "1,6", value_parser = positive)]
    pub(crate) lanes: Vec<usize>,
    /// Consumer processes in one group (`evidence consume` children, started before the events
    /// are published), timed together from the first applied message to the last. Without it,
    /// one consumer runs in this process.
    #[arg(long, value_delimiter = ',', value_name = "N,…", value_parser = positive)]
    pub(crate) processes: Vec<usize>,
    /// Accounts the events credit.
    #[arg(long, value_name = "N", default_value = "1000", value_parser = clap::value_parser!(i64).range(1..))]
    pub(crate) accounts: i64,
    #[arg(long, value_name = "tansu|mock", default_value = "tansu", help = KAFKA_IMPL_HELP, long_help = KAFKA_IMPL_LONG_HELP)]
    pub(crate) kafka_impl: KafkaImpl,
}

fn b_or_c(value: &str) -> Result<Variant, String> {
    match value.parse()? {
        v @ (Variant::B | Variant::C) => Ok(v),
        _ => Err("bench compares b and c only".into()),
    }
}

/// One measured configuration.
#[derive(Debug, Clone)]
struct Row {
    broker: String,
    /// `b`, `c`, or a limit: `broker alone`, `database alone`.
    variant: String,
    handler: &'static str,
    batch: usize,
    lanes: usize,
    /// Consumer processes, when they ran as children (`--processes`).
    processes: Option<usize>,
    events: u64,
    seconds: f64,
    peak_rss_mb: f64,
}

impl Row {
    /// The row of `spec`'s consumer, not measured yet: the broker alone where it has no
    /// database.
    fn of(spec: &ConsumerSpec) -> Self {
        let alone = spec.no_database;
        Self {
            broker: spec.broker.to_string(),
            variant: if alone {
                "broker alone"
            } else {
                spec.variant.name()
            }
            .to_owned(),
            handler: if alone { "none" } else { spec.handler.name() },
            batch: spec.batch.unwrap_or(1),
            lanes: spec.lanes,
            processes: None,
            events: 0,
            seconds: 0.0,
            peak_rss_mb: 0.0,
        }
    }

    /// What the progress bars call the configuration.
    fn label(&self) -> String {
        match self.variant.len() {
            1 => format!(
                "{} {} batch {} lanes {}",
                self.variant, self.handler, self.batch, self.lanes
            ),
            _ => self.variant.clone(),
        }
    }

    fn rate(&self) -> f64 {
        if self.seconds > 0.0 {
            self.events as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// The limits a row is compared with.
#[derive(Debug, Default)]
struct Limits {
    database: Vec<Row>,
    broker: Option<Row>,
}

impl Limits {
    /// The database-alone rate at `batch` (or the nearest batch size measured).
    fn database(&self, batch: usize) -> Option<f64> {
        self.database
            .iter()
            .min_by_key(|r| r.batch.abs_diff(batch))
            .map(Row::rate)
    }
}

pub(crate) async fn run(s: &BenchSettings) -> Result<(), BoxError> {
    println!(
        "wallet bench: {} events per run ({} at batch size 1), timed from the first applied \
         message to the last; peak RSS is this process's, reset before each run",
        s.events, s.events_at_batch_1
    );
    let mut rows = Vec::new();
    let mut limits = Limits::default();
    let mut runs = Runs::new(s);
    for &batch in &[100, 1000] {
        let row = database_alone(s, batch, &runs.next()).await?;
        print_row(&row, &limits, None);
        limits.database.push(row.clone());
        rows.push(row);
    }
    for &kind in &s.brokers {
        if brokers::left_out(kind, false)? {
            runs.total -= Runs::per_broker(s);
            continue;
        }
        with_broker!(kind, s.kafka_impl, |broker| {
            on_broker(broker, s, &mut limits, &mut rows, &mut runs).await?;
        });
    }
    println!();
    for row in &rows {
        println!("{}", json_line(row, &limits));
    }
    Ok(())
}

/// The broker alone, then every configuration of `s`, on `broker`: each row printed, kept in
/// `rows`, the broker-alone one in `limits`.
async fn on_broker<B: TestBroker>(
    broker: &Broker<B>,
    s: &BenchSettings,
    limits: &mut Limits,
    rows: &mut Vec<Row>,
    runs: &mut Runs,
) -> Result<(), BoxError> {
    let consumer = |variant, batch, lanes, handler| ConsumerSpec {
        batch: Some(batch),
        lanes,
        handler,
        work: Duration::ZERO,
        ..ConsumerSpec::new(broker.kind(), variant, "", "")
    };
    // The same consumer at batch size 1000 with an in-memory store and a handler that only
    // counts, so what is left is receiving and acking.
    let broker_alone = ConsumerSpec {
        no_database: true,
        ..consumer(Variant::B, 1000, 1, HandlerKind::Batch)
    };
    let alone = timed_run(
        broker,
        &events(s, s.events),
        &runs.next(),
        broker_alone,
        None,
    )
    .await?;
    print_row(&alone, limits, None);
    limits.broker = Some(alone.clone());
    rows.push(alone);
    // One consumer in this process, or each count of consumer processes in turn.
    let processes: Vec<Option<usize>> = match &s.processes[..] {
        [] => vec![None],
        counts => counts.iter().copied().map(Some).collect(),
    };
    for &batch in &s.batches {
        let n = if batch == 1 {
            s.events_at_batch_1
        } else {
            s.events
        };
        let events = events(s, n);
        for &lane_count in &s.lanes {
            for &handler in &s.handlers {
                let mut b_rate = None;
                for &variant in &s.variants {
                    let spec = consumer(variant, batch, lane_count, handler);
                    for &processes in &processes {
                        let (run, spec) = (runs.next(), spec.clone());
                        let row = timed_run(broker, &events, &run, spec, processes).await?;
                        print_row(&row, limits, b_rate);
                        if variant == Variant::B {
                            b_rate = Some(row.rate());
                        }
                        rows.push(row);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Runs done and planned, for the progress bars' labels.
#[derive(Debug)]
struct Runs {
    done: usize,
    total: usize,
}

impl Runs {
    fn new(s: &BenchSettings) -> Self {
        Self {
            done: 0,
            total: 2 + s.brokers.len() * Self::per_broker(s),
        }
    }

    /// Runs on one broker: the broker alone, then every configuration.
    fn per_broker(s: &BenchSettings) -> usize {
        1 + s.batches.len()
            * s.lanes.len()
            * s.handlers.len()
            * s.variants.len()
            * s.processes.len().max(1)
    }

    /// `run 3/26` for the next run.
    fn next(&mut self) -> String {
        self.done += 1;
        format!("run {}/{}", self.done, self.total)
    }
}

/// Credit event `i` of the bench: 1 to each account in turn.
fn credit(s: &BenchSettings, i: u32) -> (OutgoingMessage, CreditEvent) {
    let event = CreditEvent::new(i64::from(i) % s.accounts + 1, 1);
    (brokers::credit(i, &event), event)
}

fn events(s: &BenchSettings, n: u32) -> Vec<OutgoingMessage> {
    (0..n).map(|i| credit(s, i).0).collect()
}

/// Runs `consumer` on a fresh queue and schema until every one of `events` is applied, timed
/// from the first applied message to the last: in this process, started once the events are
/// published; or as `processes` consumer processes in one group, started before the events are
/// published and followed through the ledger (polled every 20 ms). Their group joins are behind
/// them; a Kafka rebalance as the last ones get partitions may not be.
async fn timed_run<B: TestBroker>(
    broker: &Broker<B>,
    events: &[OutgoingMessage],
    run: &str,
    consumer: ConsumerSpec,
    processes: Option<usize>,
) -> Result<Row, BoxError> {
    let name = broker.create("bench").await?;
    let db = TestDb::new().await;
    let consumer = ConsumerSpec {
        name: name.clone(),
        schema: db.schema.clone(),
        ..consumer
    };
    let row = Row {
        processes,
        ..Row::of(&consumer)
    };
    let mut label = format!("{} {}", broker.kind(), row.label());
    let mut children = Vec::new();
    if let Some(processes) = processes {
        label.push_str(&format!(" processes {processes}"));
        for member in 0..processes {
            let member = ConsumerSpec {
                member,
                ..consumer.clone()
            };
            children.push(kill::spawn_ready(&member.to_args(), &[], &mut 0).await?);
        }
        // Long enough for the group to settle with every member (a join waits for the others to
        // rejoin, up to their poll interval).
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    broker.publish(&name, events).await?;
    let progress = Arc::new(Progress::default());
    let n = events.len() as u64;
    let bar = progress::Progress::bar(format!("bench {run}: {label}"), n, "msgs", "consumed");
    reset_peak_rss();
    let (stop, stopped) = oneshot::channel::<()>();
    let mut shutdown: crate::consume::Shutdown = Box::pin(async {
        let _ = stopped.await;
    });
    let consume = async {
        if processes.is_none() {
            let progress = Some(Arc::clone(&progress));
            let stats = crate::consume::consume(broker, &consumer, &db, progress, shutdown).await?;
            return Ok(format!(" ({stats:?})"));
        }
        let mut seen = 0;
        loop {
            let rows = wallet::summary(&db).await?.ledger_rows;
            if rows > seen {
                progress.add((rows - seen) as u64);
                seen = rows;
            }
            tokio::select! {
                () = &mut shutdown => return Ok::<_, BoxError>(String::new()),
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    };
    let waiting = async {
        let done = progress.wait_for(n, Duration::from_secs(120), &bar).await;
        let _ = stop.send(());
        done
    };
    let (stats, done) = tokio::join!(consume, waiting);
    let stats = stats?;
    bar.finish();
    for child in &mut children {
        kill::stop(child).await;
    }
    let seconds = done.map_err(|applied| {
        format!("{label}: {applied} of {n} applied, then nothing for 120 s{stats}")
    })?;
    db.drop().await;
    broker.remove(&name).await;
    Ok(Row {
        events: n,
        seconds,
        peak_rss_mb: peak_rss_mb(),
        ..row
    })
}

/// The database alone: transactions of `batch` events from a generator, each the claim plus the
/// batch handler's statement and the store's commit, on one connection.
async fn database_alone(s: &BenchSettings, batch: usize, run: &str) -> Result<Row, BoxError> {
    let db = TestDb::new().await;
    let inbox: PgInbox = db.inbox().bind(&ConsumerBinding::new("wallet"));
    let n = s.events as usize;
    let decoded: Vec<(MessageId, inbox_core::Message, CreditEvent)> = (0..s.events)
        .map(|i| {
            let (e, event) = credit(s, i);
            (
                e.id.clone(),
                inbox_core::Message::new(Ok(e.id), e.payload),
                event,
            )
        })
        .collect();
    let label = format!("bench {run}: postgres database alone batch {batch}");
    let bar = progress::Progress::bar(label, n as u64, "msgs", "consumed");
    reset_peak_rss();
    let started = Instant::now();
    for (i, chunk) in decoded.chunks(batch).enumerate() {
        let ids: Vec<MessageId> = chunk.iter().map(|(id, _, _)| id.clone()).collect();
        let mut tx = inbox.begin().await?;
        let claimed = inbox.claim(&mut tx, &ids).await?;
        let items: Vec<BatchItem<'_, CreditEvent>> = chunk
            .iter()
            .zip(&claimed)
            .filter(|(_, new)| **new)
            .map(|((id, message, event), _)| BatchItem {
                id,
                message,
                item: event,
            })
            .collect();
        inbox_core::BatchHandler::handle_batch(&BatchCredit, &mut tx, &items)
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await?;
        bar.set_position((i * batch + chunk.len()) as u64);
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish();
    db.drop().await;
    Ok(Row {
        broker: "postgres".into(),
        variant: "database alone".into(),
        handler: "batch",
        batch,
        lanes: 1,
        processes: None,
        events: n as u64,
        seconds,
        peak_rss_mb: peak_rss_mb(),
    })
}

/// Messages applied so far, and when the first and the latest were.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    applied: AtomicU64,
    span: Mutex<Option<(Instant, Instant)>>,
}

impl Progress {
    /// Counts `n` messages applied now.
    pub(crate) fn add(&self, n: u64) {
        let now = Instant::now();
        let mut span = inbox_testkit::lock(&self.span);
        *span = Some(match *span {
            Some((first, _)) => (first, now),
            None => (now, now),
        });
        self.applied.fetch_add(n, Ordering::Relaxed);
    }

    /// Waits until `n` are applied: the seconds from the first to the last, or the count reached
    /// when nothing moved for `stall`.
    async fn wait_for(
        &self,
        n: u64,
        stall: Duration,
        bar: &progress::Progress,
    ) -> Result<f64, u64> {
        let mut last = (0, Instant::now());
        loop {
            let applied = self.applied.load(Ordering::Relaxed);
            bar.set_position(applied);
            if applied >= n {
                let span = *inbox_testkit::lock(&self.span);
                return Ok(span.map_or(0.0, |(first, end)| (end - first).as_secs_f64()));
            }
            if applied != last.0 {
                last = (applied, Instant::now());
            } else if last.1.elapsed() > stall {
                return Err(applied);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Resets the kernel's peak-RSS mark of this process (Linux: `clear_refs` 5).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// This process's peak RSS since the last reset, in MB (0 where /proc has none).
fn peak_rss_mb() -> f64 {
    status_kb("self", "VmHWM").map_or(0.0, |kb| kb as f64 / 1024.0)
}

/// A figure in kB of `/proc/<process>/status` (`process`: `self` or a pid), such as `VmRSS`.
pub(crate) fn status_kb(process: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{process}/status")).ok()?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    line.trim().trim_end_matches("kB").trim().parse().ok()
}

fn print_row(row: &Row, limits: &Limits, b_rate: Option<f64>) {
    // Only consumer rows (variant b or c) are compared with the limits.
    let consumer = row.variant.len() == 1;
    let of_db = limits
        .database(row.batch)
        .filter(|_| consumer)
        .map_or("-".into(), |l| format!("{:.0}%", 100.0 * row.rate() / l));
    let of_broker = limits
        .broker
        .as_ref()
        .filter(|b| consumer && b.broker == row.broker)
        .map_or("-".into(), |b| {
            format!("{:.0}%", 100.0 * row.rate() / b.rate())
        });
    let c_over_b = b_rate
        .filter(|_| row.variant == "c")
        .map_or("-".into(), |b| format!("{:.2}", row.rate() / b));
    println!(
        "{:<9} {:<15} {:<8} batch {:>5} lanes {:>2}{} {:>8} events {:>9.0} msgs/s  c/b {:>5}  of db {:>5}  of broker {:>5}  peak RSS {:>9}",
        row.broker,
        row.variant,
        row.handler,
        row.batch,
        row.lanes,
        row.processes.map_or(String::new(), |p| format!(" processes {p}")),
        row.events,
        row.rate(),
        c_over_b,
        of_db,
        of_broker,
        // A child's memory is its own: measured here only for a consumer in this process.
        if row.processes.is_some() {
            "-".to_owned()
        } else {
            format!("{:.1} MB", row.peak_rss_mb)
        }
    );
}

fn json_line(row: &Row, limits: &Limits) -> String {
    json!({
        "broker": row.broker,
        "variant": row.variant,
        "handler": row.handler,
        "batch": row.batch,
        "lanes": row.lanes,
        "processes": row.processes,
        "events": row.events,
        "seconds": row.seconds,
        "msgs_per_s": row.rate(),
        "database_alone_msgs_per_s": limits.database(row.batch),
        "broker_alone_msgs_per_s": limits.broker.as_ref().filter(|b| b.broker == row.broker).map(Row::rate),
        "peak_rss_mb": row.processes.is_none().then_some(row.peak_rss_mb),
    })
    .to_string()
}
