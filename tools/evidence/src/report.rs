//! The article's table per broker, and one JSON line per broker and variant.

use std::path::{Path, PathBuf};

use inbox_conformance::kill::KillReport;
use inbox_core::BoxError;
use serde::{Deserialize, Serialize};

use crate::chart;
use crate::cli::{BrokerKind, Variant};

/// Every run of one variant on one broker, as its JSON line says it: the machine-readable
/// summary the smoke test, scripts and `evidence report` read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct VariantResult {
    pub(crate) broker: BrokerKind,
    pub(crate) variant: Variant,
    runs: usize,
    /// In all runs, as are the events, duplicates and losses.
    kills: u32,
    /// The aborts of `--crash-between-commit-and-ack`.
    self_crashes: u32,
    events: u64,
    duplicates: i64,
    lost: i64,
    /// In every run.
    balances_exact: bool,
    duplicates_per_run: Vec<i64>,
    lost_per_run: Vec<i64>,
    /// Messages per second of a run with no kills.
    throughput: Option<f64>,
    /// How long each handler slept; absent in lines written before it was added: 10 ms, the
    /// default, then.
    #[serde(default = "default_work_ms")]
    work_ms: u64,
}

fn default_work_ms() -> u64 {
    10
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
    /// `median (min–max)`.
    pub(crate) fn show(self) -> String {
        let median = if self.median.fract() == 0.0 {
            format!("{}", self.median)
        } else {
            format!("{:.1}", self.median)
        };
        format!("{median} ({}–{})", self.min, self.max)
    }
}

impl VariantResult {
    /// The result of `runs` of `events` each, and of the no-kill run's `throughput`.
    pub(crate) fn new(
        broker: BrokerKind,
        variant: Variant,
        events: u32,
        runs: &[KillReport],
        throughput: Option<f64>,
        work_ms: u64,
    ) -> Self {
        Self {
            broker,
            variant,
            runs: runs.len(),
            kills: runs.iter().map(|r| r.kills).sum(),
            self_crashes: runs.iter().map(|r| r.self_crashes).sum(),
            events: u64::from(events) * runs.len() as u64,
            duplicates: runs.iter().map(|r| r.duplicates).sum(),
            lost: runs.iter().map(|r| r.lost).sum(),
            balances_exact: runs.iter().all(|r| r.balances_exact),
            duplicates_per_run: runs.iter().map(|r| r.duplicates).collect(),
            lost_per_run: runs.iter().map(|r| r.lost).collect(),
            throughput: throughput.map(|t| (t * 10.0).round() / 10.0),
            work_ms,
        }
    }

    pub(crate) fn duplicates(&self) -> Spread {
        spread(self.duplicates_per_run.iter().copied())
    }

    pub(crate) fn lost(&self) -> Spread {
        spread(self.lost_per_run.iter().copied())
    }

    /// Kills per run: the same in every run.
    pub(crate) fn kills_per_run(&self) -> u32 {
        self.kills / self.runs.max(1) as u32
    }

    /// The JSON line of this result.
    pub(crate) fn json_line(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(self)
    }

    /// Back from a JSON line, refused with no runs or with per-run lists of other lengths.
    fn from_line(line: &str) -> Result<Self, String> {
        let result: Self = serde_json::from_str(line).map_err(|e| e.to_string())?;
        let runs = result.duplicates_per_run.len();
        if runs == 0 || result.lost_per_run.len() != runs {
            return Err(format!(
                "{} {}: no runs, or per-run lists of different lengths",
                result.broker, result.variant
            ));
        }
        Ok(result)
    }
}

/// Prints the article's table for one broker.
pub(crate) fn table(results: &[VariantResult]) {
    let Some(first) = results.first() else {
        return;
    };
    println!(
        "\n{}: {} events, {} kills per run, handlers sleep {} ms",
        first.broker,
        first.events / first.runs.max(1) as u64,
        first.kills_per_run(),
        first.work_ms
    );
    println!(
        "{:<32} {:>4} {:>26} {:>22} {:>14} {:>8}",
        "variant",
        "runs",
        "duplicate credits per run",
        "lost messages per run",
        "msgs/s no kill",
        "exact"
    );
    for r in results {
        let rate = r
            .throughput
            .map_or_else(|| "-".to_owned(), |t| format!("{t:.1}"));
        println!(
            "{:<32} {:>4} {:>26} {:>22} {:>14} {:>8}",
            r.variant.label(),
            r.runs,
            r.duplicates().show(),
            r.lost().show(),
            rate,
            if r.balances_exact { "yes" } else { "no" }
        );
    }
    println!("median (min–max) per run; throughput from one run with no kills");
}

/// Precedes a variant's JSON line as soon as its runs are done, before the summary at the end.
pub(crate) const VARIANT_DONE: &str = "variant done: ";

/// One JSON line per broker and variant.
pub(crate) fn json_lines(results: &[VariantResult]) {
    for r in results {
        match r.json_line() {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("cannot write the JSON line: {e}"),
        }
    }
}

/// The results in the JSON lines of `files`, also those a cut-short kill test printed after
/// [`VARIANT_DONE`] (other lines, such as the tables, are passed over), in the order read; a
/// later line for the same broker and variant replaces an earlier one.
pub(crate) fn read_lines(files: &[impl AsRef<Path>]) -> Result<Vec<VariantResult>, BoxError> {
    let mut results: Vec<VariantResult> = Vec::new();
    for file in files {
        let file = file.as_ref();
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("reading {}: {e}", file.display()))?;
        for (n, raw) in text.lines().enumerate() {
            let raw = raw.trim();
            // After progress lines drawn with carriage returns, the marker is mid-line.
            let raw = match raw.find(VARIANT_DONE) {
                Some(at) => &raw[at + VARIANT_DONE.len()..],
                None => raw,
            };
            if !raw.starts_with('{') {
                continue;
            }
            let result = VariantResult::from_line(raw)
                .map_err(|e| format!("{}:{}: {e}", file.display(), n + 1))?;
            results.retain(|r| (r.broker, r.variant) != (result.broker, result.variant));
            results.push(result);
        }
    }
    Ok(results)
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

    #[test]
    fn a_json_line_reads_back_to_the_same_line() {
        let runs: Vec<_> = [4, 6]
            .into_iter()
            .map(|duplicates| KillReport {
                kills: 20,
                self_crashes: 3,
                duplicates,
                balances_exact: false,
                ..KillReport::default()
            })
            .collect();
        let result =
            VariantResult::new(BrokerKind::Redis, Variant::B, 10_000, &runs, Some(61.5), 10);
        let line = result.json_line().unwrap();
        let dir = std::env::temp_dir().join(format!("wallet-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("lines.txt");
        std::fs::write(&file, format!("a table line\n{VARIANT_DONE}{line}\n")).unwrap();
        let back = read_lines(&[&file]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].json_line().unwrap(), line);
        assert_eq!(back[0].duplicates(), spread([4, 6]));
    }

    #[test]
    fn a_line_with_mismatched_runs_is_refused() {
        let line = r#"{"broker":"kafka","variant":"c","runs":2,"kills":40,"self_crashes":0,
            "events":20000,"duplicates":0,"lost":0,"balances_exact":true,
            "duplicates_per_run":[0,0],"lost_per_run":[0],"throughput":null}"#;
        assert!(VariantResult::from_line(line).is_err());
    }
}

/// `evidence report`.
#[derive(Debug, clap::Args)]
pub(crate) struct ReportArgs {
    /// Where the chart goes.
    #[arg(
        long,
        value_name = "SVG",
        default_value = "target/wallet-kill-test.svg"
    )]
    pub(crate) chart: PathBuf,
    /// Files holding the output (the JSON lines) of `evidence kill-test`.
    #[arg(value_name = "FILE", required = true)]
    pub(crate) files: Vec<PathBuf>,
}

/// `evidence report`: the tables, one chart and the JSON lines again, from the output of kill
/// tests run separately (one broker at a time, say).
pub(crate) fn from_files(args: &ReportArgs) -> Result<(), BoxError> {
    let (chart, files) = (&args.chart, &args.files);
    let mut results = read_lines(files)?;
    results.sort_by_key(|r| (r.broker, r.variant));
    for broker in BrokerKind::ALL {
        let of_broker: Vec<_> = results
            .iter()
            .filter(|r| r.broker == broker)
            .cloned()
            .collect();
        table(&of_broker);
    }
    chart::write(chart, &results)?;
    println!("\nchart: {}\n", chart.display());
    json_lines(&results);
    Ok(())
}
