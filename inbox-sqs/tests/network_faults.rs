//! The network between the consumer and SQS fails while it consumes: black-holed, cut again and
//! again, refused. The consumer's client talks to the SQS endpoint through a [`FaultProxy`];
//! PostgreSQL is not touched. Each fault must end, once the network is back, with every event in
//! the ledger exactly once, every copy deleted from the queue and nothing dead-lettered, without
//! restarting the consumer.
// A test fails by panicking; an unwrap names the failed call in its message.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{counts, credit, drain};
use inbox_core::{Consumer, StatsSnapshot};
use inbox_sqs::aws_sdk_sqs::config::timeout::TimeoutConfig;
use inbox_sqs::aws_sdk_sqs::config::{Credentials, Region};
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_sqs::{Outgoing, SqsProducer, SqsSource};
use inbox_testkit::wallet::{summary, Credit, Summary};
use inbox_testkit::TestDb;
use inbox_testkit::{FaultProxy, ProxyMode};
use tokio::sync::oneshot;

const EVENTS: i64 = 300;
const SECOND: Duration = Duration::from_secs(1);
/// The timeout per attempt of the consumer's client: a black-holed call fails after this.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// The timeout per call, its retries included.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);
/// The long-poll wait, shorter than the attempt timeout as the source requires.
const WAIT: Duration = Duration::from_secs(1);
/// The queue's visibility timeout: what a lost receive or a failed delete had in flight comes
/// back after this.
const VISIBILITY_SECS: u32 = 3;
/// SQS's own redrive: far more receives than any fault here should cost a message.
const MAX_RECEIVES: u32 = 10;

/// The SQS endpoint's socket address, when it is plain HTTP (a local endpoint such as moto): the
/// proxy forwards bytes, so it cannot stand between a client and an HTTPS endpoint such as AWS.
async fn plain_http_endpoint() -> Option<SocketAddr> {
    let url = ["AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"]
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .find(|v| !v.is_empty())
        .unwrap_or_else(|| common::LOCAL_ENDPOINT.to_owned());
    let rest = url.strip_prefix("http://")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let mut addrs = tokio::net::lookup_host(&authority)
        .await
        .unwrap_or_else(|e| panic!("resolve the SQS endpoint {authority}: {e}"));
    addrs.next()
}

/// A client for the endpoint behind `proxy`, with short timeouts so a black-holed call fails
/// in seconds rather than the default 30.
async fn proxied_client(proxy: &FaultProxy) -> Client {
    let config = inbox_sqs::config_loader()
        .endpoint_url(format!("http://{}", proxy.addr()))
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(1))
                .operation_attempt_timeout(ATTEMPT_TIMEOUT)
                .operation_timeout(OPERATION_TIMEOUT)
                .build(),
        )
        .load()
        .await;
    Client::new(&config)
}

/// What one run under a fault came to.
#[derive(Debug)]
struct Run {
    ledger: Summary,
    stats: StatsSnapshot,
    dead_letters: usize,
    left: (u64, u64),
    /// Events in the ledger when the fault started and when the network came back.
    applied_at_fault: i64,
    applied_at_restore: i64,
    /// From the network's return to the next event applied (or to the end, when nothing was
    /// left to apply), and to every event applied with the queue empty.
    first_progress: Duration,
    all_done: Duration,
    fault_lasted: Duration,
}

impl Run {
    fn report(&self, name: &str) {
        println!(
            "{name}: {EVENTS} events; duplicates {}, lost {}, balances exact {}; \
             fault lasted {:?} from {} applied events to {}; after restore: next event applied \
             in {:?}, all applied and queue empty in {:?}; dead letters {}; queue {:?}; {:?}",
            self.ledger.duplicates(),
            self.ledger.lost(EVENTS),
            self.ledger.balances_exact,
            self.fault_lasted,
            self.applied_at_fault,
            self.applied_at_restore,
            self.first_progress,
            self.all_done,
            self.dead_letters,
            self.left,
            self.stats,
        );
    }

    fn assert_exactly_once(&self) {
        let expected: i64 = (0..EVENTS).map(|n| n + 1).sum();
        assert_eq!(self.ledger.duplicates(), 0, "applied twice: {self:?}");
        assert_eq!(self.ledger.lost(EVENTS), 0, "lost: {self:?}");
        assert!(self.ledger.balances_exact, "{self:?}");
        assert_eq!(self.ledger.total_balance, expected, "{self:?}");
        assert_eq!(self.left, (0, 0), "copies left on the queue: {self:?}");
        assert_eq!(self.stats.dead_lettered, 0, "{self:?}");
        assert_eq!(
            self.dead_letters, 0,
            "healthy messages dead-lettered: {self:?}"
        );
    }
}

/// A fault between the consumer and SQS, and how long it lasts.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Connections stay open and carry nothing, for this long.
    Blackhole(Duration),
    /// Every open connection is cut, `times` times, `every` apart.
    Cuts { every: Duration, times: u32 },
    /// New connections are closed at once and open ones cut, for this long.
    Refused(Duration),
}

impl Fault {
    /// Applies the fault; returns when the network is back.
    async fn run(self, proxy: &FaultProxy) {
        match self {
            Fault::Blackhole(lasting) => {
                proxy.set_mode(ProxyMode::Blackhole);
                tokio::time::sleep(lasting).await;
                proxy.set_mode(ProxyMode::Pass);
            }
            Fault::Cuts { every, times } => {
                for _ in 0..times {
                    tokio::time::sleep(every).await;
                    proxy.cut();
                }
            }
            Fault::Refused(lasting) => {
                proxy.set_mode(ProxyMode::Refuse);
                tokio::time::sleep(lasting).await;
                proxy.set_mode(ProxyMode::Pass);
            }
        }
    }
}

async fn applied(db: &TestDb) -> i64 {
    summary(&db.pool).await.unwrap().distinct_events
}

/// Publishes [`EVENTS`] credits, consumes them through a proxy, applies `fault` once a third is
/// applied, and waits for the consumer to finish the queue by itself once the network is back.
async fn consume_through(name: &str, fault: Fault) -> Option<Run> {
    let Some(upstream) = plain_http_endpoint().await else {
        println!("{name}: skipped, the SQS endpoint is not plain HTTP so no proxy can sit in front of it");
        return None;
    };
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let sqs = common::client().await;
    let (url, dlq) = common::queue_with_redrive(&sqs, name, VISIBILITY_SECS, MAX_RECEIVES).await;
    let db = TestDb::new().await;
    let outgoing: Vec<_> = (0..EVENTS)
        .map(|n| Outgoing::new(credit(n % 10, n + 1)))
        .collect();
    SqsProducer::builder()
        .client(sqs.clone())
        .connect()
        .await
        .unwrap()
        .send_messages(&url, &outgoing)
        .await
        .unwrap();

    let source = SqsSource::builder(&url)
        .client(proxied_client(&proxy).await)
        .poll_timeout(WAIT)
        .connect()
        .await
        .unwrap();
    // Resolved through the proxy, so with the proxy's address: compare the queue names.
    let dlq_name = dlq.rsplit('/').next().unwrap();
    assert!(
        source.dead_letter_queue().unwrap().ends_with(dlq_name),
        "{:?} is not {dlq}",
        source.dead_letter_queue()
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let consumer = Consumer::new(
        "wallet",
        source,
        db.inbox(),
        Credit::new(db.pool.clone()).work(Duration::from_millis(5)),
    )
    .batch_size(10)
    .error_backoff(Duration::from_millis(200));
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let started = common::eventually(Duration::from_secs(30), || async {
        applied(&db).await >= EVENTS / 3
    })
    .await;
    assert!(started, "the consumer applied too little before the fault");
    let applied_at_fault = applied(&db).await;
    let fault_started = Instant::now();
    fault.run(&proxy).await;
    let restored = Instant::now();
    let fault_lasted = restored - fault_started;
    let applied_at_restore = applied(&db).await;

    let progressed = common::eventually(Duration::from_secs(60), || async {
        let now = applied(&db).await;
        now > applied_at_restore || now >= EVENTS
    })
    .await;
    let first_progress = restored.elapsed();
    let finished = common::eventually(Duration::from_secs(90), || async {
        applied(&db).await >= EVENTS && counts(&sqs, &url).await == (0, 0)
    })
    .await;
    let all_done = restored.elapsed();

    let _ = stop.send(());
    let stats = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the consumer did not stop within 30 s of shutdown")
        .unwrap()
        .expect("the consumer stopped with an error");
    let run = Run {
        ledger: summary(&db.pool).await.unwrap(),
        stats,
        dead_letters: drain(&sqs, &dlq, Duration::from_secs(1)).await.len(),
        left: counts(&sqs, &url).await,
        applied_at_fault,
        applied_at_restore,
        first_progress,
        all_done,
        fault_lasted,
    };
    run.report(name);
    assert!(
        progressed,
        "no progress within 60 s of the network's return: {run:?}"
    );
    assert!(
        finished,
        "the queue was not finished within 90 s of the network's return: {run:?}"
    );
    common::delete_queue(&sqs, &url).await;
    common::delete_queue(&sqs, &dlq).await;
    db.drop().await;
    Some(run)
}

#[tokio::test]
async fn a_black_holed_connection_longer_than_the_timeout_recovers_by_itself() {
    // Longer than a delete and then a receive can take to fail (a call times out after
    // OPERATION_TIMEOUT, retries included), and four visibility timeouts: receives, deletes and
    // heartbeat extensions all hang and time out, and what was in flight comes back.
    let Some(run) = consume_through("blackhole", Fault::Blackhole(12 * SECOND)).await else {
        return;
    };
    run.assert_exactly_once();
    // Whether the fault caught a delete or a receive, a receive ran into it before it ended.
    assert!(run.stats.errors > 0, "no receive timed out: {run:?}");
}

#[tokio::test]
async fn connections_cut_again_and_again_lose_and_repeat_nothing() {
    let cuts = Fault::Cuts {
        every: Duration::from_millis(300),
        times: 15,
    };
    let Some(run) = consume_through("cuts", cuts).await else {
        return;
    };
    run.assert_exactly_once();
}

#[tokio::test]
async fn a_refused_endpoint_dead_letters_nothing_and_recovers() {
    let refused = Fault::Refused(5 * SECOND);
    let Some(run) = consume_through("refused", refused).await else {
        return;
    };
    run.assert_exactly_once();
    assert!(
        run.stats.errors + run.stats.ack_failures > 0,
        "the refusal was not felt: {run:?}"
    );
}
