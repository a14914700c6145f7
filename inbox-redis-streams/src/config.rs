//! How a [`RedisStreamSource`] is set up.

use std::time::Duration;

use redis::Client;

use crate::connection::Conn;
use crate::{Error, RedisStreamSource, Result};

/// Everything a source and its acks need to know, shared between them.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) stream: String,
    pub(crate) group: String,
    pub(crate) consumer: String,
    pub(crate) id_field: String,
    pub(crate) dead_letter_stream: String,
    pub(crate) poll_timeout: Duration,
    pub(crate) claim_idle: Duration,
    pub(crate) claim_interval: Duration,
}

/// Builds a [`RedisStreamSource`]; start with [`RedisStreamSource::builder`], finish with
/// [`RedisStreamSourceBuilder::connect`].
///
/// Redis is reached at the `REDIS_URL` environment variable (no default: unset, connect fails)
/// unless [`RedisStreamSourceBuilder::url`] or [`RedisStreamSourceBuilder::client`] says
/// otherwise. Its `Debug` output hides a password in the URL.
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisStreamSourceBuilder {
    server: Server,
    stream: String,
    group: String,
    consumer: Option<String>,
    id_field: String,
    dead_letter_stream: Option<String>,
    poll_timeout: Duration,
    claim_idle: Duration,
    claim_interval: Duration,
    operation_timeout: Duration,
}

impl std::fmt::Debug for RedisStreamSourceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamSourceBuilder")
            .field("server", &self.server)
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("id_field", &self.id_field)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("poll_timeout", &self.poll_timeout)
            .field("claim_idle", &self.claim_idle)
            .field("claim_interval", &self.claim_interval)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

/// Where Redis is: the environment, a URL, or a client made by the caller.
#[derive(Clone)]
pub(crate) enum Server {
    Env,
    Url(String),
    /// Boxed: a client with TLS certificates is several times the other variants' size.
    Client(Box<Client>),
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Server::Env => f.write_str("REDIS_URL"),
            Server::Url(url) => write!(f, "{:?}", inbox_core::redact_url(url)),
            Server::Client(_) => f.write_str("a given client"),
        }
    }
}

impl Server {
    /// The client, and how to name the server in errors (the URL without its password).
    pub(crate) fn client(self) -> Result<(Client, String)> {
        let url = match self {
            Server::Client(client) => {
                let shown = client.get_connection_info().addr().to_string();
                return Ok((*client, shown));
            }
            Server::Url(url) => url,
            Server::Env => crate::url_from_env()?,
        };
        let shown = inbox_core::redact_url(&url).to_string();
        let client = Client::open(url.as_str())
            .map_err(|e| Error::Config(format!("Redis URL {shown:?} does not parse: {e}")))?;
        Ok((client, shown))
    }
}

impl RedisStreamSourceBuilder {
    pub(crate) fn new(stream: String, group: String) -> Self {
        Self {
            server: Server::Env,
            stream,
            group,
            consumer: None,
            id_field: crate::DEFAULT_ID_FIELD.to_owned(),
            dead_letter_stream: None,
            poll_timeout: Duration::from_secs(2),
            claim_idle: Duration::from_secs(60),
            claim_interval: Duration::from_secs(5),
            operation_timeout: Duration::from_secs(10),
        }
    }

    /// The consumer's name inside the group (default `<hostname>-<pid>`).
    ///
    /// Redis keeps a pending list per consumer name. Give each live process its own name, and
    /// keep it across restarts where the platform allows (a StatefulSet pod name such as
    /// `wallet-0`, a systemd instance name): a restarted process then finds its own pending
    /// entries at once instead of waiting `claim_idle` for `XAUTOCLAIM`. Never let two live
    /// processes share a name: each would reread the other's in-flight entries at startup (the
    /// inbox still applies them once, but the work is done twice). Names of processes that are
    /// gone for good stay listed in `XINFO CONSUMERS`; delete them with `XGROUP DELCONSUMER`
    /// once they have no pending entries.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.consumer = Some(name.into());
        self
    }

    /// The entry field holding the producer-set message ID (default `event_id`). The stream
    /// entry ID is never used: a republished event gets a new one.
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// Where entries that cannot be applied go (default `<stream>:dlq`). A dead letter's copy and
    /// its `XACK` run in one script, whose two streams must share a hash slot on a Redis Cluster
    /// (a hash tag: `{orders}` and `{orders}:dlq`).
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter_stream = Some(stream.into());
        self
    }

    /// Connects to `url` (`redis://host:port/db`, `rediss://…`) instead of `REDIS_URL`.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.server = Server::Url(url.into());
        self
    }

    /// Connects with a client you configured instead of `REDIS_URL`.
    pub fn client(mut self, client: Client) -> Self {
        self.server = Server::Client(Box::new(client));
        self
    }

    /// How long one receive waits for new entries (`XREADGROUP … BLOCK`, default 2 s).
    pub fn poll_timeout(mut self, wait: Duration) -> Self {
        self.poll_timeout = wait;
        self
    }

    /// How long an entry must sit unacked in another consumer's pending list before this one
    /// takes it over with `XAUTOCLAIM` (default 60 s).
    ///
    /// Make it longer than the slowest handler plus commit: an entry whose handler is merely
    /// slow is claimed too, and then two consumers work on it (the inbox keeps the effect
    /// single, but the work is done twice). Shorter means faster recovery after a crash.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle;
        self
    }

    /// How often to look for idle entries of dead consumers with `XAUTOCLAIM` (default 5 s).
    pub fn claim_interval(mut self, every: Duration) -> Self {
        self.claim_interval = every;
        self
    }

    /// How long connecting, or one command, may wait for Redis (default 10 s); the blocking
    /// read waits its [`poll_timeout`](Self::poll_timeout) on top.
    ///
    /// Past it the command fails with a [`Recovery::Reconnect`](inbox_core::Recovery) error and
    /// its connection is dropped: the next command connects anew (within the same bound). A
    /// connection whose peer went silent (a network that drops packets, a hung server, a
    /// firewall that forgot the connection) would otherwise never answer again. After any
    /// lost connection the source rereads its own pending entries first, so what a lost reply
    /// had delivered, or a failed ack left pending, comes back at once rather than after
    /// `claim_idle` (entries it had nacked come back early with them).
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// Connects, creates the consumer group if it is missing and returns the source. A server
    /// that cannot be reached fails this, with an error naming it.
    pub async fn connect(self) -> Result<RedisStreamSource> {
        let timeout = self.operation_timeout;
        let server = self.server.clone();
        let settings = self.settings()?;
        let (client, shown) = server.client()?;
        let connect = |what: &str| format!("connecting to Redis at {shown} for {what}");
        // Two connections: a blocking XREADGROUP holds its connection until it returns, and acks
        // should not queue behind it.
        let reader = Conn::connect(client.clone(), "reads", timeout)
            .await
            .map_err(|e| Error::redis(connect("reads"), e))?;
        let commands = Conn::connect(client, "commands", timeout)
            .await
            .map_err(|e| Error::redis(connect("acks"), e))?;
        RedisStreamSource::start(settings, reader, commands).await
    }

    fn settings(self) -> Result<Settings> {
        let nonempty = |what: &str, value: &str| {
            if value.is_empty() {
                Err(Error::Config(format!("the {what} is empty")))
            } else {
                Ok(())
            }
        };
        nonempty("stream key", &self.stream)?;
        nonempty("group name", &self.group)?;
        nonempty("ID field", &self.id_field)?;
        if self.id_field == crate::PAYLOAD_FIELD {
            return Err(Error::Config(format!(
                "the ID field cannot be `{}`, which holds the payload",
                crate::PAYLOAD_FIELD
            )));
        }
        let consumer = match self.consumer {
            Some(name) => name,
            None => default_consumer_name(),
        };
        nonempty("consumer name", &consumer)?;
        let dead_letter_stream = self
            .dead_letter_stream
            .unwrap_or_else(|| format!("{}:dlq", self.stream));
        if dead_letter_stream == self.stream {
            return Err(Error::Config(format!(
                "the dead-letter stream is the stream `{}` itself; pick another key",
                self.stream
            )));
        }
        // BLOCK 0 means "wait for ever" to Redis, which would hang shutdown-free loops.
        if self.poll_timeout < Duration::from_millis(1) {
            return Err(Error::Config(
                "poll_timeout is under 1 ms; use at least 1 ms".into(),
            ));
        }
        if self.operation_timeout < Duration::from_millis(1) {
            return Err(Error::Config(
                "operation_timeout is under 1 ms; use at least 1 ms".into(),
            ));
        }
        if self.claim_idle < Duration::from_millis(1) {
            return Err(Error::Config(
                "claim_idle is under 1 ms; use at least 1 ms".into(),
            ));
        }
        Ok(Settings {
            stream: self.stream,
            group: self.group,
            consumer,
            id_field: self.id_field,
            dead_letter_stream,
            poll_timeout: self.poll_timeout,
            claim_idle: self.claim_idle,
            claim_interval: self.claim_interval,
        })
    }
}

/// `<hostname>-<pid>`: unique among live processes on a network, stable for the process's life.
fn default_consumer_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "consumer".to_owned());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused_with_the_fix() {
        let b = || RedisStreamSourceBuilder::new("s".into(), "g".into());
        assert!(b().settings().is_ok());
        let e = b().id_field("payload").settings().expect_err("refused");
        assert!(e.to_string().contains("holds the payload"), "{e}");
        let e = b()
            .poll_timeout(Duration::ZERO)
            .settings()
            .expect_err("refused");
        assert!(e.to_string().contains("at least 1 ms"), "{e}");
        let e = b().dead_letter_stream("s").settings().expect_err("refused");
        assert!(e.to_string().contains("pick another key"), "{e}");
        let s = b().settings().expect("parses");
        assert_eq!(s.dead_letter_stream, "s:dlq");
        assert!(s.consumer.ends_with(&format!("-{}", std::process::id())));
    }
}
