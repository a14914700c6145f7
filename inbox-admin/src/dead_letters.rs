//! `dead-letters list | show | replay`: the broker mapping is the adapters' (`XDeadLetters`
//! and `XProducer`); listing, selecting and replaying are `inbox_core::replay`'s; reaching the
//! broker is [`brokers`](crate::brokers)'. This file runs the commands and prints.

use std::time::SystemTime;

use inbox_core::replay::{self, DeadLetter, DeadLetters, ReplayReport, Selection, Summary, Tally};

use crate::args::{DeadLettersCommand, DeadLettersList, DeadLettersReplay, DeadLettersShow};
use crate::brokers::{hide_property_values, kafka_properties, open};
use crate::CliError;
use inbox_admin::progress::{Counting, Progress};

/// What `replay` counts.
const REPLAY: Counting = Counting {
    unit: "dead letters",
    verb: "moved",
};

/// Runs one `dead-letters` command; its lines for stdout.
pub(crate) async fn run(command: DeadLettersCommand) -> Result<Vec<String>, CliError> {
    let properties = kafka_properties(match &command {
        DeadLettersCommand::List(list) => &list.from,
        DeadLettersCommand::Show(show) => &show.from,
        DeadLettersCommand::Replay(replay) => &replay.from,
    });
    let done = match command {
        DeadLettersCommand::List(list) => self::list(list).await,
        DeadLettersCommand::Show(show) => self::show(show).await,
        DeadLettersCommand::Replay(replay) => self::replay(replay).await,
    };
    done.map_err(|e| hide_property_values(e, &properties))
}

async fn list(args: DeadLettersList) -> Result<Vec<String>, CliError> {
    // One pass: on RabbitMQ each reading counts as a delivery of every message.
    let (mut letters, _) = open(&args.from, false).await?;
    let name = letters.name().to_owned();
    let mut summary = Summary::default();
    let mut each = Vec::new();
    let (json, listed) = (args.json, args.each);
    replay::scan(&mut *letters, &mut |l| {
        summary.add(l);
        if !listed {
            return;
        }
        each.push(if json {
            let mut value = letter_json(l);
            if let Some(fields) = value.as_object_mut() {
                fields.remove("payload");
                fields.remove("headers");
            }
            value.to_string()
        } else {
            format!(
                "{:<28}  {:<38}  {:<20}  {}",
                l.position,
                l.id.as_ref().map_or("-", |id| id.as_str()),
                when(l.timestamp),
                l.reason.as_deref().unwrap_or("-")
            )
        });
    })
    .await?;
    if args.json {
        let tally = |t: &Tally| {
            serde_json::json!({
                "count": t.count,
                "oldest": t.oldest.map(time),
                "newest": t.newest.map(time),
            })
        };
        let by_reason: Vec<serde_json::Value> = summary
            .by_reason
            .iter()
            .map(|(reason, t)| {
                let mut value = tally(t);
                value["reason"] = serde_json::json!(reason);
                value
            })
            .collect();
        let mut line = tally(&summary.total);
        line["destination"] = serde_json::json!(name);
        line["broker"] = serde_json::json!(args.from.broker.name());
        line["by_reason"] = serde_json::json!(by_reason);
        return Ok(std::iter::once(line.to_string()).chain(each).collect());
    }
    let total = &summary.total;
    let mut lines = vec![
        format!("dead letters {name} ({})", args.from.broker.name()),
        format!("count        {}", total.count),
        format!("oldest       {}", when(total.oldest)),
        format!("newest       {}", when(total.newest)),
    ];
    if total.count > 0 {
        lines.push(String::new());
        lines.push(format!(
            "{:>8}  {:<20}  {:<20}  reason",
            "count", "oldest", "newest"
        ));
        for (reason, t) in &summary.by_reason {
            lines.push(format!(
                "{:>8}  {:<20}  {:<20}  {}",
                t.count,
                when(t.oldest),
                when(t.newest),
                reason.as_deref().unwrap_or("(none)")
            ));
        }
    }
    if !each.is_empty() {
        lines.push(String::new());
        lines.push(format!(
            "{:<28}  {:<38}  {:<20}  reason",
            "position", "message id", "time"
        ));
        lines.extend(each);
    }
    Ok(lines)
}

async fn show(args: DeadLettersShow) -> Result<Vec<String>, CliError> {
    let (mut letters, _) = open(&args.from, false).await?;
    let name = letters.name().to_owned();
    let Some(letter) = replay::find(&mut *letters, &args.position).await? else {
        return Err(CliError::Refused(format!(
            "no dead letter at position or with message ID `{}` in {name}; `dead-letters \
             list --each` lists them",
            args.position
        )));
    };
    Ok(if args.json {
        vec![letter_json(&letter).to_string()]
    } else {
        letter_lines(&letter)
    })
}

async fn replay(args: DeadLettersReplay) -> Result<Vec<String>, CliError> {
    let mut selection = Selection::all();
    if let Some(reason) = &args.reason {
        selection = selection.reason(reason.clone());
    }
    if let Some(since) = args.since {
        selection = selection.since(since);
    }
    if let Some(until) = args.until {
        selection = selection.until(until);
    }
    let (mut letters, publisher) = open(&args.from, true).await?;
    let publisher = publisher.expect("opened for a replay");
    let name = letters.name().to_owned();
    let progress = Progress::start(
        "inbox-admin dead-letters replay",
        REPLAY,
        None,
        false,
        args.json,
    );
    let counter = progress.counter();
    let mut observe = move |report: &ReplayReport| counter.set_position(report.moved);
    let report = replay::replay(
        &mut *letters,
        &*publisher,
        &selection,
        args.dry_run,
        &mut observe,
    )
    .await?;
    drop(progress);
    if args.json {
        let line = serde_json::json!({
            "destination": name,
            "broker": args.from.broker.name(),
            "dry_run": args.dry_run,
            "read": report.read,
            "selected": report.selected,
            "moved": report.moved,
            "unreplayable": report.unreplayable,
            "duplicates": report.duplicates,
            "by_source": report.by_source,
        });
        return Ok(vec![line.to_string()]);
    }
    let mut lines = vec![format!(
        "read {} dead letters from {name}, {} selected",
        report.read, report.selected
    )];
    for (source, n) in &report.by_source {
        let verb = if args.dry_run { "would move" } else { "moved" };
        lines.push(format!("  {verb} {n} to {source}"));
    }
    if report.duplicates > 0 {
        lines.push(format!(
            "  of those, {} letters of an ID already replayed to the same source: removed \
             without another copy",
            report.duplicates
        ));
    }
    if report.unreplayable > 0 {
        lines.push(format!(
            "left {} selected dead letters in place: they have no message ID or name no \
             original source (`show` one to see which)",
            report.unreplayable
        ));
    }
    lines.push(if args.dry_run {
        format!(
            "dry run: would move {}; nothing was published or removed",
            report.moved
        )
    } else {
        format!(
            "moved {}; the inbox will skip those already applied (each keeps its message ID)",
            report.moved
        )
    });
    Ok(lines)
}

fn letter_lines(letter: &DeadLetter) -> Vec<String> {
    let text = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
    let mut lines = vec![
        format!("position           {}", letter.position),
        format!(
            "message id         {}",
            letter
                .id
                .as_ref()
                .map_or("- (none: cannot be replayed)".to_owned(), |id| id
                    .to_string())
        ),
        format!("reason             {}", text(&letter.reason)),
        format!("original source    {}", text(&letter.original_source)),
        format!("original position  {}", text(&letter.original_position)),
        format!("time               {}", when(letter.timestamp)),
        format!("key                {}", text(&letter.key)),
    ];
    for (name, value) in &letter.headers {
        lines.push(format!(
            "header             {name}: {}",
            String::from_utf8_lossy(value)
        ));
    }
    lines.push(format!("payload ({} bytes)", letter.payload.len()));
    lines.push(String::from_utf8_lossy(&letter.payload).into_owned());
    lines
}

fn letter_json(letter: &DeadLetter) -> serde_json::Value {
    let headers: Vec<serde_json::Value> = letter
        .headers
        .iter()
        .map(|(name, value)| {
            serde_json::json!({ "name": name, "value": String::from_utf8_lossy(value) })
        })
        .collect();
    serde_json::json!({
        "position": letter.position,
        "id": letter.id.as_ref().map(|id| id.as_str()),
        "reason": letter.reason,
        "original_source": letter.original_source,
        "original_position": letter.original_position,
        "time": letter.timestamp.map(time),
        "key": letter.key,
        "headers": headers,
        "payload": String::from_utf8_lossy(&letter.payload),
    })
}

/// RFC 3339, to the millisecond, UTC.
fn time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

fn when(t: Option<SystemTime>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| humantime::format_rfc3339_seconds(t).to_string(),
    )
}
