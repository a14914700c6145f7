//! The command line, parsed by hand: a command, then `--name value` or `--name=value` options.

use std::collections::HashMap;
use std::time::Duration;

use crate::CliError;

pub(crate) const USAGE: &str = "\
usage: inbox-admin <command> [options]

commands:
  migrate                                  create the inbox tables and indexes
  purge --older-than 14d [--batch 10000]   delete expired rows in batches, printing each batch
  stats [--min-window 7d]                  rows, bytes per row, oldest remembered time per
                                           consumer; exit status 2 when a consumer's window
                                           (now - oldest) is shorter than --min-window
  measure-storage [--rows 1000000] [--runs 5]
                                           bytes per row for text, uuid v4, uuid v7 and hashed
                                           keys, in a scratch schema dropped afterwards

options for every command:
  --database-url URL   default: $DATABASE_URL, else postgres://postgres:postgres@127.0.0.1:5432/inbox
  --schema NAME        default: the connection's search_path
  --table NAME         default: inbox
  --key-mode MODE      text, uuid or hashed (migrate only); default: text

durations: a number and a unit, s, m, h, d or w (14d, 36h).";

/// A parsed command line.
#[derive(Debug)]
pub(crate) struct Args {
    pub(crate) command: String,
    options: HashMap<String, String>,
}

const COMMON: &[&str] = &["database-url", "schema", "table", "key-mode"];

impl Args {
    pub(crate) fn parse(mut raw: impl Iterator<Item = String>) -> Result<Self, CliError> {
        let command = raw
            .next()
            .ok_or_else(|| CliError::Usage("no command given".to_owned()))?;
        let mut options = HashMap::new();
        while let Some(arg) = raw.next() {
            let Some(name) = arg.strip_prefix("--") else {
                return Err(CliError::Usage(format!("unexpected argument `{arg}`")));
            };
            let (name, value) = match name.split_once('=') {
                Some((name, value)) => (name.to_owned(), value.to_owned()),
                None => {
                    let value = raw.next().ok_or_else(|| {
                        CliError::Usage(format!("option `--{name}` needs a value"))
                    })?;
                    (name.to_owned(), value)
                }
            };
            options.insert(name, value);
        }
        Ok(Self { command, options })
    }

    /// Refuses options `command` does not take, so a typo is not silently ignored.
    pub(crate) fn allow(&self, specific: &[&str]) -> Result<(), CliError> {
        for name in self.options.keys() {
            if !COMMON.contains(&name.as_str()) && !specific.contains(&name.as_str()) {
                return Err(CliError::Usage(format!(
                    "`{}` does not take `--{name}`",
                    self.command
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.options.get(name).map(String::as_str)
    }

    pub(crate) fn duration(&self, name: &str) -> Result<Option<Duration>, CliError> {
        self.get(name).map(|v| parse_duration(name, v)).transpose()
    }

    pub(crate) fn number(&self, name: &str, default: i64) -> Result<i64, CliError> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                CliError::Usage(format!("`--{name} {v}` is not a positive whole number"))
            }),
        }
    }
}

/// `14d`, `36h`, `90m`, `30s`, `2w`.
pub(crate) fn parse_duration(name: &str, value: &str) -> Result<Duration, CliError> {
    let bad = || {
        CliError::Usage(format!(
            "`--{name} {value}` is not a duration (a number and s, m, h, d or w, like 14d)"
        ))
    };
    let split = value.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (number, unit) = value.split_at(split);
    let number: u64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => return Err(bad()),
    };
    number
        .checked_mul(seconds)
        .map(Duration::from_secs)
        .ok_or_else(bad)
}

/// `1d 2h 3m`, for windows printed back to the operator.
pub(crate) fn format_duration(d: Duration) -> String {
    let minutes = d.as_secs() / 60;
    let (days, hours, minutes) = (minutes / 1440, minutes / 60 % 24, minutes % 60);
    match (days, hours) {
        (0, 0) => format!("{minutes}m"),
        (0, _) => format!("{hours}h {minutes}m"),
        _ => format!("{days}d {hours}h {minutes}m"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(
            parse_duration("x", "14d").unwrap(),
            Duration::from_secs(14 * 86_400)
        );
        assert_eq!(
            parse_duration("x", "90m").unwrap(),
            Duration::from_secs(5400)
        );
        for bad in ["", "d", "14", "14x", "-1d", "1.5d"] {
            assert!(parse_duration("x", bad).is_err(), "{bad}");
        }
        assert_eq!(
            format_duration(Duration::from_secs(20 * 86_400 + 3600 + 120)),
            "20d 1h 2m"
        );
    }

    #[test]
    fn options_parse_and_unknown_ones_are_refused() {
        let args = Args::parse(
            ["purge", "--older-than", "14d", "--batch=500"]
                .into_iter()
                .map(String::from),
        )
        .unwrap();
        assert_eq!(args.command, "purge");
        args.allow(&["older-than", "batch"]).unwrap();
        assert_eq!(args.number("batch", 10_000).unwrap(), 500);
        assert!(args.allow(&["older-than"]).is_err());
        assert!(Args::parse(["stats", "--min-window"].into_iter().map(String::from)).is_err());
    }
}
