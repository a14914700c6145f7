//! The status line of a long run on stderr. On a terminal it is rewritten in place; anywhere
//! else (a CI log, a file, a pipe) a carriage return would pile every update into one huge line,
//! so a plain line is printed at most every 10 s, and the last one when the phase ends.

use std::io::{IsTerminal, Write};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often a plain line is printed when stderr is not a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct State {
    /// Whether stderr is a terminal; looked up on first use.
    terminal: Option<bool>,
    /// Plain lines: when the last one was printed, and the newest one not printed yet.
    printed_at: Option<Instant>,
    pending: Option<String>,
}

static STATE: Mutex<State> = Mutex::new(State {
    terminal: None,
    printed_at: None,
    pending: None,
});

fn with_state<T>(f: impl FnOnce(&mut State, bool, &mut std::io::Stderr) -> T) -> T {
    let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
    let mut err = std::io::stderr();
    let terminal = *state.terminal.get_or_insert_with(|| err.is_terminal());
    let out = f(&mut state, terminal, &mut err);
    let _ = err.flush();
    out
}

/// Shows `line` as the current status.
pub(crate) fn show(line: &str) {
    with_state(|state, terminal, err| {
        if terminal {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else if state
            .printed_at
            .is_none_or(|at| at.elapsed() >= PLAIN_EVERY)
        {
            let _ = writeln!(err, "{line}");
            state.printed_at = Some(Instant::now());
            state.pending = None;
        } else {
            state.pending = Some(line.to_owned());
        }
    });
}

/// Ends the current status: a terminal's line is cleared, elsewhere the newest line not yet
/// printed is printed, and the next status starts with a line at once.
pub(crate) fn finish() {
    with_state(|state, terminal, err| {
        if terminal {
            let _ = write!(err, "\r\x1b[2K");
        } else if let Some(line) = state.pending.take() {
            let _ = writeln!(err, "{line}");
        }
        state.printed_at = None;
    });
}

/// A message of its own line on stderr, in the middle of a status (a stall, a retry).
pub(crate) fn note(message: &str) {
    with_state(|_, terminal, err| {
        if terminal {
            let _ = write!(err, "\r\x1b[2K");
        }
        let _ = writeln!(err, "{message}");
    });
}
