//! `dead-letters list | show | replay`: the broker mapping is the adapters' (`XDeadLetters`
//! and `XProducer`); listing, selecting and replaying are `inbox_core::replay`'s. This file
//! opens the chosen broker and prints.

use std::time::SystemTime;

use inbox_core::replay::{
    self, DeadLetter, DeadLetters, DynDeadLetters, ReplayReport, Selection, Summary, Tally,
};
use inbox_core::Publish;

use crate::args::{
    Broker, DeadLetterSource, DeadLettersCommand, DeadLettersList, DeadLettersReplay,
    DeadLettersShow,
};
use crate::CliError;
use inbox_admin::progress::{Counting, Progress};

/// What `replay` counts.
const REPLAY: Counting = Counting {
    unit: "dead letters",
    verb: "moved",
};

/// Runs one `dead-letters` command; its lines for stdout.
pub(crate) async fn run(command: DeadLettersCommand) -> Result<Vec<String>, CliError> {
    match command {
        DeadLettersCommand::List(list) => self::list(list).await,
        DeadLettersCommand::Show(show) => self::show(show).await,
        DeadLettersCommand::Replay(replay) => self::replay(replay).await,
    }
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

/// The message attribute or field holding the ID, where the operator named one.
fn id_field(from: &DeadLetterSource) -> Option<&str> {
    from.id_field.as_deref().filter(|f| !f.is_empty())
}

/// A broker this build has no adapter for.
#[allow(dead_code)] // used only when a broker's feature is off
fn not_built(broker: Broker) -> CliError {
    CliError::Refused(format!(
        "this inbox-admin was built without the `{0}` feature: rebuild it with \
         `--features {0}` to read {0} dead letters",
        broker.name()
    ))
}

/// A dead-letter destination's reader and, for a replay, the producer that publishes back to
/// the sources.
type Opened = (
    Box<dyn DynDeadLetters>,
    Option<Box<dyn inbox_core::DynPublish>>,
);

/// The reader of the dead-letter destination `from` names and, when `replay`, the producer:
/// both reach the broker at one address and read the message ID from one field.
#[allow(unused_variables)] // with no broker feature on, no arm uses `replay` and `field`
async fn open(from: &DeadLetterSource, replay: bool) -> Result<Opened, CliError> {
    let field = id_field(from);
    match from.broker {
        #[cfg(feature = "kafka")]
        Broker::Kafka => {
            let brokers = required(
                &from.kafka_brokers,
                "Kafka brokers",
                "kafka-brokers",
                "KAFKA_BROKERS",
            )?;
            let kafka = inbox_kafka::KafkaConnection::new(brokers);
            let mut reader = kafka.dead_letters(&from.from).group(&from.kafka_group);
            let mut producer = kafka.producer();
            if let Some(field) = field {
                reader = reader.id_header(field);
                producer = producer.id_header(field);
            }
            connect(reader.connect(), replay.then(|| producer.connect())).await
        }
        #[cfg(feature = "sqs")]
        Broker::Sqs => {
            let sqs = sqs_connection(from).await;
            let mut reader = sqs.dead_letters(&from.from);
            let mut producer = sqs.producer();
            if let Some(field) = field {
                reader = reader.id_attribute(field);
                producer = producer.id_attribute(field);
            }
            connect(reader.connect(), replay.then(|| producer.connect())).await
        }
        #[cfg(feature = "rabbitmq")]
        Broker::Rabbitmq => {
            let url = required(&from.amqp_url, "RabbitMQ broker", "amqp-url", "AMQP_URL")?;
            let broker = inbox_rabbitmq::RabbitConnection::new(url);
            let mut reader = broker.dead_letters(&from.from);
            if let Some(field) = field {
                reader = reader.id_header(field);
            }
            let producer = broker.producer();
            connect(reader.connect(), replay.then(|| producer.connect())).await
        }
        #[cfg(feature = "redis")]
        Broker::Redis => {
            let url = required(&from.redis_url, "Redis server", "redis-url", "REDIS_URL")?;
            let redis = inbox_redis_streams::RedisConnection::new(url);
            let mut reader = redis.dead_letters(&from.from);
            let mut producer = redis.producer();
            if let Some(field) = field {
                reader = reader.id_field(field);
                producer = producer.id_field(field);
            }
            connect(reader.connect(), replay.then(|| producer.connect())).await
        }
        #[allow(unreachable_patterns)]
        other => Err(not_built(other)),
    }
}

/// Connects `reader` and, when given, `producer`.
#[allow(dead_code)] // unused when no broker feature is on
async fn connect<R, P, E, F>(
    reader: impl std::future::Future<Output = Result<R, E>>,
    producer: Option<impl std::future::Future<Output = Result<P, F>>>,
) -> Result<Opened, CliError>
where
    R: DeadLetters + 'static,
    P: Publish + 'static,
    E: Into<inbox_core::OperationError>,
    F: Into<inbox_core::OperationError>,
{
    let reader: Box<dyn DynDeadLetters> = Box::new(reader.await.map_err(broker_error)?);
    let producer = match producer {
        Some(producer) => {
            Some(Box::new(producer.await.map_err(broker_error)?) as Box<dyn inbox_core::DynPublish>)
        }
        None => None,
    };
    Ok((reader, producer))
}

/// An address the operator must give: `value`, or an error naming its flag and variable.
#[allow(dead_code)] // unused when no broker feature is on
fn required(value: &Option<String>, what: &str, flag: &str, var: &str) -> Result<String, CliError> {
    value.clone().ok_or_else(|| {
        CliError::Refused(format!(
            "no {what} to connect to: pass --{flag} or set {var}"
        ))
    })
}

#[cfg(feature = "sqs")]
async fn sqs_connection(from: &DeadLetterSource) -> inbox_sqs::SqsConnection {
    match &from.sqs_endpoint {
        Some(endpoint) => inbox_sqs::SqsConnection::new(inbox_sqs::connect_to(endpoint).await),
        None => inbox_sqs::SqsConnection::from_env(),
    }
}

/// An adapter's error, as the operation error the core reports.
#[allow(dead_code)] // unused when no broker feature is on
fn broker_error(e: impl Into<inbox_core::OperationError>) -> CliError {
    CliError::Broker(e.into())
}
