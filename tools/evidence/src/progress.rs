//! The progress of a long run on stderr, and the only place that knows about `indicatif`.
//!
//! A [`Bar`] counts up to a known total; callers report numbers (events applied, a short
//! message such as the kills so far) and the rate and the ETA are worked out here. On a terminal
//! it is an `indicatif` bar, redrawn in place. Anywhere else (a CI log, a file, a pipe) a
//! carriage return would pile every update into one huge line, so the bar is hidden (it still
//! estimates the rate) and a plain line is printed every 10 s at most, from the bar's start, and
//! the last one when the bar finishes. Notes (a stall, a retry) always get a line of their own.

use std::io::IsTerminal;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{HumanDuration, MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a plain line is printed when stderr is not a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// Whether stderr is a terminal, looked up once.
static TERMINAL: LazyLock<bool> = LazyLock::new(|| std::io::stderr().is_terminal());

/// Every terminal bar is drawn through this, so a note can clear the bars and redraw them.
static BARS: LazyLock<MultiProgress> =
    LazyLock::new(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()));

/// The progress of one run or phase towards `total` items.
#[derive(Debug)]
pub(crate) struct Bar {
    bar: ProgressBar,
    label: String,
    /// What is counted: "events applied", "done", "msgs".
    unit: &'static str,
    /// Off a terminal: when the last plain line was printed, and whether a newer state is unsaid.
    plain: Option<Mutex<Plain>>,
}

#[derive(Debug)]
struct Plain {
    /// When the last line was printed, or the bar started.
    printed_at: Instant,
    pending: bool,
}

impl Bar {
    /// A bar for `label` (`redis c run 1/3`) counting `unit` up to `total`.
    pub(crate) fn new(label: impl Into<String>, total: u64, unit: &'static str) -> Self {
        let label = label.into();
        let (bar, plain) = if *TERMINAL {
            let template = format!(
                "{{prefix}} [{{bar:25.cyan/blue}}] {{pos}}/{{len}} {unit}{{msg}} \
                 ({{per_sec:0}}, ETA {{eta}}, {{elapsed_precise}})"
            );
            let style = ProgressStyle::with_template(&template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            let bar = BARS.add(ProgressBar::new(total).with_style(style));
            bar.enable_steady_tick(Duration::from_secs(1));
            (bar, None)
        } else {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
            let plain = Plain {
                printed_at: Instant::now(),
                pending: false,
            };
            (bar, Some(Mutex::new(plain)))
        };
        bar.set_prefix(label.clone());
        Self {
            bar,
            label,
            unit,
            plain,
        }
    }

    /// The label given to [`Bar::new`], for messages about this run.
    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    /// Sets how many items are done (a negative count is 0).
    pub(crate) fn set_applied(&self, n: impl TryInto<u64>) {
        self.bar.set_position(n.try_into().unwrap_or(0));
        self.plain_line(false);
    }

    /// Sets the short text shown after the count: `kill 2/5`, `draining`; empty for none. Off
    /// a terminal it shows in the next line printed (set it before the count).
    pub(crate) fn set_message(&self, message: impl AsRef<str>) {
        let message = message.as_ref();
        if message.is_empty() {
            self.bar.set_message("");
        } else {
            self.bar.set_message(format!(", {message}"));
        }
        if let Some(plain) = &self.plain {
            plain.lock().unwrap_or_else(PoisonError::into_inner).pending = true;
        }
    }

    /// A message of its own line, above the bar on a terminal.
    pub(crate) fn note(&self, message: &str) {
        note(message);
    }

    /// Ends the bar: a terminal's is cleared; elsewhere the newest state not yet printed is.
    pub(crate) fn finish(self) {
        // The work is in `Drop`, so a bar dropped on an error path ends too.
        drop(self);
    }

    /// Off a terminal: prints the state now if the last line (or the start) is 10 s old, or
    /// when `last` and a state is unsaid; otherwise remembers that one is unsaid.
    fn plain_line(&self, last: bool) {
        let Some(plain) = &self.plain else { return };
        let mut plain = plain.lock().unwrap_or_else(PoisonError::into_inner);
        let due = plain.printed_at.elapsed() >= PLAIN_EVERY;
        if !((last && plain.pending) || (!last && due)) {
            plain.pending |= !last;
            return;
        }
        let (pos, len) = (self.bar.position(), self.bar.length().unwrap_or(0));
        let elapsed = self.bar.elapsed();
        // The mean rate once all are done; before, the recent one and the time left at it.
        let rate = if pos >= len {
            format!("{:.0}/s", pos as f64 / elapsed.as_secs_f64().max(1e-3))
        } else if self.bar.per_sec() > 0.0 {
            let eta = HumanDuration(self.bar.eta());
            format!("{:.0}/s, ETA {eta:#}", self.bar.per_sec())
        } else {
            "0/s".to_owned()
        };
        eprintln!(
            "{}: {pos}/{len} {}{} ({rate}, {}:{:02} elapsed)",
            self.label,
            self.unit,
            self.bar.message(),
            elapsed.as_secs() / 60,
            elapsed.as_secs() % 60,
        );
        plain.printed_at = Instant::now();
        plain.pending = false;
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if self.plain.is_some() {
            self.plain_line(true);
        } else {
            self.bar.finish_and_clear();
            BARS.remove(&self.bar);
        }
    }
}

/// A message of its own line on stderr (a stall, a retry): above any bar on a terminal.
pub(crate) fn note(message: &str) {
    if *TERMINAL {
        BARS.suspend(|| eprintln!("{message}"));
    } else {
        eprintln!("{message}");
    }
}
