//! Shutdown, as the work in flight sees it: asked for, then cut short.

use std::time::Duration;

use futures_util::stream::{self, Stream};
use tokio::sync::watch;

/// Where shutdown stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    Running,
    /// No new batch is received; the work in flight finishes.
    Stopping,
    /// The work in flight is dropped: its transactions roll back and its messages are handed
    /// back to the broker.
    Aborting,
}

/// Tells the work in flight that shutdown was asked for.
#[derive(Debug, Clone)]
pub(crate) struct Stop(watch::Receiver<Phase>);

impl Stop {
    pub(crate) fn new() -> (watch::Sender<Phase>, Self) {
        let (tx, rx) = watch::channel(Phase::Running);
        (tx, Self(rx))
    }

    pub(crate) fn stopping(&self) -> bool {
        *self.0.borrow() >= Phase::Stopping
    }

    /// Sleeps `wait`, or less when shutdown is asked for; `true` when it was.
    pub(crate) async fn pause(&self, wait: Duration) -> bool {
        if self.stopping() {
            return true;
        }
        let mut stop = self.0.clone();
        // Biased: when both are ready, shutdown wins, and one schedule always ends one way.
        tokio::select! {
            biased;
            Ok(_) = stop.wait_for(|phase| *phase >= Phase::Stopping) => true,
            () = tokio::time::sleep(wait) => false,
        }
    }

    /// Completes when the work in flight must be cut short; never, if it need not.
    pub(crate) async fn aborted(&self) {
        let mut stop = self.0.clone();
        if stop
            .wait_for(|phase| *phase == Phase::Aborting)
            .await
            .is_err()
        {
            std::future::pending::<()>().await;
        }
    }
}

/// SIGINT (Ctrl-C) or SIGTERM, as a stream: one item per signal. Where no handler can be
/// installed, a stream that never yields, so the consumer runs until the process ends.
pub(crate) fn signals() -> impl Stream<Item = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let handlers = signal(SignalKind::interrupt()).and_then(|interrupt| {
            let terminate = signal(SignalKind::terminate())?;
            Ok((interrupt, terminate))
        });
        stream::unfold(handlers.ok(), |handlers| async move {
            let (mut interrupt, mut terminate) = match handlers {
                Some(handlers) => handlers,
                None => std::future::pending().await,
            };
            let received = tokio::select! {
                signal = interrupt.recv() => signal.is_some(),
                signal = terminate.recv() => signal.is_some(),
            };
            if !received {
                std::future::pending::<()>().await;
            }
            Some(((), Some((interrupt, terminate))))
        })
    }
    #[cfg(not(unix))]
    {
        stream::unfold((), |()| async {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
            Some(((), ()))
        })
    }
}
