//! The article's table per broker, and one JSON line per broker and variant.

use std::path::{Path, PathBuf};

use inbox_conformance::kill::KillReport;
use inbox_core::BoxError;
use serde::{Deserialize, Serialize};

use crate::chart;
use crate::cli::{BrokerKind, Variant};

/// Every run of one variant on one broker.
#[derive(Debug, Clone)]
pub(crate) struct VariantResult {
    pub(crate) broker: BrokerKind,
    pub(crate) variant: Variant,
    pub(crate) events: u32,
    pub(crate) kills_per_run: u32,
    /// Each run; its self-crashes are the aborts of `--crash-between-commit-and-ack`.
    pub(crate) runs: Vec<KillReport>,
    /// Messages per second of a run with no kills.
    pub(crate) throughput: Option<f64>,
    /// How long each handler slept.
    pub(crate) work_ms: u64,
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
    pub(crate) fn duplicates(&self) -> Spread {
        spread(self.runs.iter().map(|r| r.duplicates))
    }

    pub(crate) fn lost(&self) -> Spread {
        spread(self.runs.iter().map(|r| r.lost))
    }

    /// The JSON line of this result.
    pub(crate) fn json_line(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(&self.json())
    }

    fn json(&self) -> Line {
        Line {
            broker: self.broker.name().to_owned(),
            variant: self.variant.name().to_owned(),
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
            work_ms: Some(self.work_ms),
        }
    }

    /// Back from a JSON line. Per-run kills are the same in every run; the line keeps only the
    /// totals of self-crashes (put on the first run) and of exact balances (put on every run).
    fn from_line(line: Line) -> Result<Self, String> {
        let runs = line.duplicates_per_run.len();
        if runs == 0 || line.lost_per_run.len() != runs {
            return Err(format!(
                "{} {}: no runs, or per-run lists of different lengths",
                line.broker, line.variant
            ));
        }
        let kills = line.kills / runs as u32;
        let runs = line
            .duplicates_per_run
            .iter()
            .zip(&line.lost_per_run)
            .enumerate()
            .map(|(i, (&duplicates, &lost))| KillReport {
                kills,
                self_crashes: if i == 0 { line.self_crashes } else { 0 },
                duplicates,
                lost,
                balances_exact: line.balances_exact,
                ..KillReport::default()
            })
            .collect::<Vec<_>>();
        Ok(Self {
            broker: line.broker.parse()?,
            variant: line.variant.parse()?,
            events: u32::try_from(line.events / runs.len() as u64).map_err(|e| e.to_string())?,
            kills_per_run: kills,
            runs,
            throughput: line.throughput,
            work_ms: line.work_ms.unwrap_or(10),
        })
    }
}

/// The machine-readable summary the smoke test, scripts and `evidence report` read.
#[derive(Debug, Serialize, Deserialize)]
struct Line {
    broker: String,
    variant: String,
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
    /// Absent in lines written before it was added: 10 ms, the default, then.
    #[serde(default)]
    work_ms: Option<u64>,
}

/// Prints the article's table for one broker.
pub(crate) fn table(results: &[VariantResult]) {
    let Some(first) = results.first() else {
        return;
    };
    println!(
        "\n{}: {} events, {} kills per run, handlers sleep {} ms",
        first.broker, first.events, first.kills_per_run, first.work_ms
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
            r.runs.len(),
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
            let line: Line = serde_json::from_str(raw)
                .map_err(|e| format!("{}:{}: {e}", file.display(), n + 1))?;
            let result = VariantResult::from_line(line)
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
        let result = VariantResult {
            broker: BrokerKind::Redis,
            variant: Variant::B,
            events: 10_000,
            kills_per_run: 20,
            runs: [4, 6]
                .into_iter()
                .map(|duplicates| KillReport {
                    kills: 20,
                    self_crashes: 3,
                    duplicates,
                    balances_exact: false,
                    ..KillReport::default()
                })
                .collect(),
            throughput: Some(61.5),
            work_ms: 10,
        };
        let line = serde_json::to_string(&result.json()).unwrap();
        let dir = std::env::temp_dir().join(format!("wallet-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("lines.txt");
        std::fs::write(&file, format!("a table line\n{VARIANT_DONE}{line}\n")).unwrap();
        let back = read_lines(&[&file]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(serde_json::to_string(&back[0].json()).unwrap(), line);
        assert_eq!(back[0].duplicates(), spread([4, 6]));
    }

    #[test]
    fn a_line_with_mismatched_runs_is_refused() {
        let line: Line = serde_json::from_str(
            r#"{"broker":"kafka","variant":"c","runs":2,"kills":40,"self_crashes":0,"events":20000,
               "duplicates":0,"lost":0,"balances_exact":true,"duplicates_per_run":[0,0],
               "lost_per_run":[0],"throughput":null}"#,
        )
        .unwrap();
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
