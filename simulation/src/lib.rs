//! A deterministic simulation of inbox: one seed drives every choice the brokers, the store and
//! the handlers make, and after each run the invariants are checked.
//!
//! Each seed publishes a few messages (some twice, as a producer retrying would; now and then
//! one that fails every time), picks a broker ([`brokers`]) and a store (one database or two
//! shards, claims taking row locks, with or without a lock timeout), and runs rounds of
//! consumers: one, or two at once in one group, each with a random batch size, lane count,
//! retry budget, redelivery schedule, delivery limit, handler timeout and shutdown timeout,
//! each ended by a crash at a random await point (the future is dropped: what it held unacked
//! goes back to the broker, its open transaction rolls back), by a stop at a random time, or by
//! running dry. Faults come throughout: receives that fail, brokers that take deliveries back
//! (visibility timeouts, rebalances that leave a zombie working, `XAUTOCLAIM`), acks, dead
//! letters and redeliveries that fail, stores that go down for a while (one shard at a time),
//! claims that wait on a peer's row and time out or deadlock, commits that fail or succeed but
//! report a lost connection, handlers that fail, panic or run past their timeout. Then the dead
//! letters are replayed to their source, and fault-free consumers drain what is left.
//!
//! The invariants:
//! - nothing is applied twice: every committed transaction applies only IDs new to the store;
//! - no ack before the commit: a delivery is acked only when its ID is committed in the store or
//!   its message was dead-lettered;
//! - a redelivery schedule goes on where it was: the count the broker reports back
//!   (`Metadata::redeliveries`) is the number of redeliveries asked for so far;
//! - nothing is lost: once drained, every published ID is applied exactly once or sits in the
//!   dead letters;
//! - liveness: after the last fault, everything is applied or parked within [`SETTLE`] of
//!   simulated time; a stall is a failing seed, not a hung test;
//! - strict order: in a quarter of the seeds every consumer runs `Order::Strict`, and on a
//!   broker that keeps an order each lane's entries are applied in the order published.
//!
//! Time is tokio's paused clock, so a seed takes well under a millisecond and replays exactly.

#![allow(clippy::unwrap_used)] // a simulation fails loudly on the first surprise

mod broker;
pub mod brokers;
mod effects;
mod handler;
mod life;
mod replay;
mod store;
mod world;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_core::{Consumer, Message, MessageId, Order, Sharded};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::broker::SimSource;
use crate::brokers::Picked;
pub use crate::handler::HANDLER_PANIC;
use crate::handler::{SimBatch, SimHandler};
use crate::life::{live, End, Life};
use crate::store::SimStore;
use crate::world::{world, Core, Published, Shared, World};

/// How long the fault-free consumers at the end may take to apply or park everything, in
/// simulated time, before the seed counts as a stall.
pub const SETTLE: Duration = Duration::from_secs(120);

/// How long a round with faults may run, in simulated time, before it is cut off as by a
/// crash: far beyond any redelivery schedule, lease or outage a seed draws.
const ROUND_MAX: Duration = Duration::from_secs(600);

/// What one seed came to: its schedule and the invariants it broke.
#[derive(Debug, PartialEq, Eq)]
pub struct Run {
    /// Every choice and event, in order.
    pub schedule: Vec<String>,
    /// The invariants broken, empty when none.
    pub violations: Vec<String>,
}

/// Runs seed `seed` on a runtime of its own with a paused clock.
pub fn simulate(seed: u64) -> Run {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(run_seed(seed))
}

/// The store a seed runs on: one database, or two shards routed by the message ID.
#[derive(Debug, Clone)]
enum Store {
    One(SimStore),
    Two(Sharded<SimStore>),
    /// The effect step's lease store and provider, instead of an inbox.
    Effects(Arc<effects::Lab>),
}

/// One consumer of a round: its settings, and whether it takes the set-based handler.
struct Member {
    life: Life,
    set_based: bool,
}

async fn run_member(shared: &Shared, store: &Store, member: Member) -> String {
    let source = SimSource::connect(shared);
    let world = Arc::clone(shared);
    let result = match (store, member.set_based) {
        (Store::One(store), false) => {
            let consumer = Consumer::new("sim", source, store.clone(), SimHandler { world });
            live(consumer, member.life).await
        }
        (Store::One(store), true) => {
            let consumer = Consumer::batched("sim", source, store.clone(), SimBatch { world });
            live(consumer, member.life).await
        }
        (Store::Two(store), false) => {
            let consumer = Consumer::new("sim", source, store.clone(), SimHandler { world });
            live(consumer, member.life).await
        }
        (Store::Two(store), true) => {
            let consumer = Consumer::batched("sim", source, store.clone(), SimBatch { world });
            live(consumer, member.life).await
        }
        (Store::Effects(lab), _) => effects::live(lab, source, member.life).await,
    };
    match result {
        None => "crashed".into(),
        Some(Ok(_)) => "stopped".into(),
        Some(Err(e)) => format!("failed: {e}"),
    }
}

/// The settings of one consumer, drawn from the seed.
fn draw_member(
    core: &mut Core,
    strict: bool,
    lanes: usize,
    schedule: &[Duration],
    last: bool,
) -> Member {
    let rng = &mut core.rng;
    let batch = rng.random_range(1..=6);
    let mut parallel = rng.random_range(1..=4);
    // Strict order on a source without lanes takes one chunk at a time.
    if strict && lanes == 1 {
        parallel = 1;
    }
    let attempts = rng.random_range(1..=3);
    let max_deliveries = rng.random_bool(0.3).then(|| rng.random_range(2..=6));
    let handler_timeout = rng.random_bool(0.5).then_some(Duration::from_millis(300));
    let shutdown = Duration::from_millis(rng.random_range(0..600));
    let end = if last {
        End::Idle
    } else {
        match rng.random_range(0..3) {
            0 => End::Crash {
                polls: rng.random_range(1..300),
            },
            1 => End::Stop {
                after: Duration::from_millis(rng.random_range(0..1_500)),
            },
            _ => End::Idle,
        }
    };
    let set_based = rng.random_bool(0.3);
    Member {
        life: Life {
            batch,
            lanes: parallel,
            attempts,
            schedule: schedule.to_vec(),
            max_deliveries,
            handler_timeout,
            shutdown,
            order: if strict {
                Order::Strict
            } else {
                Order::FailuresLast
            },
            end,
        },
        set_based,
    }
}

async fn run_seed(seed: u64) -> Run {
    let mut rng = StdRng::seed_from_u64(seed);
    let Picked {
        broker,
        lanes,
        name,
        groups_lock,
    } = brokers::pick(&mut rng);
    // The effect step has no strict order, shards or redelivery schedule.
    let effects = effects::drawn(seed);
    let strict = rng.random_bool(0.25) && !effects;
    let sharded = rng.random_bool(0.3) && !effects;
    let lock_timeout = rng
        .random_bool(0.5)
        .then(|| Duration::from_millis(rng.random_range(50..500)));
    let schedule: Vec<Duration> = if rng.random_bool(0.4) && !effects {
        (0..rng.random_range(1..=3))
            .map(|_| Duration::from_millis(rng.random_range(100..2_000)))
            .collect()
    } else {
        Vec::new()
    };
    let messages = rng.random_range(1..=10);
    let mut published = Vec::new();
    for n in 0..messages {
        let copies = if rng.random_bool(0.2) { 2 } else { 1 };
        for _ in 0..copies {
            published.push(Published {
                id: format!("m{n}"),
                lane: rng.random_range(0..lanes),
                replayed: false,
            });
        }
    }
    let poison = rng
        .random_bool(0.15)
        .then(|| format!("m{}", rng.random_range(0..messages)));
    let rounds = rng.random_range(1..=4);
    let mut core = Core::new(rng);
    core.note(format!(
        "seed {seed}: {name}, {} entries, strict order {strict}, sharded {sharded}, lock timeout \
         {lock_timeout:?}, redelivery schedule {schedule:?}, poison {poison:?}",
        published.len()
    ));
    core.poison.extend(poison);
    core.sharded = sharded;
    let shared: Shared = Arc::new(Mutex::new(World { core, broker }));
    {
        let mut w = world(&shared);
        let w = &mut *w;
        for (i, p) in published.into_iter().enumerate() {
            w.core.entries.push(p);
            w.broker.publish(&mut w.core, i);
        }
    }
    let ids: BTreeSet<String> = world(&shared)
        .core
        .entries
        .iter()
        .map(|e| e.id.clone())
        .collect();
    let store = if effects {
        Store::Effects(effects::Lab::new(&shared))
    } else if sharded {
        let shards = vec![
            SimStore::new(&shared, 0, lock_timeout),
            SimStore::new(&shared, 1, lock_timeout),
        ];
        Store::Two(Sharded::new(shards, |id: &MessageId, _: &Message| {
            shard_of(id.as_str())
        }))
    } else {
        Store::One(SimStore::new(&shared, 0, lock_timeout))
    };

    for round in 0..rounds {
        let members: Vec<Member> = {
            let mut w = world(&shared);
            let two = w.core.rng.random_bool(0.3);
            let members: Vec<Member> = (0..if two { 2 } else { 1 })
                .map(|_| draw_member(&mut w.core, strict, lanes, &schedule, false))
                .collect();
            for (n, m) in members.iter().enumerate() {
                let line = describe(round, n, m);
                w.core.note(line);
            }
            members
        };
        let mut members = members.into_iter();
        let first = members.next().unwrap();
        let round_run = async {
            match members.next() {
                None => vec![run_member(&shared, &store, first).await],
                Some(second) => {
                    let (a, b) = tokio::join!(
                        run_member(&shared, &store, first),
                        run_member(&shared, &store, second)
                    );
                    vec![a, b]
                }
            }
        };
        let Ok(outcomes) = tokio::time::timeout(ROUND_MAX, round_run).await else {
            // Faults that keep coming (a rebalance every few polls) can keep a round from
            // running dry: it ends as a crash would. Whether anything stays stuck once they
            // stop is for the drain to find.
            world(&shared)
                .core
                .note(format!("round {round} cut off after {ROUND_MAX:?}"));
            continue;
        };
        let mut w = world(&shared);
        for (n, outcome) in outcomes.into_iter().enumerate() {
            if outcome.starts_with("failed") {
                w.core
                    .violation(format!("round {round} consumer {n} {outcome}"));
            } else {
                w.core.note(format!("round {round} consumer {n} {outcome}"));
            }
        }
    }

    // The operator replays the dead letters (faults still on).
    replay::replay_all(&shared).await;

    // The last fault is behind: from here everything must settle within SETTLE.
    world(&shared).core.faults = false;
    if let Store::Two(sharded) = &store {
        outage_round(
            &shared,
            &store,
            &sharded.stores()[1],
            strict,
            lanes,
            &schedule,
            groups_lock,
        )
        .await;
    }
    let settle = tokio::time::Instant::now() + SETTLE;
    let mut drained = false;
    for n in 0.. {
        if world(&shared).broker.open() == 0 {
            drained = true;
            break;
        }
        let member = {
            let mut w = world(&shared);
            let m = draw_member(&mut w.core, strict, lanes, &schedule, true);
            let line = describe(rounds + n, 0, &m);
            w.core.note(line);
            m
        };
        let left = settle.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, run_member(&shared, &store, member)).await {
            Ok(outcome) if outcome.starts_with("failed") => {
                world(&shared)
                    .core
                    .violation(format!("the drain {outcome}"));
                break;
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }

    let mut w = world(&shared);
    let open = w.broker.open();
    if !drained && open > 0 {
        w.core.violation(format!(
            "stall: {open} entries neither acked nor dead-lettered {SETTLE:?} after the last fault"
        ));
    }
    // An SQS FIFO copy for a delayed redelivery joins the back of its group.
    let to_back = w.broker.redelivery_to_back();
    let core = &mut w.core;
    if let Store::Effects(lab) = &store {
        lab.check(core, &ids);
    }
    for id in &ids {
        let applied = core.applied.get(id).copied().unwrap_or(0);
        if applied == 0 && !core.letters.iter().any(|l| l.id == *id) {
            core.violation(format!(
                "{id} lost: neither applied nor in the dead letters"
            ));
        }
    }
    if strict && lanes > 1 {
        // A lane keeps its order within each shard.
        let mut inversions = Vec::new();
        for ((lane, shard), applied) in &core.order {
            let kept: Vec<usize> = applied
                .iter()
                .copied()
                .filter(|&i| !core.parked.contains_key(&core.entries[i].id))
                .filter(|&i| !(to_back && core.redeliveries.contains_key(&i)))
                .collect();
            if kept.windows(2).any(|pair| pair[0] > pair[1]) {
                inversions.push(format!(
                    "strict order broken in lane {lane}, shard {shard}: entries applied in the \
                     order {kept:?}"
                ));
            }
        }
        for what in inversions {
            core.violation(what);
        }
    }
    Run {
        schedule: std::mem::take(&mut core.schedule),
        violations: std::mem::take(&mut core.violations),
    }
}

/// One shard down for the whole round, nothing else failing: a consumer with lanes to spare
/// applies (or parks) every message of the healthy shard meanwhile.
async fn outage_round(
    shared: &Shared,
    store: &Store,
    down: &SimStore,
    strict: bool,
    lanes: usize,
    schedule: &[Duration],
    groups_lock: bool,
) {
    const OUTAGE: Duration = Duration::from_secs(20);
    let mut member = {
        let mut w = world(shared);
        w.core.note(format!("shard 1 down for {OUTAGE:?}"));
        draw_member(&mut w.core, strict, lanes, schedule, true)
    };
    member.life.lanes = member.life.lanes.max(2);
    if strict && lanes == 1 {
        // Strict order on a source without lanes takes one chunk at a time: the down shard's
        // chunk would hold it.
        return;
    }
    member.life.end = End::Stop {
        after: OUTAGE - Duration::from_secs(2),
    };
    down.down_for(OUTAGE);
    let outcome = run_member(shared, store, member).await;
    let mut w = world(shared);
    let core = &mut w.core;
    let done = |id: &String| core.applied.contains_key(id) || core.parked.contains_key(id);
    // An SQS FIFO group with a message in flight gives out nothing more: a group that holds a
    // message of the shard that is down (a copy of an ID applied before, too) waits for it,
    // whatever its other messages' shards.
    let locked: BTreeSet<usize> = core
        .entries
        .iter()
        .filter(|e| groups_lock && shard_of(&e.id) == 1)
        .map(|e| e.lane)
        .collect();
    // An ID published twice counts as locked when either copy's group is: the other copy may
    // be a resend the FIFO queue dropped as a duplicate.
    let in_locked: BTreeSet<&String> = core
        .entries
        .iter()
        .filter(|e| locked.contains(&e.lane))
        .map(|e| &e.id)
        .collect();
    let waiting: BTreeSet<String> = core
        .entries
        .iter()
        .filter(|e| shard_of(&e.id) == 0 && !in_locked.contains(&e.id))
        .map(|e| e.id.clone())
        .filter(|id| !done(id))
        .collect();
    if waiting.is_empty() {
        core.note(format!("outage round {outcome}"));
    } else {
        core.violation(format!(
            "shard 0 held back by shard 1's outage: {waiting:?} neither applied nor parked in {:?}",
            OUTAGE - Duration::from_secs(2)
        ));
    }
}

/// The shard of a message ID, when the store has two.
pub(crate) fn shard_of(id: &str) -> usize {
    id.bytes().map(usize::from).sum::<usize>() % 2
}

fn describe(round: usize, n: usize, m: &Member) -> String {
    let l = &m.life;
    format!(
        "round {round} consumer {n}: batch {}, lanes {}, attempts {}, max_deliveries {:?}, \
         handler_timeout {:?}, shutdown_timeout {:?}, set-based handler {}, ends {:?}",
        l.batch,
        l.lanes,
        l.attempts,
        l.max_deliveries,
        l.handler_timeout,
        l.shutdown,
        m.set_based,
        l.end
    )
}
