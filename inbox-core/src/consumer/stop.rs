//! Shutdown, as the work in flight sees it: asked for, then cut short.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::stream::{self, Stream};
use tokio::sync::Notify;

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
///
/// A phase and a [`Notify`] rather than a `watch` channel: `watch` spreads its waiters over
/// notifiers picked at random, so the lanes cut short would wake in a different order on each
/// run, and one schedule could end two ways.
#[derive(Debug, Clone)]
pub(crate) struct Stop(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    phase: Mutex<Phase>,
    changed: Notify,
}

impl Stop {
    pub(crate) fn new() -> Self {
        Self(Arc::new(Shared {
            phase: Mutex::new(Phase::Running),
            changed: Notify::new(),
        }))
    }

    pub(crate) fn phase(&self) -> Phase {
        *self.0.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves shutdown to `phase` and wakes what waits for it.
    pub(crate) fn set(&self, phase: Phase) {
        *self.0.phase.lock().unwrap_or_else(PoisonError::into_inner) = phase;
        self.0.changed.notify_waiters();
    }

    pub(crate) fn stopping(&self) -> bool {
        self.phase() >= Phase::Stopping
    }

    /// Completes once the phase is at least `phase`.
    async fn reached(&self, phase: Phase) {
        loop {
            let changed = self.0.changed.notified();
            tokio::pin!(changed);
            // Registered before the phase is read, so a change in between is not missed.
            changed.as_mut().enable();
            if self.phase() >= phase {
                return;
            }
            changed.await;
        }
    }

    /// Sleeps `wait`, or less when shutdown is asked for; `true` when it was.
    pub(crate) async fn pause(&self, wait: Duration) -> bool {
        if self.stopping() {
            return true;
        }
        // Biased: when both are ready, shutdown wins, and one schedule always ends one way.
        tokio::select! {
            biased;
            () = self.reached(Phase::Stopping) => true,
            () = tokio::time::sleep(wait) => false,
        }
    }

    /// Completes when the work in flight must be cut short; never, if it need not.
    pub(crate) async fn aborted(&self) {
        self.reached(Phase::Aborting).await;
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
