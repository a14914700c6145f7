//! The article's table per broker, and one JSON line per broker and variant.

use serde::Serialize;

use crate::cli::{BrokerKind, Variant};

/// What one run of the kill test counted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunResult {
    pub(crate) kills: u32,
    /// Aborts of the consumer by `--crash-between-commit-and-ack`.
    pub(crate) self_crashes: u32,
    pub(crate) duplicates: i64,
    pub(crate) lost: i64,
    pub(crate) balances_exact: bool,
}

/// Every run of one variant on one broker.
#[derive(Debug, Clone)]
pub(crate) struct VariantResult {
    pub(crate) broker: BrokerKind,
    pub(crate) variant: Variant,
    pub(crate) events: u32,
    pub(crate) kills_per_run: u32,
    pub(crate) runs: Vec<RunResult>,
    /// Messages per second of a run with no kills.
    pub(crate) throughput: Option<f64>,
}

/// Median, min and max.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) min: i64,
    pub(crate) max: i64,
}

pub(crate) fn spread(values: impl IntoIterator<Item = i64>) -> Spread {
    let mut v: Vec<i64> = values.into_iter().collect();
    v.sort_unstable();
    let n = v.len();
    let median = match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2] as f64,
        _ => (v[n / 2 - 1] + v[n / 2]) as f64 / 2.0,
    };
    Spread {
        median,
        min: v.first().copied().unwrap_or(0),
        max: v.last().copied().unwrap_or(0),
    }
}

impl Spread {
    fn show(self) -> String {
        let median = if self.median.fract() == 0.0 {
            format!("{}", self.median)
        } else {
            format!("{:.1}", self.median)
        };
        format!("{median} ({}–{})", self.min, self.max)
    }
}

impl VariantResult {
    pub(crate) fn duplicates(&self) -> Spread {
        spread(self.runs.iter().map(|r| r.duplicates))
    }

    pub(crate) fn lost(&self) -> Spread {
        spread(self.runs.iter().map(|r| r.lost))
    }

    fn json(&self) -> Line {
        Line {
            broker: self.broker.name(),
            variant: self.variant.name(),
            runs: self.runs.len(),
            kills: self.runs.iter().map(|r| r.kills).sum(),
            self_crashes: self.runs.iter().map(|r| r.self_crashes).sum(),
            events: u64::from(self.events) * self.runs.len() as u64,
            duplicates: self.runs.iter().map(|r| r.duplicates).sum(),
            lost: self.runs.iter().map(|r| r.lost).sum(),
            balances_exact: self.runs.iter().all(|r| r.balances_exact),
            duplicates_per_run: self.runs.iter().map(|r| r.duplicates).collect(),
            lost_per_run: self.runs.iter().map(|r| r.lost).collect(),
            throughput: self.throughput.map(|t| (t * 10.0).round() / 10.0),
        }
    }
}

/// The machine-readable summary the smoke test and scripts read.
#[derive(Debug, Serialize)]
struct Line {
    broker: &'static str,
    variant: &'static str,
    runs: usize,
    kills: u32,
    self_crashes: u32,
    events: u64,
    duplicates: i64,
    lost: i64,
    balances_exact: bool,
    duplicates_per_run: Vec<i64>,
    lost_per_run: Vec<i64>,
    throughput: Option<f64>,
}

/// Prints the article's table for one broker.
pub(crate) fn table(results: &[VariantResult], work_ms: u64) {
    let Some(first) = results.first() else {
        return;
    };
    println!(
        "\n{}: {} events, {} kills per run, {} runs per variant, handlers sleep {work_ms} ms",
        first.broker,
        first.events,
        first.kills_per_run,
        first.runs.len()
    );
    println!(
        "{:<32} {:>26} {:>22} {:>14} {:>8}",
        "variant", "duplicate credits per run", "lost messages per run", "msgs/s no kill", "exact"
    );
    for r in results {
        let rate = r
            .throughput
            .map_or_else(|| "-".to_owned(), |t| format!("{t:.1}"));
        println!(
            "{:<32} {:>26} {:>22} {:>14} {:>8}",
            r.variant.label(),
            r.duplicates().show(),
            r.lost().show(),
            rate,
            if r.runs.iter().all(|x| x.balances_exact) {
                "yes"
            } else {
                "no"
            }
        );
    }
    println!("median (min–max) per run; throughput from one run with no kills");
}

/// One JSON line per broker and variant.
pub(crate) fn json_lines(results: &[VariantResult]) {
    for r in results {
        match serde_json::to_string(&r.json()) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("cannot write the JSON line: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_min_max() {
        let s = spread([5, 0, 7, 3, 6]);
        assert_eq!((s.median, s.min, s.max), (5.0, 0, 7));
        assert_eq!(spread([1, 2]).median, 1.5);
        assert_eq!(spread([3, 4]).show(), "3.5 (3–4)");
    }
}
