//! How a [`RedisStreamSource`] is set up.

use std::time::Duration;

use inbox_core::IdFrom;
use redis::Client;

use crate::connection::{Conn, Target};
use crate::{Error, RedisStreamSource, Result};

/// Everything a source and its acks need to know, shared between them.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) stream: String,
    pub(crate) group: String,
    pub(crate) consumer: String,
    pub(crate) id_from: IdFrom,
    pub(crate) dead_letter_stream: String,
    pub(crate) poll_timeout: Duration,
    pub(crate) claim_idle: Duration,
    pub(crate) claim_interval: Duration,
}

impl Settings {
    /// The hash of entries handed back under a redelivery schedule: entry ID to
    /// `<redelivery count>:<delay in ms>`. Read by the claim sweep, which leaves such an entry
    /// pending until it has been idle for its delay.
    pub(crate) fn redeliveries_key(&self) -> String {
        format!("{}:{}:redeliveries", self.stream, self.group)
    }
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
    id_from: IdFrom,
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
            .field("id_from", &self.id_from)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("poll_timeout", &self.poll_timeout)
            .field("claim_idle", &self.claim_idle)
            .field("claim_interval", &self.claim_interval)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

/// Where Redis is: the environment, a URL, a client made by the caller, or a cluster's seed
/// nodes.
#[derive(Clone)]
pub(crate) enum Server {
    Env,
    Url(String),
    /// Boxed: a client with TLS certificates is several times the other variants' size.
    Client(Box<Client>),
    /// The URLs of some of a Redis Cluster's nodes; the others are learnt from them.
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Server::Env => f.write_str("REDIS_URL"),
            Server::Url(url) => write!(f, "{:?}", inbox_core::redact_url(url)),
            Server::Client(_) => f.write_str("a given client"),
            #[cfg(feature = "cluster")]
            Server::Cluster(nodes) => f.debug_tuple("Cluster").field(&shown_nodes(nodes)).finish(),
        }
    }
}

impl Server {
    /// Whether this is a Redis Cluster, where a script's keys must share a hash slot.
    #[cfg(feature = "cluster")]
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Server::Cluster(_))
    }

    /// Where to connect, and how to name it in errors (URLs without their passwords). `timeout`
    /// bounds each connection attempt.
    pub(crate) fn target(self, timeout: Duration) -> Result<(Target, String)> {
        let url = match self {
            Server::Client(client) => {
                let shown = client.get_connection_info().addr().to_string();
                return Ok((Target::Server(client), shown));
            }
            Server::Url(url) => url,
            Server::Env => crate::url_from_env()?,
            #[cfg(feature = "cluster")]
            Server::Cluster(nodes) => {
                let shown = format!("the cluster of {}", shown_nodes(&nodes).join(", "));
                if nodes.is_empty() {
                    return Err(Error::Config(
                        "no Redis Cluster node: give `cluster` at least one node URL".into(),
                    ));
                }
                // No response timeout of the client's: each command is bounded by the source's
                // own (a blocking read needs longer than the others).
                let client = redis::cluster::ClusterClient::builder(nodes)
                    .connection_timeout(timeout)
                    .build()
                    .map_err(|e| Error::Config(format!("{shown}: {e}")))?;
                return Ok((Target::Cluster(Box::new(client)), shown));
            }
        };
        let _ = timeout; // a server's connections are bounded in `Conn`
        let shown = inbox_core::redact_url(&url).to_string();
        let client = Client::open(url.as_str())
            .map_err(|e| Error::Config(format!("Redis URL {shown:?} does not parse: {e}")))?;
        Ok((Target::Server(Box::new(client)), shown))
    }
}

/// Node URLs without their passwords.
#[cfg(feature = "cluster")]
fn shown_nodes(nodes: &[String]) -> Vec<String> {
    nodes
        .iter()
        .map(|url| inbox_core::redact_url(url).to_string())
        .collect()
}

impl RedisStreamSourceBuilder {
    pub(crate) fn new(stream: String, group: String) -> Self {
        Self {
            server: Server::Env,
            stream,
            group,
            consumer: None,
            id_from: IdFrom::Header(crate::DEFAULT_ID_FIELD.to_owned()),
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
    ///
    /// Shorthand for [`id_from`](Self::id_from)`(IdFrom::Header(field))`.
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_from = IdFrom::Header(field.into());
        self
    }

    /// Where the message ID is read from (default: the entry field `event_id`): an entry field
    /// ([`IdFrom::Header`]), a structured-mode CloudEvent in the `payload` field (CloudEvents
    /// defines no Redis binding for fields), the Debezium outbox router's `id` (as a field), or
    /// a JSON field of the payload. Redis has no message-ID property a producer sets, so
    /// [`IdFrom::MessageIdProperty`] is refused at `connect`.
    pub fn id_from(mut self, from: IdFrom) -> Self {
        self.id_from = from;
        self
    }

    /// Where entries that cannot be applied go (default `<stream>:dlq`; on a Redis Cluster
    /// `{<stream>}:dlq` unless the stream has a hash tag, see [Redis Cluster](crate#redis-cluster)). A
    /// dead letter's copy and its `XACK` run in one script, whose two streams must share a hash
    /// slot on a cluster: `connect` refuses two slots there.
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

    /// Connects to the Redis Cluster these nodes belong to (feature `cluster`) instead of
    /// `REDIS_URL`: `redis://host:port` URLs of one or more of its nodes, from which the others
    /// are learnt. Every command goes to the master holding the stream's hash slot, following
    /// the cluster through failovers and slot migrations.
    ///
    /// The stream and its dead-letter stream must share a hash slot: the default dead-letter
    /// stream is `<stream>:dlq` when the stream has a hash tag (`{orders}` → `{orders}:dlq`)
    /// and `{<stream>}:dlq` when it has none (`orders` → `{orders}:dlq`, whose tag hashes to
    /// the slot of `orders`). A [`dead_letter_stream`](Self::dead_letter_stream) in another
    /// slot fails `connect`.
    ///
    /// ```no_run
    /// # async fn f() -> inbox_redis_streams::Result<()> {
    /// let source = inbox_redis_streams::RedisStreamSource::builder("{payments}", "wallet")
    ///     .cluster(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])
    ///     .consumer_name("wallet-0")
    ///     .connect() // dead letters go to `{payments}:dlq`
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "cluster")]
    pub fn cluster<I>(mut self, nodes: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.server = Server::Cluster(nodes.into_iter().map(Into::into).collect());
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
        let (target, shown) = server.target(timeout)?;
        let connect = |what: &str| format!("connecting to Redis at {shown} for {what}");
        // Two connections: a blocking XREADGROUP holds its connection until it returns, and acks
        // should not queue behind it.
        let reader = Conn::connect(target.clone(), "reads", timeout)
            .await
            .map_err(|e| Error::redis(connect("reads"), e))?;
        let commands = Conn::connect(target, "commands", timeout)
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
        self.id_from
            .check(&crate::source::ID_BINDING)
            .map_err(Error::Config)?;
        if self.id_from.first_header() == Some(crate::PAYLOAD_FIELD) {
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
        let dead_letter_stream = match self.dead_letter_stream {
            Some(name) => name,
            #[cfg(feature = "cluster")]
            None if self.server.is_cluster() => crate::cluster::dead_letter_stream(&self.stream),
            None => format!("{}:dlq", self.stream),
        };
        if dead_letter_stream == self.stream {
            return Err(Error::Config(format!(
                "the dead-letter stream is the stream `{}` itself; pick another key",
                self.stream
            )));
        }
        #[cfg(feature = "cluster")]
        if self.server.is_cluster() {
            crate::cluster::check_same_slot(&self.stream, &dead_letter_stream)?;
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
            id_from: self.id_from,
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
            .id_from(IdFrom::MessageIdProperty)
            .settings()
            .expect_err("refused");
        assert!(
            e.to_string().contains("Redis Streams has no message-ID"),
            "{e}"
        );
        assert!(b().id_from(IdFrom::cloud_events()).settings().is_ok());
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

    #[cfg(feature = "cluster")]
    #[test]
    fn on_a_cluster_the_dead_letter_stream_shares_the_slot_and_passwords_stay_hidden() {
        let b = |stream: &str| {
            RedisStreamSourceBuilder::new(stream.into(), "g".into())
                .cluster(["redis://:hunter2@127.0.0.1:7000"])
        };
        assert_eq!(
            b("orders").settings().expect("parses").dead_letter_stream,
            "{orders}:dlq"
        );
        assert_eq!(
            b("{orders}").settings().expect("parses").dead_letter_stream,
            "{orders}:dlq"
        );
        let e = b("orders")
            .dead_letter_stream("orders:dlq")
            .settings()
            .expect_err("another slot");
        assert!(e.to_string().contains("hash slot"), "{e}");
        assert!(b("a}b{").settings().is_err());
        let shown = format!("{:?}", b("orders"));
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("127.0.0.1:7000"), "{shown}");
    }
}
