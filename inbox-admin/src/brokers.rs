//! How `dead-letters` reaches the chosen broker. Each broker's one connection is built from the
//! command line (its address, TLS and SASL settings, a private CA, a Redis Cluster's nodes), and
//! both the dead-letter reader and, for a replay, the producer are built from it: whatever
//! reaches the broker to read reaches it to publish back.

use std::path::Path;

use inbox_core::replay::{DeadLetters, DynDeadLetters};
use inbox_core::{is_secret_setting, Publish, REDACTED};

use crate::args::{Broker, DeadLetterSource, KafkaProperty};
use crate::CliError;

/// A dead-letter destination's reader and, for a replay, the producer that publishes back to
/// the sources.
pub(crate) type Opened = (
    Box<dyn DynDeadLetters>,
    Option<Box<dyn inbox_core::DynPublish>>,
);

/// The reader of the dead-letter destination `from` names and, when `replay`, the producer:
/// both built from one connection, and reading the message ID from one field.
#[allow(unused_variables)] // with no broker feature on, no arm uses `replay` and `field`
pub(crate) async fn open(from: &DeadLetterSource, replay: bool) -> Result<Opened, CliError> {
    let field = id_field(from);
    match from.broker {
        #[cfg(feature = "kafka")]
        Broker::Kafka => {
            let kafka = kafka(from)?;
            let mut reader = kafka.dead_letters(&from.from).group(&from.kafka_group);
            let mut producer = kafka.producer();
            if let Some(field) = field {
                reader = reader.id_header(field);
                producer = producer.id_header(field);
            }
            connect(reader.connect(), replay.then(|| producer.connect()))
                .await
                .map_err(kafka_hint)
        }
        #[cfg(feature = "sqs")]
        Broker::Sqs => {
            let sqs = sqs(from).await;
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
            let broker = rabbitmq(from)?;
            let mut reader = broker.dead_letters(&from.from);
            if let Some(field) = field {
                reader = reader.id_header(field);
            }
            let producer = broker.producer();
            connect(reader.connect(), replay.then(|| producer.connect())).await
        }
        #[cfg(feature = "redis")]
        Broker::Redis => {
            let redis = redis(from)?;
            let mut reader = redis.dead_letters(&from.from);
            let mut producer = redis.producer();
            if let Some(field) = field {
                reader = reader.id_field(field);
                producer = producer.id_field(field);
            }
            connect(reader.connect(), replay.then(|| producer.connect())).await
        }
        #[cfg(feature = "nats")]
        Broker::Nats => {
            let nats = nats(from)?;
            let mut reader = nats.dead_letters(&from.from);
            let mut producer = nats.producer();
            if let Some(field) = field {
                reader = reader.id_header(field);
                producer = producer.id_header(field);
            }
            connect(reader.connect(), replay.then(|| producer.connect())).await
        }
        #[allow(unreachable_patterns)]
        other => Err(not_built(other)),
    }
}

/// The Kafka cluster at `--kafka-brokers`, every `-X` property set on the connection.
#[cfg(feature = "kafka")]
fn kafka(from: &DeadLetterSource) -> Result<inbox_kafka::KafkaConnection, CliError> {
    let brokers = required(
        &from.kafka_brokers,
        "Kafka brokers",
        "kafka-brokers",
        "KAFKA_BROKERS",
    )?;
    let mut kafka = inbox_kafka::KafkaConnection::new(brokers);
    let from_file = file_properties(from)?;
    let in_file = from_file
        .iter()
        .map(|p| (p, format!("{} in --kafka-config", p.key)));
    let flags = from
        .kafka_properties
        .iter()
        .map(|p| (p, format!("-X {}", p.key)));
    for (property, flag) in in_file.chain(flags) {
        // A file librdkafka reads (`ssl.ca.location`, `ssl.key.location`, ...): one that cannot
        // be read is refused here, naming its property. `probe` is librdkafka's word for "look
        // in the usual places".
        if property.key.ends_with(".location") && property.value != "probe" {
            std::fs::File::open(&property.value)
                .map_err(|e| unreadable(&property.value, &flag, e))?;
        }
        kafka = kafka.set(&property.key, &property.value);
    }
    Ok(kafka)
}

/// The properties of the `--kafka-config` file, if one was given.
fn file_properties(from: &DeadLetterSource) -> Result<Vec<KafkaProperty>, CliError> {
    let Some(path) = &from.kafka_config else {
        return Ok(Vec::new());
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| unreadable(path.display(), "--kafka-config", e))?;
    KafkaProperty::parse_file(&text).map_err(|why| {
        CliError::Refused(format!(
            "`{}`, given with --kafka-config: {why}",
            path.display()
        ))
    })
}

/// Every librdkafka property given, the `--kafka-config` file's and `-X`'s: those whose values
/// an error must not show. None of the file's when it cannot be read (no error then holds them).
pub(crate) fn kafka_properties(from: &DeadLetterSource) -> Vec<KafkaProperty> {
    let mut properties = file_properties(from).unwrap_or_default();
    properties.extend(from.kafka_properties.iter().cloned());
    properties
}

/// What a Kafka connection that failed without a reason usually means.
#[cfg(feature = "kafka")]
const KAFKA_HINT: &str =
    "librdkafka reports only this code (the reason goes to its log): most often \
    a TLS handshake that failed (the CA that signed the brokers' certificates must be in \
    -X ssl.ca.location, and the certificates must name the hosts of --kafka-brokers), a TLS \
    listener reached without -X security.protocol=ssl (or sasl_ssl), a SASL login the brokers \
    refused, or no broker listening at --kafka-brokers";

/// `e`, with [`KAFKA_HINT`] where librdkafka's error is only a code: all it says of a refused
/// TLS handshake while it retries (`Local: Broker transport failure`).
#[cfg(feature = "kafka")]
fn kafka_hint(e: CliError) -> CliError {
    use inbox_kafka::rdkafka::error::{KafkaError, RDKafkaErrorCode};

    let CliError::Broker(source) = e else {
        return e;
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&source);
    let mut silent = false;
    while let Some(error) = cause {
        if let Some(kafka) = error.downcast_ref::<KafkaError>() {
            silent = matches!(
                kafka.rdkafka_error_code(),
                Some(RDKafkaErrorCode::BrokerTransportFailure | RDKafkaErrorCode::AllBrokersDown)
            );
        }
        cause = error.source();
    }
    if silent {
        CliError::BrokerHint {
            source,
            hint: KAFKA_HINT,
        }
    } else {
        CliError::Broker(source)
    }
}

/// The SQS endpoint `--sqs-endpoint` names, or AWS's.
#[cfg(feature = "sqs")]
async fn sqs(from: &DeadLetterSource) -> inbox_sqs::SqsConnection {
    match &from.sqs_endpoint {
        Some(endpoint) => inbox_sqs::SqsConnection::new(inbox_sqs::connect_to(endpoint).await),
        None => inbox_sqs::SqsConnection::from_env(),
    }
}

/// The RabbitMQ broker at `--amqp-url`, trusting `--amqp-ca` when given.
#[cfg(feature = "rabbitmq")]
fn rabbitmq(from: &DeadLetterSource) -> Result<inbox_rabbitmq::RabbitConnection, CliError> {
    let url = required(&from.amqp_url, "RabbitMQ broker", "amqp-url", "AMQP_URL")?;
    let mut broker = inbox_rabbitmq::RabbitConnection::new(&url);
    if let Some(ca) = &from.amqp_ca {
        tls_url(&url, "amqps", "--amqp-ca", "--amqp-url")?;
        broker = broker.ca_certificates(read_ca(ca, "--amqp-ca")?);
    }
    Ok(broker)
}

/// The Redis Cluster of `--redis-cluster`, or the server at `--redis-url`, trusting
/// `--redis-ca` when given.
#[cfg(feature = "redis")]
fn redis(from: &DeadLetterSource) -> Result<inbox_redis_streams::RedisConnection, CliError> {
    use inbox_redis_streams::RedisConnection;

    let (redis, urls, flag) = if from.redis_cluster.is_empty() {
        let url = required(&from.redis_url, "Redis server", "redis-url", "REDIS_URL")?;
        (RedisConnection::new(&url), vec![url], "--redis-url")
    } else {
        for node in &from.redis_cluster {
            let scheme = node.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
            if !matches!(scheme.as_deref(), Some("redis" | "rediss")) {
                return Err(CliError::Refused(format!(
                    "--redis-cluster node `{}` is not a Redis URL: write redis://host:port \
                     (rediss://host:port for TLS), comma-separated",
                    inbox_core::redact_url(node)
                )));
            }
        }
        let nodes = from.redis_cluster.clone();
        (
            RedisConnection::cluster(nodes.clone()),
            nodes,
            "--redis-cluster",
        )
    };
    let Some(ca) = &from.redis_ca else {
        return Ok(redis);
    };
    for url in &urls {
        tls_url(url, "rediss", "--redis-ca", flag)?;
    }
    Ok(redis.ca_certificates(read_ca(ca, "--redis-ca")?))
}

/// The NATS servers at `--nats-url`, trusting `--nats-ca` and logging in with `--nats-creds`
/// when given.
#[cfg(feature = "nats")]
fn nats(from: &DeadLetterSource) -> Result<inbox_nats::NatsConnection, CliError> {
    let url = required(&from.nats_url, "NATS server", "nats-url", "NATS_URL")?;
    let mut nats = inbox_nats::NatsConnection::new(url);
    if let Some(ca) = &from.nats_ca {
        read_ca(ca, "--nats-ca")?;
        nats = nats.root_certificates(ca);
    }
    if let Some(creds) = &from.nats_creds {
        std::fs::File::open(creds).map_err(|e| unreadable(creds.display(), "--nats-creds", e))?;
        nats = nats.credentials_file(creds);
    }
    Ok(nats)
}

/// The certificates of the PEM file `path` (given with `flag`).
#[allow(dead_code)] // unused without the rabbitmq, redis and nats features
fn read_ca(path: &Path, flag: &str) -> Result<String, CliError> {
    let bytes = std::fs::read(path).map_err(|e| unreadable(path.display(), flag, e))?;
    match String::from_utf8(bytes) {
        Ok(pem) if pem.contains("-----BEGIN CERTIFICATE-----") => Ok(pem),
        _ => Err(CliError::Refused(format!(
            "the CA file `{}` given with {flag} holds no PEM certificate (no `-----BEGIN \
             CERTIFICATE-----` line); convert a DER file with `openssl x509 -inform der -in \
             FILE -out FILE.pem`",
            path.display()
        ))),
    }
}

/// A file given with `flag` that cannot be read.
#[allow(dead_code)] // unused with no broker feature on
fn unreadable(path: impl std::fmt::Display, flag: &str, e: std::io::Error) -> CliError {
    CliError::Refused(format!(
        "cannot read `{path}`, given with {flag}: {e}; give a file this user can read"
    ))
}

/// Refuses a CA (`ca_flag`) for a URL (`url_flag`) that does not start with `scheme://`: the
/// CA would go unused, over a connection without TLS.
#[allow(dead_code)] // unused without the rabbitmq and redis features
fn tls_url(url: &str, scheme: &str, ca_flag: &str, url_flag: &str) -> Result<(), CliError> {
    let given = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if given.as_deref() == Some(scheme) {
        return Ok(());
    }
    Err(CliError::Refused(format!(
        "{ca_flag} is for TLS, but {url_flag} `{}` does not start with {scheme}://: write \
         {scheme}://… to reach the broker over TLS",
        inbox_core::redact_url(url)
    )))
}

/// `e`, with the value of every `-X` property it could show hidden: a secret one's
/// (`sasl.password`, ...), and any whose name the error gives as a configuration property
/// (librdkafka repeats the value of a property it does not know, such as a misspelt
/// `sasl.pasword`).
pub(crate) fn hide_property_values(e: CliError, properties: &[KafkaProperty]) -> CliError {
    let shown = e.to_string();
    let named = |key: &str| {
        shown.contains("configuration property") && shown.contains(&format!("\"{key}\""))
    };
    let mut hidden = shown.clone();
    for property in properties {
        if !property.value.is_empty() && (is_secret_setting(&property.key) || named(&property.key))
        {
            hidden = hidden.replace(&property.value, REDACTED);
        }
    }
    if hidden == shown {
        e
    } else {
        CliError::Hidden(hidden)
    }
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

/// An adapter's error, as the operation error the core reports.
#[allow(dead_code)] // unused when no broker feature is on
fn broker_error(e: impl Into<inbox_core::OperationError>) -> CliError {
    CliError::Broker(e.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn property(key: &str, value: &str) -> KafkaProperty {
        KafkaProperty {
            key: key.to_owned(),
            value: value.to_owned(),
        }
    }

    #[test]
    fn secret_values_and_those_of_a_named_property_are_hidden_others_shown() {
        let properties = [
            property("sasl.password", "hunter2"),
            property("sasl.pasword", "hunter3"),
            property("security.protocol", "ssl"),
        ];
        let hidden = |message: &str| {
            hide_property_values(CliError::Refused(message.to_owned()), &properties).to_string()
        };
        assert_eq!(
            hidden(
                "Client config error: No such configuration property: \"sasl.pasword\" \
                 sasl.pasword hunter3"
            ),
            "Client config error: No such configuration property: \"sasl.pasword\" \
             sasl.pasword ***"
        );
        assert_eq!(
            hidden("login as x/hunter2 refused"),
            "login as x/*** refused"
        );
        // A value is left alone where the error names no property of it: `ssl` stays in
        // `ssl.ca.location`.
        let tls = "the TLS handshake failed; check that ssl.ca.location holds the CA";
        assert_eq!(hidden(tls), tls);
        assert!(matches!(
            hide_property_values(CliError::Refused(tls.to_owned()), &properties),
            CliError::Refused(_)
        ));
    }

    #[test]
    fn a_ca_for_a_plaintext_url_or_a_file_without_pem_is_refused_naming_the_flag() {
        let e = tls_url("amqp://u:pw@h/%2f", "amqps", "--amqp-ca", "--amqp-url").unwrap_err();
        let e = e.to_string();
        assert!(e.starts_with("--amqp-ca is for TLS"), "{e}");
        assert!(e.contains("amqps://"), "{e}");
        assert!(!e.contains("pw"), "{e}");
        assert!(tls_url("AMQPS://h", "amqps", "--amqp-ca", "--amqp-url").is_ok());

        let dir = std::env::temp_dir().join(format!("inbox-admin-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let der = dir.join("ca.der");
        std::fs::write(&der, [0x30, 0x82, 0x01, 0xff]).unwrap_or_else(|e| panic!("{e}"));
        let e = read_ca(&der, "--redis-ca").unwrap_err().to_string();
        assert!(
            e.contains("given with --redis-ca holds no PEM certificate"),
            "{e}"
        );
        let e = read_ca(&dir.join("missing.pem"), "--redis-ca")
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.pem`, given with --redis-ca:"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
