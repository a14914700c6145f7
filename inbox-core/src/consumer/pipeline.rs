//! The pipeline of [`Consumer`]: receiving, lanes side by side, acks behind the next chunk's
//! work, and shutdown.

use std::collections::BTreeSet;

use futures_util::stream::{FuturesUnordered, Stream, StreamExt};
use tokio::sync::Mutex;
use tokio::time::{sleep_until, Instant};
use tracing::warn;

use super::lanes::Lanes;
use super::stop::{Phase, Stop};
use super::{Consumer, Step};
use crate::{ConsumerState, Error, MessageSource, Result, StatsSnapshot};

/// How far a free lane reads ahead for a message it can take, per lane (see `read_ahead`):
/// past a run of about 1 MiB of small records, what librdkafka fetches of one partition at a
/// time by default (`max.partition.fetch.bytes`).
const READ_AHEAD_PER_LANE: usize = 8192;
/// How many messages reading ahead holds at most, whatever the number of lanes.
const READ_AHEAD_MAX: usize = 65_536;

// `Step` is the crate's own: see the `impl` in the parent module.
#[allow(private_bounds)]
impl<S, W> Consumer<S, W>
where
    S: MessageSource,
    W: Step,
{
    pub(super) async fn pipeline(
        &mut self,
        shutdown: impl Stream<Item = ()> + Send,
        until_idle: bool,
    ) -> Result<StatsSnapshot> {
        let mut shutdown = std::pin::pin!(shutdown.fuse());
        let stop = Stop::new();
        // Set when shutdown is asked for: when the work in flight is cut short.
        let mut deadline: Option<Instant> = None;
        let (batch_size, lanes, timeout) = (self.batch_size, self.lanes, self.shutdown_timeout);
        let ordered = self.source.capabilities().lanes();
        let step = &self.step;
        let common = step.common();
        let health = &common.health;
        let source = Mutex::new(&mut self.source);
        let source = &source;
        let stop = &stop;
        let capacity = batch_size.saturating_mul(lanes);
        // A source without lanes keeps no order the consumer could break: every free slot
        // takes a chunk of it. A source with lanes keeps each lane's order, one chunk at a time.
        let mut queued = Lanes::new(if ordered { 1 } else { lanes });
        // What was received may all belong to busy lanes (librdkafka hands out one partition's
        // records in runs): a free slot then reads ahead, up to this many held messages, until
        // a lane it can take arrives.
        // The most held in all: a free lane's read-ahead, or the messages that wait for a
        // store shard in an outage.
        let hold_max = capacity.max(
            lanes
                .saturating_mul(READ_AHEAD_PER_LANE)
                .min(READ_AHEAD_MAX),
        );
        let read_ahead = if ordered && lanes > 1 {
            hold_max
        } else {
            capacity
        };
        let shards = step.shard_count();
        let mut working = FuturesUnordered::new();
        let mut acking = FuturesUnordered::new();
        let mut receiving = None;
        let mut receive_after: Option<Instant> = None;
        let mut failures = 0;
        let mut failed: Option<Error> = None;
        let mut idle = false;
        // Received and not yet settled: queued, being applied, or being acked.
        let mut in_flight: usize = 0;
        let in_flight_gauge = common.metrics.in_flight.clone();
        // Stops receiving; the work in flight has `timeout` to finish.
        let begin_stop = |deadline: &mut Option<Instant>| {
            if deadline.is_none() {
                health.set(ConsumerState::Stopping);
                stop.set(Phase::Stopping);
                *deadline = Some(Instant::now() + timeout);
            }
        };
        loop {
            health.turned();
            in_flight_gauge.set(in_flight as f64);
            let stopping = stop.stopping();
            // Store shards in an outage: one chunk out each, and their waiting messages held
            // outside the window, so the healthy shards keep the other lanes and the window.
            let (down, parked) = if shards > 1 {
                let outages = common.outages();
                // Chunks holding beyond the first of their shard give their lane back.
                let parked: usize = outages.values().map(|n| n - 1).sum();
                (outages.keys().copied().collect(), parked)
            } else {
                (BTreeSet::new(), 0)
            };
            while working.len().saturating_sub(parked) < lanes && !stopping {
                let Some((lane, chunk)) = queued.take(batch_size, &down) else {
                    break;
                };
                let n = chunk.len();
                working.push(async move { (lane, n, step.process(chunk, stop).await) });
            }
            let waiting_down = if down.is_empty() {
                0
            } else {
                queued.waiting_in(&down) + parked * batch_size
            };
            let held = (queued.len() + working.len() * batch_size).saturating_sub(waiting_down);
            let limit = if working.len().saturating_sub(parked) < lanes && !queued.ready(&down) {
                read_ahead
            } else {
                capacity
            };
            if receiving.is_none()
                && receive_after.is_none()
                && !stopping
                && !idle
                && held < limit
                && held + waiting_down < hold_max
                && acking.len() <= lanes
            {
                let n = batch_size.max(limit - held).min(limit);
                receiving = Some(Box::pin(
                    async move { source.lock().await.receive(n).await },
                ));
            }
            if stopping || idle {
                // A receive still waiting (a long poll) is dropped: receives are cancel-safe,
                // and what a cancelled one took comes back from the broker.
                receiving = None;
                let back = queued.drain();
                in_flight = in_flight.saturating_sub(back.len());
                common.hand_back(back).await;
                if working.is_empty() && acking.is_empty() {
                    break;
                }
            }
            tokio::select! {
                biased;
                Some(()) = shutdown.next() => {
                    if stopping {
                        warn!(consumer = %common.name, "shutdown asked for again: handing back the work in flight");
                        stop.set(Phase::Aborting);
                    } else {
                        begin_stop(&mut deadline);
                    }
                }
                () = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() && stop.phase() == Phase::Stopping => {
                    warn!(consumer = %common.name, ?timeout, "the work in flight did not finish within the shutdown timeout: handing it back");
                    stop.set(Phase::Aborting);
                }
                Some((lane, n, result)) = working.next() => {
                    in_flight = in_flight.saturating_sub(n);
                    if matches!(&result, Ok(processed) if processed.blocked) {
                        // Strict order: a failed message went back unapplied, and what its lane
                        // received after it follows, to come again in order.
                        let back = queued.drain_lane(&lane);
                        in_flight = in_flight.saturating_sub(back.len());
                        common.hand_back(back).await;
                    }
                    queued.done(&lane);
                    match result.map(|processed| processed.acks) {
                        Ok(acks) => {
                            let n = acks.len();
                            in_flight += n;
                            acking.push(async move {
                                common.ack_all(acks).await;
                                n
                            });
                        }
                        Err(e) => {
                            failed.get_or_insert(e);
                            begin_stop(&mut deadline);
                        }
                    }
                }
                () = common.outage_changed.notified(), if shards > 1 => {}
                Some(n) = acking.next() => {
                    in_flight = in_flight.saturating_sub(n);
                }
                received = async { receiving.as_mut().expect("guarded by is_some").await }, if receiving.is_some() => {
                    receiving = None;
                    match received {
                        Ok(batch) => {
                            failures = 0;
                            health.recovered();
                            if batch.is_empty() {
                                if until_idle && working.is_empty() && acking.is_empty() && queued.len() == 0 {
                                    idle = true;
                                }
                            } else {
                                in_flight += batch.len();
                                queued.add(batch, |m| step.shard_of(m));
                            }
                        }
                        Err(e) => {
                            failures += 1;
                            health.failing();
                            match common.source_failed(e, failures) {
                                Ok(wait) => receive_after = Some(Instant::now() + wait),
                                Err(e) => {
                                    failed.get_or_insert(e);
                                    begin_stop(&mut deadline);
                                }
                            }
                        }
                    }
                }
                () = sleep_until(receive_after.unwrap_or_else(Instant::now)), if receive_after.is_some() => {
                    receive_after = None;
                }
                else => break,
            }
        }
        in_flight_gauge.set(0.0);
        match failed {
            Some(e) => Err(e),
            None => Ok(common.stats.snapshot()),
        }
    }
}
