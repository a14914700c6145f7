//! The `dead-letters` commands' arguments: which broker, which dead-letter destination, how to
//! reach it (TLS, SASL, a private CA, a Redis Cluster), and which dead letters a replay takes.

use std::ffi::OsStr;
use std::fmt;
use std::path::PathBuf;
use std::time::SystemTime;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use clap::{Args, Subcommand, ValueEnum};

/// `dead-letters list | show | replay`.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadLettersCommand {
    /// Count the dead letters: in all, and per reason, with the oldest and newest time.
    List(DeadLettersList),
    /// Print one dead letter: its ID, reason, origin, time, key, headers and payload.
    Show(DeadLettersShow),
    /// Publish the selected dead letters back to their source, then remove them.
    Replay(DeadLettersReplay),
}

#[derive(Debug, Args)]
pub(crate) struct DeadLettersList {
    /// Also one line per dead letter: position, message ID, time, reason (with --json: one
    /// JSON object per dead letter after the summary).
    #[arg(long)]
    pub(crate) each: bool,
    /// Print one JSON object (destination, count, oldest, newest, by_reason) instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) from: DeadLetterSource,
}

#[derive(Debug, Args)]
pub(crate) struct DeadLettersShow {
    /// The dead letter's position as `list`/`replay --dry-run` print it (a stream entry ID,
    /// `partition 0 offset 7`, an SQS message ID, a RabbitMQ queue place), or its message ID.
    #[arg(value_name = "POSITION")]
    pub(crate) position: String,
    /// Print one JSON object instead of the lines.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) from: DeadLetterSource,
}

#[derive(Debug, Args)]
#[command(group(
    clap::ArgGroup::new("selection")
        .required(true)
        .multiple(true)
        .args(["all", "reason", "since", "until"])
))]
pub(crate) struct DeadLettersReplay {
    /// Replay every dead letter.
    #[arg(long, conflicts_with_all = ["reason", "since", "until"])]
    pub(crate) all: bool,
    /// Only those parked with exactly this reason (as `list` prints it).
    #[arg(long, value_name = "REASON")]
    pub(crate) reason: Option<String>,
    /// Only those parked at or after this time: RFC 3339 (2026-12-05T03:00:00Z) or a duration
    /// ago (2h).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub(crate) since: Option<SystemTime>,
    /// Only those parked before this time (same forms as --since).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub(crate) until: Option<SystemTime>,
    /// Read and count what would move; publish and remove nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Print one JSON object (read, selected, moved, unreplayable, duplicates, by_source,
    /// dry_run) instead of the lines; no progress is drawn.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) from: DeadLetterSource,
}

/// Which broker, which dead-letter destination, and how to reach it.
#[derive(Debug, Args)]
#[command(next_help_heading = "Dead-letter destination")]
pub(crate) struct DeadLetterSource {
    /// The broker holding the dead letters.
    #[arg(long, value_enum)]
    pub(crate) broker: Broker,
    /// The dead-letter destination: a Kafka topic, an SQS queue URL, a RabbitMQ queue, a Redis
    /// stream key.
    #[arg(long, value_name = "DLQ")]
    pub(crate) from: String,
    /// Kafka brokers (host:port,...).
    #[arg(
        long,
        value_name = "HOSTS",
        env = "KAFKA_BROKERS",
        help_heading = "Kafka (--broker kafka)"
    )]
    pub(crate) kafka_brokers: Option<String>,
    /// A librdkafka property for every Kafka client, as KEY=VALUE; repeat it for each, as with
    /// kcat: TLS (-X security.protocol=ssl -X ssl.ca.location=ca.pem), SASL
    /// (-X security.protocol=sasl_ssl -X sasl.mechanism=SCRAM-SHA-512 -X sasl.username=NAME
    /// -X sasl.password=SECRET), socket settings. Errors never show a secret's value.
    #[arg(
        short = 'X',
        long = "kafka-property",
        value_name = "KEY=VALUE",
        value_parser = KafkaPropertyParser,
        help_heading = "Kafka (--broker kafka)"
    )]
    pub(crate) kafka_properties: Vec<KafkaProperty>,
    /// A file of librdkafka properties, one KEY=VALUE per line (blank lines and lines starting
    /// with `#` skipped), as kcat's -F: the place for secrets, which -X shows to anyone who
    /// lists the machine's processes. -X properties are set after the file's, so they win.
    #[arg(
        short = 'F',
        long = "kafka-config",
        value_name = "FILE",
        help_heading = "Kafka (--broker kafka)"
    )]
    pub(crate) kafka_config: Option<PathBuf>,
    /// The consumer group whose commits mark Kafka dead letters as replayed.
    #[arg(
        long,
        value_name = "GROUP",
        default_value = "inbox-admin-replay",
        help_heading = "Kafka (--broker kafka)"
    )]
    pub(crate) kafka_group: String,
    /// The SQS endpoint, for an SQS-compatible server; AWS's otherwise (credentials and region
    /// from the usual AWS environment).
    #[arg(
        long,
        value_name = "URL",
        env = "AWS_ENDPOINT_URL_SQS",
        help_heading = "SQS (--broker sqs)"
    )]
    pub(crate) sqs_endpoint: Option<String>,
    /// The RabbitMQ URL (amqp://user:password@host:port/vhost; amqps:// for TLS).
    #[arg(
        long,
        value_name = "URL",
        env = "AMQP_URL",
        hide_env_values = true,
        help_heading = "RabbitMQ (--broker rabbitmq)"
    )]
    pub(crate) amqp_url: Option<String>,
    /// For an amqps:// URL: trust the certificate authorities in this PEM file instead of the
    /// system's (a private CA, a managed broker's own), for reading and for replaying.
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "RabbitMQ (--broker rabbitmq)"
    )]
    pub(crate) amqp_ca: Option<PathBuf>,
    /// The Redis URL (redis://host:port/db; rediss:// for TLS).
    #[arg(
        long,
        value_name = "URL",
        env = "REDIS_URL",
        hide_env_values = true,
        help_heading = "Redis (--broker redis)"
    )]
    pub(crate) redis_url: Option<String>,
    /// For a rediss:// URL or rediss:// cluster nodes: trust the certificate authorities in this
    /// PEM file instead of the system's (a private CA), for reading and for replaying.
    #[arg(long, value_name = "FILE", help_heading = "Redis (--broker redis)")]
    pub(crate) redis_ca: Option<PathBuf>,
    /// A Redis Cluster instead of --redis-url: the URLs of some of its nodes, comma-separated or
    /// repeated (redis://host:port, rediss:// for TLS); the others are learnt from them, and
    /// each command goes to the node holding its stream.
    #[arg(
        long,
        value_name = "URLS",
        value_delimiter = ',',
        help_heading = "Redis (--broker redis)"
    )]
    pub(crate) redis_cluster: Vec<String>,
    /// The NATS server(s) (nats://host:4222, comma-separated; tls:// for TLS; a user and
    /// password or a token in the URL).
    #[arg(
        long,
        value_name = "URL",
        env = "NATS_URL",
        hide_env_values = true,
        help_heading = "NATS JetStream (--broker nats)"
    )]
    pub(crate) nats_url: Option<String>,
    /// Trust the certificate authorities in this PEM file beside the system's (a private CA);
    /// implies TLS.
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "NATS JetStream (--broker nats)"
    )]
    pub(crate) nats_ca: Option<PathBuf>,
    /// Log in with this creds file (a user JWT and its NKey seed).
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "NATS JetStream (--broker nats)"
    )]
    pub(crate) nats_creds: Option<PathBuf>,
    /// The header, attribute or field holding the message ID [default: event_id; RabbitMQ: the
    /// message_id property].
    #[arg(long, value_name = "NAME")]
    pub(crate) id_field: Option<String>,
}

/// `--broker`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Broker {
    /// A Kafka dead-letter topic.
    Kafka,
    /// An SQS dead-letter queue (its URL).
    Sqs,
    /// A RabbitMQ dead-letter queue.
    Rabbitmq,
    /// A Redis dead-letter stream.
    Redis,
    /// A NATS JetStream dead-letter subject.
    Nats,
}

impl Broker {
    /// The name `--broker` takes.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Broker::Kafka => "kafka",
            Broker::Sqs => "sqs",
            Broker::Rabbitmq => "rabbitmq",
            Broker::Redis => "redis",
            Broker::Nats => "nats",
        }
    }
}

/// A time as RFC 3339 (`2026-12-05T03:00:00Z`, also without the zone, read as UTC) or a
/// duration before now (`2h`, `1d`).
pub(crate) fn parse_time(value: &str) -> Result<SystemTime, NotATime> {
    if let Ok(time) = humantime::parse_rfc3339_weak(value) {
        return Ok(time);
    }
    match humantime::parse_duration(value) {
        Ok(ago) => SystemTime::now().checked_sub(ago).ok_or_else(|| NotATime {
            value: value.to_owned(),
        }),
        Err(_) => Err(NotATime {
            value: value.to_owned(),
        }),
    }
}

/// A command-line value that is neither a time nor a duration.
#[derive(Debug, thiserror::Error)]
#[error(
    "`{value}` is not a time; write RFC 3339 (2026-12-05T03:00:00Z) or a duration ago (2h, 1d)"
)]
pub(crate) struct NotATime {
    value: String,
}

/// One `-X key=value`: a librdkafka property. Its `Debug` output hides a secret's value.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct KafkaProperty {
    pub(crate) key: String,
    pub(crate) value: String,
}

impl KafkaProperty {
    /// `key=value`, split at the first `=` (a value may hold more). An error never shows the
    /// text: a mistyped `-X sasl.password:...` holds the password.
    fn parse(text: &str) -> Result<Self, String> {
        Self::split(text).map_err(|problem| match problem {
            Unsplit::NoEquals => "a -X property has no `=`: write -X key=value, like -X \
                                  security.protocol=ssl (the text given is not shown: it may \
                                  hold a secret)"
                .to_owned(),
            Unsplit::NoKey => "a -X property has no name before its `=`, or a space in it: \
                               write -X key=value, like -X sasl.mechanism=SCRAM-SHA-512"
                .to_owned(),
        })
    }

    /// The properties of a `--kafka-config` file: `key=value` lines, around the `=` and the
    /// line trimmed, blank lines and `#` comments skipped. An error names the line by its
    /// number, never by its text.
    pub(crate) fn parse_file(text: &str) -> Result<Vec<Self>, String> {
        let mut properties = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let property = Self::split(line).map_err(|problem| {
                let why = match problem {
                    Unsplit::NoEquals => "has no `=`",
                    Unsplit::NoKey => "has no name before its `=`, or a space in it",
                };
                format!(
                    "line {} {why}: write key=value, one property per line (the line is not \
                     shown: it may hold a secret)",
                    n + 1
                )
            })?;
            properties.push(Self {
                value: property.value.trim_start().to_owned(),
                ..property
            });
        }
        Ok(properties)
    }

    fn split(text: &str) -> Result<Self, Unsplit> {
        let (key, value) = text.split_once('=').ok_or(Unsplit::NoEquals)?;
        let key = key.trim_end();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(Unsplit::NoKey);
        }
        Ok(Self {
            key: key.to_owned(),
            value: value.to_owned(),
        })
    }
}

/// Why a text is not `key=value`.
enum Unsplit {
    NoEquals,
    NoKey,
}

impl fmt::Debug for KafkaProperty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = if inbox_core::is_secret_setting(&self.key) {
            inbox_core::REDACTED
        } else {
            &self.value
        };
        write!(f, "{}={value}", self.key)
    }
}

/// Parses `-X`. Not a plain function parser: clap would print the rejected text in its error,
/// and that text may be a password.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KafkaPropertyParser;

impl TypedValueParser for KafkaPropertyParser {
    type Value = KafkaProperty;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<KafkaProperty, clap::Error> {
        let refuse = |why: String| {
            let mut cmd = cmd.clone();
            cmd.error(ErrorKind::ValueValidation, why)
        };
        let text = value
            .to_str()
            .ok_or_else(|| refuse("a -X property is not UTF-8 text".to_owned()))?;
        KafkaProperty::parse(text).map_err(refuse)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use super::*;
    use crate::args::tests::parse;
    use crate::args::Command;

    /// The `dead-letters` command `args` make.
    fn command(args: &[&str]) -> DeadLettersCommand {
        match parse(args).unwrap().command {
            Command::DeadLetters(command) => *command,
            other => panic!("not dead-letters: {other:?}"),
        }
    }

    #[test]
    fn dead_letter_commands_parse() {
        let DeadLettersCommand::Replay(replay) = command(&[
            "dead-letters",
            "replay",
            "--broker",
            "kafka",
            "--from",
            "orders.dlq",
            "--reason",
            "downstream down",
            "--since",
            "2026-12-05T03:00:00Z",
            "--dry-run",
        ]) else {
            panic!("not replay")
        };
        assert_eq!(replay.from.broker, Broker::Kafka);
        assert_eq!(replay.from.from, "orders.dlq");
        assert_eq!(replay.from.kafka_group, "inbox-admin-replay");
        assert_eq!(replay.reason.as_deref(), Some("downstream down"));
        assert_eq!(
            replay.since,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_439_600))
        );
        assert!(replay.dry_run && !replay.all && replay.until.is_none());

        let show = command(&[
            "dead-letters",
            "show",
            "--broker",
            "redis",
            "--from",
            "o:dlq",
            "1-0",
        ]);
        assert!(matches!(
            show,
            DeadLettersCommand::Show(DeadLettersShow { ref position, .. }) if position == "1-0"
        ));
        let ago = parse_time("2h").unwrap();
        let expected = SystemTime::now() - Duration::from_secs(7200);
        assert!(expected.duration_since(ago).unwrap_or_default() < Duration::from_secs(5));
    }

    #[test]
    fn kafka_properties_rabbitmq_and_redis_tls_parse() {
        let DeadLettersCommand::List(list) = command(&[
            "dead-letters",
            "list",
            "--broker",
            "kafka",
            "--from",
            "orders.dlq",
            "-X",
            "security.protocol=sasl_ssl",
            "-Xsasl.mechanism=SCRAM-SHA-512",
            "--kafka-property",
            "sasl.password=hunter2=x",
            "-X",
            "socket.keepalive.enable=",
        ]) else {
            panic!("not list")
        };
        let properties: Vec<(&str, &str)> = list
            .from
            .kafka_properties
            .iter()
            .map(|p| (p.key.as_str(), p.value.as_str()))
            .collect();
        assert_eq!(
            properties,
            [
                ("security.protocol", "sasl_ssl"),
                ("sasl.mechanism", "SCRAM-SHA-512"),
                ("sasl.password", "hunter2=x"),
                ("socket.keepalive.enable", ""),
            ]
        );
        let shown = format!("{:?}", list.from);
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("sasl.password=***"), "{shown}");

        let DeadLettersCommand::Replay(replay) = command(&[
            "dead-letters",
            "replay",
            "--all",
            "--broker",
            "redis",
            "--from",
            "{orders}:dlq",
            "--redis-cluster",
            "rediss://a:7000,rediss://b:7000",
            "--redis-cluster=rediss://c:7000",
        ]) else {
            panic!("not replay")
        };
        assert_eq!(
            replay.from.redis_cluster,
            ["rediss://a:7000", "rediss://b:7000", "rediss://c:7000"]
        );
        let DeadLettersCommand::Show(show) = command(&[
            "dead-letters",
            "show",
            "--broker",
            "rabbitmq",
            "--from",
            "orders.dlq",
            "--amqp-ca",
            "/etc/ssl/broker-ca.pem",
            "x",
        ]) else {
            panic!("not show")
        };
        assert_eq!(
            show.from.amqp_ca.as_deref(),
            Some(std::path::Path::new("/etc/ssl/broker-ca.pem"))
        );
    }

    #[test]
    fn a_kafka_config_file_gives_properties_and_names_a_bad_line_by_number() {
        let text = "# MSK, SCRAM\n\n security.protocol = sasl_ssl\nsasl.password=hunter2=x\n";
        let properties: Vec<(String, String)> = KafkaProperty::parse_file(text)
            .unwrap()
            .into_iter()
            .map(|p| (p.key, p.value))
            .collect();
        assert_eq!(
            properties,
            [
                ("security.protocol".to_owned(), "sasl_ssl".to_owned()),
                ("sasl.password".to_owned(), "hunter2=x".to_owned()),
            ]
        );
        for (bad, why) in [
            ("a=b\nsasl.password:hunter2", "line 2 has no `=`"),
            ("\n\nsasl password=hunter2", "line 3 has no name"),
        ] {
            let e = KafkaProperty::parse_file(bad).unwrap_err();
            assert!(e.contains(why) && !e.contains("hunter2"), "{e}");
        }
        let DeadLettersCommand::List(list) = command(&[
            "dead-letters",
            "list",
            "--broker",
            "kafka",
            "--from",
            "o.dlq",
            "-F",
            "/etc/inbox/kafka.properties",
        ]) else {
            panic!("not list")
        };
        assert_eq!(
            list.from.kafka_config.as_deref(),
            Some(std::path::Path::new("/etc/inbox/kafka.properties"))
        );
    }

    #[test]
    fn a_kafka_property_that_is_not_key_value_is_refused_without_showing_it() {
        let list = |property: &str| {
            parse(&[
                "dead-letters",
                "list",
                "--broker",
                "kafka",
                "--from",
                "o.dlq",
                "-X",
                property,
            ])
        };
        for bad in ["sasl.password:hunter2", "=hunter2", "sasl password=hunter2"] {
            let e = list(bad).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad}: {e}");
            let shown = e.to_string();
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("-X key=value"), "{shown}");
        }
    }
}
