//! One consumer's life: its settings, and how it ends (a crash at an await point, a stop, or
//! running dry).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use inbox_core::{BatchHandler, Consumer, Inbox, InboxStore, Order, RetryPolicy};

use crate::broker::SimSource;
use crate::store::SimTx;

pub(crate) struct CrashAfter<F> {
    inner: Pin<Box<F>>,
    polls: u32,
}

impl<F> CrashAfter<F> {
    /// `future`, dropped as a crash would drop it after `polls` polls.
    pub(crate) fn new(future: F, polls: u32) -> Self {
        Self {
            inner: Box::pin(future),
            polls,
        }
    }
}

impl<F: Future> Future for CrashAfter<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.polls == 0 {
            return Poll::Ready(None);
        }
        self.polls -= 1;
        self.inner.as_mut().poll(cx).map(Some)
    }
}

/// How one consumer's life ends.
#[derive(Debug)]
pub(crate) enum End {
    Crash { polls: u32 },
    Stop { after: Duration },
    Idle,
}

/// One consumer's settings and how its life ends.
#[derive(Debug)]
pub(crate) struct Life {
    pub(crate) batch: usize,
    pub(crate) lanes: usize,
    pub(crate) attempts: u32,
    /// The redelivery schedule (`RetryPolicy::redeliver_after`), empty for none.
    pub(crate) schedule: Vec<Duration>,
    pub(crate) max_deliveries: Option<u32>,
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) shutdown: Duration,
    pub(crate) order: Order,
    pub(crate) end: End,
}

/// Runs `consumer` with `life`'s settings until its life ends: `None` when it crashed.
pub(crate) async fn live<St: InboxStore<Tx = SimTx>, H: BatchHandler<SimTx>>(
    consumer: Consumer<SimSource, Inbox<St, H>>,
    life: Life,
) -> Option<inbox_core::Result<inbox_core::StatsSnapshot>> {
    let mut consumer = consumer
        .batch_size(life.batch)
        .parallel_lanes(life.lanes)
        .retry(
            RetryPolicy::default()
                .max_attempts(life.attempts)
                .backoff(Duration::from_millis(20), Duration::from_millis(200))
                .redeliver_after(life.schedule),
        )
        .error_backoff(Duration::from_millis(20))
        .shutdown_timeout(life.shutdown)
        .order(life.order);
    if let Some(n) = life.max_deliveries {
        consumer = consumer.max_deliveries(n);
    }
    if let Some(limit) = life.handler_timeout {
        consumer = consumer.handler_timeout(limit);
    }
    match life.end {
        End::Idle => Some(consumer.run_until_idle().await),
        End::Crash { polls } => CrashAfter::new(consumer.run_until_idle(), polls).await,
        End::Stop { after } => Some(consumer.run_until(tokio::time::sleep(after)).await),
    }
}
