//! The settings of `kill-test`, `demo` and `zombie-test`.

use std::path::PathBuf;

use crate::cli::{list, num, parse_flags, probability, BrokerKind, KafkaImpl, Variant};

#[derive(Debug, Clone)]
pub(crate) struct KillSettings {
    pub(crate) brokers: Vec<BrokerKind>,
    pub(crate) variants: Vec<Variant>,
    pub(crate) events: u32,
    pub(crate) accounts: i64,
    pub(crate) kills: u32,
    pub(crate) runs: u32,
    /// Work before each kill, drawn from this range (ms).
    pub(crate) kill_after_ms: (u64, u64),
    pub(crate) work_ms: u64,
    pub(crate) seed: u64,
    pub(crate) crash_between_commit_and_ack: f64,
    /// Also measure a run with no kills.
    pub(crate) throughput: bool,
    pub(crate) throughput_events: u32,
    pub(crate) chart: PathBuf,
    /// Fail (rather than skip) when a broker cannot be reached.
    pub(crate) require_brokers: bool,
    /// What `KAFKA_BROKERS` is, for the Tansu work-arounds.
    pub(crate) kafka_impl: KafkaImpl,
}

impl KillSettings {
    /// The article's settings: 10,000 events, 20 kills after 1–8 s, 5 runs, 10 ms of work.
    pub(crate) fn full() -> Self {
        Self {
            brokers: BrokerKind::ALL.to_vec(),
            variants: Variant::ALL.to_vec(),
            events: 10_000,
            accounts: 100,
            kills: 20,
            runs: 5,
            kill_after_ms: (1_000, 8_000),
            work_ms: 10,
            seed: 42,
            crash_between_commit_and_ack: 0.0,
            throughput: true,
            throughput_events: 10_000,
            chart: PathBuf::from("target/wallet-kill-test.svg"),
            require_brokers: false,
            kafka_impl: KafkaImpl::default(),
        }
    }

    /// The demo: b and c, one short run each on every broker, a few minutes in all.
    pub(crate) fn demo() -> Self {
        Self {
            variants: vec![Variant::B, Variant::C],
            events: 800,
            kills: 4,
            runs: 1,
            kill_after_ms: (1_000, 4_000),
            throughput_events: 800,
            // So that b shows its duplicates even in a short run (the article saw 5 per 20 kills).
            crash_between_commit_and_ack: 0.005,
            ..Self::full()
        }
    }

    pub(crate) fn parse(mut self, args: &[String]) -> Result<Self, String> {
        let mut throughput_events = None;
        parse_flags(args, |flag, value| {
            match flag {
                "--brokers" | "--broker" => self.brokers = list(value)?,
                "--variants" | "--variant" => self.variants = list(value)?,
                "--events" => self.events = num(value)?,
                "--accounts" => self.accounts = num(value)?,
                "--kills" => self.kills = num(value)?,
                "--runs" => self.runs = num(value)?,
                "--kill-after-ms" => {
                    let (lo, hi) = value
                        .split_once("..")
                        .ok_or("use MIN..MAX, e.g. 1000..8000")?;
                    self.kill_after_ms = (num(lo)?, num(hi)?);
                    if self.kill_after_ms.0 > self.kill_after_ms.1 {
                        return Err("MIN is above MAX".into());
                    }
                }
                "--work-ms" => self.work_ms = num(value)?,
                "--seed" => self.seed = num(value)?,
                "--crash-between-commit-and-ack" => {
                    self.crash_between_commit_and_ack = probability(value)?;
                }
                "--throughput" => self.throughput = num(value)?,
                "--throughput-events" => throughput_events = Some(num(value)?),
                "--chart" => self.chart = PathBuf::from(value),
                "--require-brokers" => self.require_brokers = num(value)?,
                "--kafka-impl" => self.kafka_impl = value.parse()?,
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        self.throughput_events = throughput_events.unwrap_or(self.events);
        if self.accounts < 1 || self.runs < 1 {
            return Err("--accounts and --runs must be at least 1".into());
        }
        Ok(self)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ZombieSettings {
    pub(crate) brokers: Vec<BrokerKind>,
    pub(crate) variants: Vec<Variant>,
    pub(crate) events: u32,
    /// One event in this many stalls on its first handling.
    pub(crate) stall_every: u32,
    pub(crate) runs: u32,
    pub(crate) work_ms: u64,
    pub(crate) require_brokers: bool,
    pub(crate) kafka_impl: KafkaImpl,
}

impl ZombieSettings {
    pub(crate) fn parse(args: &[String]) -> Result<Self, String> {
        let mut s = Self {
            brokers: BrokerKind::ALL.to_vec(),
            variants: vec![Variant::B, Variant::C],
            events: 5_000,
            stall_every: 500,
            runs: 1,
            work_ms: 2,
            require_brokers: false,
            kafka_impl: KafkaImpl::default(),
        };
        parse_flags(args, |flag, value| {
            match flag {
                "--brokers" | "--broker" => s.brokers = list(value)?,
                "--variants" | "--variant" => s.variants = list(value)?,
                "--events" => s.events = num(value)?,
                "--stall-every" => s.stall_every = num(value)?,
                "--runs" => s.runs = num(value)?,
                "--work-ms" => s.work_ms = num(value)?,
                "--require-brokers" => s.require_brokers = num(value)?,
                "--kafka-impl" => s.kafka_impl = value.parse()?,
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        if s.stall_every == 0 {
            return Err("--stall-every must be at least 1".into());
        }
        Ok(s)
    }
}
