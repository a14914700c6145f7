//! Progress of the long runs on stderr, the only place that knows about `indicatif`: the
//! operator CLI's `purge`, `measure-storage` and `dead-letters replay`, and the evidence tool's
//! runs. Stdout never carries progress, so `--json` output stays one object.
//!
//! - stderr a terminal and no `--json`: an `indicatif` bar (when the total is known or
//!   estimated: rate and ETA) or a spinner (count and rate), redrawn in place and cleared when
//!   the command ends.
//! - stderr not a terminal (a CI log, a file, a pipe), or `--json`: nothing is ever redrawn (a
//!   carriage return would pile every update into one long log line); a plain line every 10 s
//!   instead, none for a command done sooner, and the last state on [`Progress::finish`].
//!   `INBOX_ADMIN_PROGRESS_EVERY` sets that period (humantime, like `30s`; `off` prints none).

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{HumanCount, HumanDuration, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::task::JoinHandle;

/// The period of the plain lines off a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(10);
/// The environment variable that overrides [`PLAIN_EVERY`].
const EVERY_VAR: &str = "INBOX_ADMIN_PROGRESS_EVERY";

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    /// Redrawn in place on a terminal.
    Bar,
    /// A plain line per period, or none.
    Lines(Option<Duration>),
}

impl Output {
    fn choose(json: bool, stderr_is_terminal: bool, every: Option<&str>) -> Self {
        if stderr_is_terminal && !json {
            return Output::Bar;
        }
        Output::Lines(match every.map(str::trim) {
            None => Some(PLAIN_EVERY),
            Some("off" | "0" | "never") => None,
            Some(text) => Some(
                humantime::parse_duration(text)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .unwrap_or(PLAIN_EVERY),
            ),
        })
    }
}

/// What a [`Progress`] counts: `rows` `deleted`.
#[derive(Debug, Clone, Copy)]
pub struct Counting {
    /// The items counted (plural).
    pub unit: &'static str,
    /// What happened to them.
    pub verb: &'static str,
}

/// The progress of one long command, counting up to a total when one is known. Dropping it
/// clears the bar and stops the plain lines.
#[derive(Debug)]
pub struct Progress {
    counter: Counter,
    /// The task printing the plain lines.
    lines: Option<JoinHandle<()>>,
}

/// The count of a [`Progress`], shared with whatever observes the work.
#[derive(Debug, Clone)]
pub struct Counter {
    bar: ProgressBar,
    output: Output,
    /// What the lines start with: `inbox-admin purge`, `redis c run 1/3`.
    label: Arc<str>,
    counting: Counting,
    /// The total is an estimate (shown as `~N`, raised when the count passes it).
    estimated: bool,
}

impl Progress {
    /// Starts showing the progress of `label` towards `total` (`None`: a spinner), `estimated`
    /// when that total is a guess. `json`: the command prints JSON, so progress is never drawn.
    pub fn start(
        label: impl Into<String>,
        counting: Counting,
        total: Option<u64>,
        estimated: bool,
        json: bool,
    ) -> Self {
        let label: Arc<str> = label.into().into();
        let every = std::env::var(EVERY_VAR).ok();
        let output = Output::choose(json, std::io::stderr().is_terminal(), every.as_deref());
        let (bar, lines) = match output {
            Output::Bar => {
                let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr())
                    .with_style(style(&label, counting, total.is_some(), estimated));
                bar.enable_steady_tick(Duration::from_millis(120));
                (bar, None)
            }
            Output::Lines(every) => {
                let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::hidden());
                let lines = every.map(|every| {
                    let (bar, label) = (bar.clone(), label.clone());
                    tokio::spawn(async move {
                        let first = tokio::time::Instant::now() + every;
                        let mut tick = tokio::time::interval_at(first, every);
                        loop {
                            tick.tick().await;
                            eprintln!("{}", plain_line(&label, counting, &bar, estimated));
                        }
                    })
                });
                (bar, lines)
            }
        };
        Self {
            counter: Counter {
                bar,
                output,
                label,
                counting,
                estimated,
            },
            lines,
        }
    }

    /// A bar of `label` towards a known `total` of `unit` `verb`, drawn whatever stdout carries.
    pub fn bar(
        label: impl Into<String>,
        total: u64,
        unit: &'static str,
        verb: &'static str,
    ) -> Self {
        Self::start(label, Counting { unit, verb }, Some(total), false, false)
    }

    /// A handle on the count, for a task that observes the work.
    pub fn counter(&self) -> Counter {
        self.counter.clone()
    }

    /// Ends the progress; off a terminal, with a last plain line of the state reached.
    pub fn finish(self) {
        if self.lines.is_some() {
            let c = &self.counter;
            eprintln!("{}", plain_line(&c.label, c.counting, &c.bar, c.estimated));
        }
    }
}

impl std::ops::Deref for Progress {
    type Target = Counter;

    fn deref(&self) -> &Counter {
        &self.counter
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(lines) = self.lines.take() {
            lines.abort();
        }
        self.counter.bar.finish_and_clear();
    }
}

impl Counter {
    /// Sets how many items are done (a negative count is 0).
    pub fn set_position(&self, done: impl TryInto<u64>) {
        let done = done.try_into().unwrap_or(0);
        if self.estimated && self.bar.length().is_some_and(|len| done > len) {
            self.bar.set_length(done);
        }
        self.bar.set_position(done);
    }

    /// Counts `n` more items done.
    pub fn inc(&self, n: u64) {
        self.set_position(self.bar.position().saturating_add(n));
    }

    /// Sets the short note after the count (the batch, the run), shown in parentheses.
    pub fn set_message(&self, note: impl AsRef<str>) {
        self.bar.set_message(format!(" ({})", note.as_ref()));
    }

    /// What the lines start with, for messages about this run.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Prints `line` on stderr: above the bar on a terminal, as it is elsewhere.
    pub fn println(&self, line: &str) {
        match self.output {
            Output::Bar => self.bar.println(line),
            Output::Lines(_) => eprintln!("{line}"),
        }
    }
}

fn style(command: &str, counting: Counting, total: bool, estimated: bool) -> ProgressStyle {
    let Counting { unit, verb } = counting;
    let template = if total {
        let about = if estimated { "~" } else { "" };
        format!(
            "{{spinner}} {command} [{{bar:30}}] {{human_pos}}/{about}{{human_len}} {unit} {verb}\
             {{msg}} ({{per_sec:0}}, ETA {{eta}}, {{elapsed}})"
        )
    } else {
        format!(
            "{{spinner}} {command} {{human_pos}} {unit} {verb}{{msg}} ({{per_sec:0}}, {{elapsed}})"
        )
    };
    ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
        .progress_chars("=> ")
}

/// The plain line printed off a terminal: `inbox-admin purge: 12,000 of ~40,000 rows deleted
/// (batch ~12), 4,000 rows/s, ETA 7s, elapsed 3s`.
fn plain_line(label: &str, counting: Counting, bar: &ProgressBar, estimated: bool) -> String {
    let Counting { unit, verb } = counting;
    let done = bar.position();
    let elapsed = bar.elapsed();
    let mut line = format!("{label}: {}", HumanCount(done));
    if let Some(len) = bar.length() {
        let about = if estimated { "~" } else { "" };
        line += &format!(" of {about}{}", HumanCount(len));
    }
    line += &format!(" {unit} {verb}{}", bar.message());
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        let rate = done as f64 / secs;
        line += &format!(", {} {unit}/s", HumanCount(rate.round() as u64));
        if let Some(len) = bar.length().filter(|&len| rate > 0.0 && len > done) {
            let eta = Duration::from_secs_f64((len - done) as f64 / rate);
            line += &format!(", ETA {:#}", HumanDuration(eta));
        }
    }
    line + &format!(", elapsed {:#}", HumanDuration(elapsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PURGE: Counting = Counting {
        unit: "rows",
        verb: "deleted",
    };

    #[test]
    fn a_bar_only_on_a_terminal_and_never_with_json() {
        assert_eq!(Output::choose(false, true, None), Output::Bar);
        assert_eq!(Output::choose(false, true, Some("1s")), Output::Bar);
        assert_eq!(
            Output::choose(true, true, None),
            Output::Lines(Some(PLAIN_EVERY))
        );
        assert_eq!(
            Output::choose(false, false, None),
            Output::Lines(Some(PLAIN_EVERY))
        );
        assert_eq!(
            Output::choose(false, false, Some("250ms")),
            Output::Lines(Some(Duration::from_millis(250)))
        );
        assert_eq!(
            Output::choose(true, false, Some("off")),
            Output::Lines(None)
        );
        for bad in ["0s", "soon", ""] {
            assert_eq!(
                Output::choose(false, false, Some(bad)),
                Output::Lines(Some(PLAIN_EVERY)),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_plain_line_is_one_line_with_the_count_the_total_and_the_rate() {
        let bar = ProgressBar::with_draw_target(Some(40_000), ProgressDrawTarget::hidden())
            .with_elapsed(Duration::from_secs(3));
        bar.set_position(12_000);
        Counter {
            bar: bar.clone(),
            output: Output::Lines(None),
            label: "inbox-admin purge".into(),
            counting: PURGE,
            estimated: true,
        }
        .set_message("batch ~12");
        let line = plain_line("inbox-admin purge", PURGE, &bar, true);
        assert!(
            line.starts_with("inbox-admin purge: 12,000 of ~40,000 rows deleted (batch ~12), "),
            "{line}"
        );
        assert!(line.contains(" rows/s, ETA "), "{line}");
        assert!(!line.contains(['\r', '\n', '\x1b']), "{line:?}");

        let spinner = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        spinner.set_position(7);
        let line = plain_line("inbox-admin purge", PURGE, &spinner, false);
        assert!(
            line.starts_with("inbox-admin purge: 7 rows deleted, "),
            "{line}"
        );
        assert!(!line.contains("ETA") && !line.contains(" of "), "{line}");
    }
}
