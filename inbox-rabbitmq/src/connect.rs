//! Opening a connection on the caller's tokio runtime.

use lapin::tcp::OwnedTLSConfig;
use lapin::types::LongString;
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use crate::{Error, Result};

/// Connects to `url`, naming the connection `name` (the `connection_name` client property, which
/// `rabbitmqctl list_connections client_properties` and the management UI show) and asking for
/// `heartbeat` seconds when set (else the URL's `heartbeat` query parameter, else the broker's).
///
/// Not bounded in time: lapin starts its heartbeat only once the handshake is done, so callers
/// that must not hang wrap it in a timeout.
/// For `amqps://`, the server's certificate chains up to `ca` (PEM) when given, else to the
/// system's roots.
pub(crate) async fn open(
    url: &str,
    ca: Option<&str>,
    name: &str,
    heartbeat: Option<u16>,
) -> Result<Connection> {
    // With its `tokio` feature lapin runs its I/O loop on the runtime it is called from; without
    // one it would panic deep inside, so say what is wrong instead.
    if url.trim().is_empty() {
        return Err(Error::Config(
            "no RabbitMQ broker: set AMQP_URL or name one with RabbitConnection::new(url)".into(),
        ));
    }
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(Error::Config(
            "the RabbitMQ adapter must run inside a tokio runtime".into(),
        ));
    }
    // lapin 4's automatic recovery stays off (its default): it would reopen channels and consume
    // again behind the source's back, which reconnects itself into a new generation instead, so
    // that no ack goes to a channel its delivery did not come on.
    let properties =
        ConnectionProperties::default().with_connection_name(LongString::from(name.to_owned()));
    let mut uri: AMQPUri = url.parse().map_err(|e| {
        Error::Config(format!(
            "the AMQP URL {} does not parse: {e}; write it as amqp://user:password@host:port/vhost",
            redact(url)
        ))
    })?;
    if let Some(secs) = heartbeat {
        uri.query.heartbeat = Some(secs);
    }
    let tls = OwnedTLSConfig {
        identity: None,
        cert_chain: ca.map(str::to_owned),
    };
    let runtime = lapin::runtime::default_runtime()
        .map_err(|e| Error::amqp("finding the tokio runtime", e))?;
    Connection::connect_uri_with_config(uri, properties, tls, runtime)
        .await
        .map_err(|e| Error::amqp(format!("connecting to {}", redact(url)), e))
}

/// The URL without its password, for error messages and logs.
pub(crate) fn redact(url: &str) -> String {
    inbox_core::redact_url(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_messages() {
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqp://127.0.0.1"), "amqp://127.0.0.1");
        // An unencoded `@` in the password does not let its tail through.
        assert_eq!(
            redact("amqp://guest:se@cret@127.0.0.1/%2f"),
            "amqp://guest:***@127.0.0.1/%2f"
        );
    }

    #[test]
    fn config_debug_output_hides_the_password() {
        let config =
            crate::RabbitConnection::new("amqp://app:hunter2@broker:5672/%2f").source("payments");
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("amqp://app:***@broker:5672/%2f"), "{shown}");
        assert!(shown.contains("payments"), "{shown}");
        // The password is still what connects.
        assert_eq!(config.broker_url(), "amqp://app:hunter2@broker:5672/%2f");
    }
}
