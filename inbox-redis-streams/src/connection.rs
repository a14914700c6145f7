//! [`RedisConnection`], where and how to reach Redis, shared by the source, the producer and the
//! dead-letter reader; and the connections they make from it: every command bounded by the
//! operation timeout, and a connection that failed or went silent replaced by a new one on the
//! next command.
//!
//! Not redis-rs's `ConnectionManager`: it keeps a connection whose reply timed out (a timeout
//! is not a reason to reconnect there), so after a network black hole every later command on
//! the dead connection timed out too, for good; and its background reconnect, with retries of
//! its own, could leave a command waiting with no bound after a server restart.
//!
//! One server or a whole cluster, through one path: both connections are redis-rs
//! `ConnectionLike`s, and [`Link`] is either. A cluster connection follows `MOVED` and `ASK`,
//! refreshes its slot map and reconnects to nodes by itself; the bound and the replacement here
//! come on top, for a cluster that stays silent.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{
    AsyncConnectionConfig, Client, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value,
};
use tokio::sync::Mutex;
use tracing::info;

use crate::{
    Error, RedisDeadLettersBuilder, RedisStreamProducerBuilder, RedisStreamSourceBuilder, Result,
};

/// Where and how to reach Redis: one server's URL or a Redis Cluster's nodes (with a private CA
/// if need be), or a client you configured (a client certificate), and how long an operation
/// may take. The source, the producer and the dead-letter reader are all built from it, so a
/// setting made here reaches the three at once.
///
/// ```no_run
/// # async fn f() -> inbox_redis_streams::Result<()> {
/// use std::time::Duration;
/// use inbox_redis_streams::RedisConnection;
///
/// let redis = RedisConnection::new("rediss://:secret@redis.internal:6380/0")
///     .operation_timeout(Duration::from_secs(5));
/// let source = redis.source("payments", "wallet").connect().await?;
/// let producer = redis.producer().connect().await?;
/// let dead_letters = redis.dead_letters("payments:dlq").connect().await?;
/// # let _ = (source, producer, dead_letters); Ok(()) }
/// ```
///
/// Its `Debug` output hides a password in the URL.
#[derive(Clone)]
#[must_use]
pub struct RedisConnection {
    server: Server,
    operation_timeout: Duration,
    /// The PEM certificate authorities trusted instead of the system's
    /// ([`ca_certificates`](Self::ca_certificates)).
    #[cfg(feature = "tls")]
    ca: Option<Vec<u8>>,
}

/// Where Redis is.
#[derive(Clone)]
enum Server {
    Env,
    Url(String),
    /// Boxed: a client with TLS certificates is several times the other variants' size.
    Client(Box<Client>),
    /// The URLs of some of a Redis Cluster's nodes; the others are learnt from them.
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut shown = f.debug_struct("RedisConnection");
        match &self.server {
            Server::Env => shown.field("url", &"REDIS_URL"),
            Server::Url(url) => shown.field("url", &inbox_core::redact_url(url)),
            Server::Client(_) => shown.field("client", &"given"),
            #[cfg(feature = "cluster")]
            Server::Cluster(nodes) => shown.field("cluster", &shown_nodes(nodes)),
        };
        #[cfg(feature = "tls")]
        if self.ca.is_some() {
            shown.field("ca", &"given");
        }
        shown
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

impl RedisConnection {
    fn at(server: Server) -> Self {
        Self {
            server,
            operation_timeout: Duration::from_secs(10),
            #[cfg(feature = "tls")]
            ca: None,
        }
    }

    /// The server at `url` (`redis://host:port/db`; `rediss://…` needs the feature `tls`).
    pub fn new(url: impl Into<String>) -> Self {
        Self::at(Server::Url(url.into()))
    }

    /// The server `REDIS_URL` names. Unset, connecting fails with an error saying so: there is
    /// no default, so a missing setting never reaches a Redis on localhost.
    pub fn from_env() -> Self {
        Self::at(Server::Env)
    }

    /// The server `client` reaches, as you configured it: for a client certificate,
    /// `Client::build_with_tls` (feature `tls`). A private CA alone is simpler with
    /// [`ca_certificates`](Self::ca_certificates).
    pub fn from_client(client: Client) -> Self {
        Self::at(Server::Client(Box::new(client)))
    }

    /// The Redis Cluster these nodes belong to (feature `cluster`): `redis://host:port` URLs of
    /// one or more of its nodes, from which the others are learnt. Every command goes to the
    /// master holding its stream's hash slot, following the cluster through failovers and slot
    /// migrations; see [Redis Cluster](crate#redis-cluster) for the keys a source needs.
    #[cfg(feature = "cluster")]
    pub fn cluster<I>(nodes: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        Self::at(Server::Cluster(nodes.into_iter().map(Into::into).collect()))
    }

    /// Trusts the certificate authorities in `pem` (PEM text) instead of the system's, for a
    /// `rediss://` server or a cluster's `rediss://` nodes (feature `tls`): a private CA, or a
    /// managed Redis's own. For a client certificate, build the client yourself and use
    /// [`from_client`](Self::from_client); the two do not combine.
    #[cfg(feature = "tls")]
    pub fn ca_certificates(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(pem.into());
        self
    }

    /// The certificates to connect with, when [`ca_certificates`](Self::ca_certificates) gave a
    /// CA.
    #[cfg(feature = "tls")]
    fn certificates(&self) -> Option<redis::TlsCertificates> {
        self.ca.as_ref().map(|ca| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca.clone()),
        })
    }

    /// How long connecting, or one command, may wait for Redis (default 10 s); a source's
    /// blocking read waits its [`poll_timeout`](RedisStreamSourceBuilder::poll_timeout) on top.
    ///
    /// Past it the command fails with a [`Recovery::Reconnect`](inbox_core::Recovery) error and
    /// its connection is dropped: the next command connects anew (within the same bound). A
    /// connection whose peer went silent (a network that drops packets, a hung server, a
    /// firewall that forgot the connection) would otherwise never answer again. See
    /// [Ack semantics](crate#ack-semantics) for what a source rereads after a lost connection.
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// A source reading `stream` in the consumer group `group`; finish with
    /// [`connect`](RedisStreamSourceBuilder::connect).
    pub fn source(
        &self,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> RedisStreamSourceBuilder {
        RedisStreamSourceBuilder::new(self.clone(), stream.into(), group.into())
    }

    /// A producer adding to any stream; finish with
    /// [`connect`](RedisStreamProducerBuilder::connect).
    pub fn producer(&self) -> RedisStreamProducerBuilder {
        RedisStreamProducerBuilder::new(self.clone())
    }

    /// A reader of the dead-letter stream `stream` (like `payments:dlq`), for
    /// [`inbox_core::replay`]; finish with [`connect`](RedisDeadLettersBuilder::connect).
    pub fn dead_letters(&self, stream: impl Into<String>) -> RedisDeadLettersBuilder {
        RedisDeadLettersBuilder::new(self.clone(), stream.into())
    }

    /// Whether this is a Redis Cluster, where a script's keys must share a hash slot.
    #[cfg(feature = "cluster")]
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.server, Server::Cluster(_))
    }

    /// Connects at once, for `purpose` (named in logs and errors), so a wrong address or a
    /// refused login fails the build.
    pub(crate) async fn open(&self, purpose: &'static str) -> Result<Conn> {
        crate::config::at_least_1ms("operation_timeout", self.operation_timeout)?;
        let (target, shown) = self.target()?;
        let conn = Conn(Arc::new(Inner {
            target,
            purpose,
            timeout: self.operation_timeout,
            current: Mutex::new(None),
            made: AtomicU64::new(0),
        }));
        conn.connection().await.map_err(|e| {
            Error::redis(format!("connecting to Redis at {shown} for {purpose}"), e)
        })?;
        Ok(conn)
    }

    /// Where to connect, and how to name it in errors (URLs without their passwords).
    fn target(&self) -> Result<(Target, String)> {
        let url = match &self.server {
            Server::Client(client) => {
                let shown = client.get_connection_info().addr().to_string();
                #[cfg(feature = "tls")]
                if self.ca.is_some() {
                    return Err(Error::Config(format!(
                        "ca_certificates with a client of your own ({shown}): give the CA to \
                         Client::build_with_tls instead"
                    )));
                }
                return Ok((Target::Server(client.clone()), shown));
            }
            Server::Url(url) => url.clone(),
            Server::Env => crate::url_from_env()?,
            #[cfg(feature = "cluster")]
            Server::Cluster(nodes) => {
                let shown = format!("the cluster of {}", shown_nodes(nodes).join(", "));
                if nodes.is_empty() {
                    return Err(Error::Config(
                        "no Redis Cluster node: give `cluster` at least one node URL".into(),
                    ));
                }
                // No response timeout of the client's: each command is bounded by its own
                // (a blocking read needs longer than the others).
                let client = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(self.operation_timeout);
                #[cfg(feature = "tls")]
                let client = match self.certificates() {
                    Some(certificates) => client.certs(certificates),
                    None => client,
                };
                let client = client
                    .build()
                    .map_err(|e| Error::Config(format!("{shown}: {e}")))?;
                return Ok((Target::Cluster(Box::new(client)), shown));
            }
        };
        let shown = inbox_core::redact_url(&url).to_string();
        #[cfg(feature = "tls")]
        let client = match self.certificates() {
            Some(certificates) => Client::build_with_tls(url.as_str(), certificates),
            None => Client::open(url.as_str()),
        };
        #[cfg(not(feature = "tls"))]
        let client = Client::open(url.as_str());
        let client = client
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

/// Where connections go: one server, or a Redis Cluster (feature `cluster`).
#[derive(Clone)]
enum Target {
    /// Boxed, as the cluster's: a client with TLS certificates is large.
    Server(Box<Client>),
    #[cfg(feature = "cluster")]
    Cluster(Box<redis::cluster::ClusterClient>),
}

/// A connection to one server or to a cluster.
#[derive(Clone)]
enum Link {
    Server(MultiplexedConnection),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

/// `$call` on the connection `$link` holds, named `$conn`.
macro_rules! on_link {
    ($link:expr, $conn:ident => $call:expr) => {
        match $link {
            Link::Server($conn) => $call,
            #[cfg(feature = "cluster")]
            Link::Cluster($conn) => $call,
        }
    };
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        on_link!(self, conn => conn.req_packed_command(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        on_link!(self, conn => conn.req_packed_commands(pipeline, offset, count))
    }

    fn get_db(&self) -> i64 {
        on_link!(self, conn => conn.get_db())
    }
}

/// One command, or several sent together on one connection (a pipeline: on a cluster, to the
/// node of its first key).
#[derive(Clone, Copy)]
pub(crate) enum Request<'a> {
    Cmd(&'a Cmd),
    Pipeline(&'a Pipeline),
}

impl Request<'_> {
    pub(crate) async fn send<T: redis::FromRedisValue>(
        self,
        conn: &mut (impl ConnectionLike + Send),
    ) -> RedisResult<T> {
        match self {
            Request::Cmd(cmd) => cmd.query_async(conn).await,
            Request::Pipeline(pipeline) => pipeline.query_async(conn).await,
        }
    }
}

/// One logical connection to Redis, shared by clones: the source's reads, or its commands and
/// the acks it hands out.
#[derive(Clone)]
pub(crate) struct Conn(Arc<Inner>);

struct Inner {
    target: Target,
    /// What the connection is for, in logs: `reads`, `commands`.
    purpose: &'static str,
    /// The bound on connecting and on each command.
    timeout: Duration,
    /// The connection in use, with its number; `None` after it failed.
    current: Mutex<Option<(u64, Link)>>,
    /// Connections made so far.
    made: AtomicU64,
}

impl Conn {
    /// How many connections were made so far: a change means the last one was lost, with
    /// whatever replies were on their way.
    pub(crate) fn made(&self) -> u64 {
        self.0.made.load(Ordering::Relaxed)
    }

    /// The connection in use, or a new one.
    async fn connection(&self) -> RedisResult<(u64, Link)> {
        let mut current = self.0.current.lock().await;
        if let Some(conn) = current.as_ref() {
            return Ok(conn.clone());
        }
        let conn = match &self.0.target {
            Target::Server(client) => {
                // The handshake (`HELLO`, `SELECT`, `AUTH`) is inside the bound: a server that
                // accepts the TCP connection and then says nothing does not hold the caller. No
                // response timeout of the client's (its default, 500 ms, would cut a blocking
                // `XREADGROUP` short): `query` bounds each command itself, and drops the
                // connection when the bound passes.
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.0.timeout))
                    .set_response_timeout(None);
                Link::Server(
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?,
                )
            }
            // Built with the connection timeout and no response timeout (see `target`); the
            // slot map is read from the first seed node that answers, within the same bound.
            #[cfg(feature = "cluster")]
            Target::Cluster(client) => {
                let connect = client.get_async_connection();
                match tokio::time::timeout(self.0.timeout, connect).await {
                    Ok(conn) => Link::Cluster(conn?),
                    Err(_) => return Err(timed_out(self.0.timeout, "no cluster node answered")),
                }
            }
        };
        let number = self.0.made.fetch_add(1, Ordering::Relaxed) + 1;
        if number > 1 {
            info!(purpose = self.0.purpose, "reconnected to Redis");
        }
        *current = Some((number, conn.clone()));
        Ok((number, conn))
    }

    /// Runs `cmd`, waiting at most the operation timeout plus `extra` (a blocking read's own
    /// wait) for the reply. A connection that failed, or gave no reply in time, is dropped:
    /// the next command makes a new one.
    pub(crate) async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        extra: Duration,
    ) -> RedisResult<T> {
        self.request(Request::Cmd(cmd), extra).await
    }

    /// [`query`](Self::query) for a command or a pipeline.
    pub(crate) async fn request<T: redis::FromRedisValue>(
        &self,
        request: Request<'_>,
        extra: Duration,
    ) -> RedisResult<T> {
        let (number, mut conn) = self.connection().await?;
        let limit = self.0.timeout + extra;
        let result = match tokio::time::timeout(limit, request.send(&mut conn)).await {
            Ok(result) => result,
            Err(_) => Err(timed_out(limit, "no reply from Redis")),
        };
        if let Err(e) = &result {
            if connection_is_broken(e) {
                let mut current = self.0.current.lock().await;
                // Only the connection this command used: another caller may have replaced it.
                if current.as_ref().is_some_and(|(n, _)| *n == number) {
                    info!(purpose = self.0.purpose, error = %e, "dropping the Redis connection");
                    *current = None;
                }
            }
        }
        result
    }

    /// Runs a command that is safe to repeat, and repeats it once on a new connection if the
    /// first one had dropped: an `XACK` lost to a single dropped connection would otherwise
    /// cost a redelivery. Not after a timeout, which would only double the wait.
    pub(crate) async fn idempotent<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> RedisResult<T> {
        match self.query(cmd, Duration::ZERO).await {
            Err(e) if (e.is_connection_dropped() || e.is_io_error()) && !e.is_timeout() => {
                info!(error = %e, "Redis connection lost; retrying the command on a new one");
                self.query(cmd, Duration::ZERO).await
            }
            other => other,
        }
    }
}

/// A timeout as an I/O error, so that it counts as a lost connection.
fn timed_out(limit: Duration, what: &str) -> RedisError {
    RedisError::from(io::Error::new(
        io::ErrorKind::TimedOut,
        format!(
            "{what} within {limit:?} (operation_timeout); the connection is dropped and a new \
             one made"
        ),
    ))
}

/// Whether the connection cannot be trusted with another command: it is closed, or a reply
/// went missing (a peer that went silent, or a network that swallows packets, stays so).
fn connection_is_broken(e: &RedisError) -> bool {
    e.is_timeout()
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let target = match &self.0.target {
            Target::Server(_) => "server",
            #[cfg(feature = "cluster")]
            Target::Cluster(_) => "cluster",
        };
        f.debug_struct("Conn")
            .field("target", &target)
            .field("purpose", &self.0.purpose)
            .field("timeout", &self.0.timeout)
            .field("made", &self.made())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_reply_or_a_closed_socket_breaks_the_connection_a_refused_command_does_not() {
        let timed_out = RedisError::from(io::Error::from(io::ErrorKind::TimedOut));
        assert!(connection_is_broken(&timed_out));
        let reset = RedisError::from(io::Error::from(io::ErrorKind::ConnectionReset));
        assert!(connection_is_broken(&reset));
        let refused = redis::make_extension_error("NOGROUP".into(), Some("x".into()));
        assert!(!connection_is_broken(&refused));
    }
}
