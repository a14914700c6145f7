//! Adding entries in the layout [`RedisStreamSource`](crate::RedisStreamSource) reads.

use std::time::Duration;

use inbox_core::{async_trait, OutgoingMessage, Publish, PublishError};
use redis::aio::ConnectionManager;
use redis::Client;

use crate::config::Server;
use crate::connection::Conn;
use crate::{Error, Result, DEFAULT_ID_FIELD, PAYLOAD_FIELD};

/// Adds entries to streams:
/// `XADD <stream> * <ID field> <id> payload <bytes> [<header> <value>…]`, a message's headers
/// as the further fields. Build it with [`RedisStreamProducer::builder`]; it is not bound to a
/// stream: send with the [`Publish`] methods (`send`, `send_with_id`, `send_batch`, each naming
/// the stream), or [`RedisStreamProducer::add`] for the entry ID Redis assigns.
///
/// The message ID is what the consumer deduplicates on, so a retry of a failed `XADD` must
/// reuse the same ID: use [`Publish::send_with_id`] with an ID you keep, and a retry that did
/// reach Redis twice is applied once.
#[derive(Clone)]
pub struct RedisStreamProducer {
    conn: Connection,
    id_field: String,
}

#[derive(Clone)]
enum Connection {
    /// Made by [`RedisStreamProducerBuilder::connect`]: bounded commands, replaced when it
    /// fails.
    Own(Conn),
    /// The caller's.
    Manager(ConnectionManager),
}

// Not derived: the ID field says which producer this is; a caller's connection manager would
// add its whole client configuration.
impl std::fmt::Debug for RedisStreamProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamProducer")
            .field("id_field", &self.id_field)
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStreamProducer`]; start with [`RedisStreamProducer::builder`].
///
/// Redis is reached at the `REDIS_URL` environment variable (no default: unset, connect fails)
/// unless [`url`](Self::url), [`client`](Self::client) or
/// [`connection_manager`](Self::connection_manager) says otherwise.
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisStreamProducerBuilder {
    server: Server,
    manager: Option<ConnectionManager>,
    id_field: String,
    operation_timeout: Duration,
}

impl std::fmt::Debug for RedisStreamProducerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamProducerBuilder")
            .field("server", &self.server)
            .field("connection_manager", &self.manager.is_some())
            .field("id_field", &self.id_field)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

impl RedisStreamProducerBuilder {
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

    /// Sends over a connection you made instead of one of its own.
    ///
    /// Its timeouts and reconnects are then redis-rs's: a `ConnectionManager` does not
    /// reconnect after a reply timed out, so a connection that went silent fails every later
    /// send. Prefer the producer's own connection where that matters.
    pub fn connection_manager(mut self, conn: ConnectionManager) -> Self {
        self.manager = Some(conn);
        self
    }

    /// The field the ID goes in (default `event_id`); must match the consumer's.
    pub fn id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = field.into();
        self
    }

    /// How long connecting, or one `XADD`, may wait for Redis (default 10 s). A connection that
    /// failed or went silent is replaced by the next send.
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// Connects (unless given a connection manager) and returns the producer. A server that
    /// cannot be reached fails this, with an error naming it.
    pub async fn connect(self) -> Result<RedisStreamProducer> {
        if self.id_field.is_empty() || self.id_field == PAYLOAD_FIELD {
            return Err(Error::Config(format!(
                "the ID field `{}` is empty or the payload field; pick another name",
                self.id_field
            )));
        }
        if self.operation_timeout < Duration::from_millis(1) {
            return Err(Error::Config(
                "operation_timeout is under 1 ms; use at least 1 ms".into(),
            ));
        }
        let conn = match self.manager {
            Some(manager) => Connection::Manager(manager),
            None => {
                let (client, shown) = self.server.client()?;
                // Not a redis-rs `ConnectionManager`: it keeps a connection whose reply timed
                // out, and its reconnect could hang a send for good after a server restart.
                let conn = Conn::connect(client, "producer", self.operation_timeout)
                    .await
                    .map_err(|e| {
                        Error::redis(
                            format!("connecting to Redis at {shown} for the producer"),
                            e,
                        )
                    })?;
                Connection::Own(conn)
            }
        };
        Ok(RedisStreamProducer {
            conn,
            id_field: self.id_field,
        })
    }
}

impl RedisStreamProducer {
    /// Starts configuring a producer.
    ///
    /// ```no_run
    /// use inbox_core::Publish;
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// let producer = inbox_redis_streams::RedisStreamProducer::builder()
    ///     .connect() // REDIS_URL, or redis://127.0.0.1:6379
    ///     .await?;
    /// let id = producer.send("payments", b"100").await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub fn builder() -> RedisStreamProducerBuilder {
        RedisStreamProducerBuilder {
            server: Server::Env,
            manager: None,
            id_field: DEFAULT_ID_FIELD.to_owned(),
            operation_timeout: Duration::from_secs(10),
        }
    }

    /// Adds `message` to `stream` with one `XADD` and returns the entry ID Redis assigned.
    pub async fn add(&self, stream: &str, message: &OutgoingMessage) -> Result<String> {
        self.check_headers(message)?;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(stream)
            .arg("*")
            .arg(&self.id_field)
            .arg(message.id.as_str())
            .arg(PAYLOAD_FIELD)
            .arg(message.payload.as_slice());
        for (name, value) in message.traced_headers() {
            cmd.arg(name).arg(value.as_ref());
        }
        self.query(&cmd)
            .await
            .map_err(|e| Error::redis(format!("XADD to stream {stream}"), e))
    }

    /// Refuses a header of `message` that would shadow its ID or payload field.
    fn check_headers(&self, message: &OutgoingMessage) -> Result<()> {
        for (name, _) in &message.headers {
            if *name == self.id_field || name == PAYLOAD_FIELD {
                return Err(Error::Config(format!(
                    "header `{name}` would shadow the ID or payload field; rename it"
                )));
            }
        }
        Ok(())
    }

    /// Runs `cmd` once. Not repeated on a new connection: only the caller can retry under the
    /// same IDs.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        match &self.conn {
            Connection::Own(conn) => conn.query(cmd, Duration::ZERO).await,
            Connection::Manager(conn) => cmd.query_async(&mut conn.clone()).await,
        }
    }
}

/// `destination` is the stream key. Keys are ignored: a stream has one order for all its
/// entries.
///
/// One message is one `XADD` ([`RedisStreamProducer::add`]). A batch is one command, an `EVAL`
/// of a script that runs one `XADD` per message in slice order (one round-trip, and Redis runs
/// it without interleaving other clients' commands); `Ok` once Redis answered that it added them
/// all. The script needs `EVAL` permission.
#[async_trait]
impl Publish for RedisStreamProducer {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        /// Per message: its ID, payload, header count, then the headers' names and values; one
        /// `XADD` each, with the ID and payload field names first.
        const XADD_ALL: &str = "local i, n = 3, 0
            while i <= #ARGV do
                local fields = {ARGV[1], ARGV[i], ARGV[2], ARGV[i + 1]}
                for j = 1, 2 * tonumber(ARGV[i + 2]) do
                    fields[4 + j] = ARGV[i + 2 + j]
                end
                redis.call('XADD', KEYS[1], '*', unpack(fields))
                i = i + 3 + 2 * tonumber(ARGV[i + 2])
                n = n + 1
            end
            return n";
        let failed = |e: Error| {
            PublishError::new(
                e.recovery(),
                format!("adding to Redis stream `{destination}`"),
                e,
            )
        };
        if let [message] = messages {
            self.add(destination, message).await.map_err(failed)?;
            return Ok(());
        }
        if messages.is_empty() {
            return Ok(());
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(XADD_ALL)
            .arg(1)
            .arg(destination)
            .arg(&self.id_field)
            .arg(PAYLOAD_FIELD);
        for message in messages {
            self.check_headers(message).map_err(failed)?;
            let headers: Vec<_> = message.traced_headers().collect();
            cmd.arg(message.id.as_str())
                .arg(message.payload.as_slice())
                .arg(headers.len());
            for (name, value) in headers {
                cmd.arg(name).arg(value.as_ref());
            }
        }
        let added: usize = self.query(&cmd).await.map_err(|e| {
            failed(Error::redis(
                format!("EVAL of XADDs to stream {destination}"),
                e,
            ))
        })?;
        if added != messages.len() {
            return Err(failed(Error::reply(
                "EVAL",
                format!("added {added} of {} entries", messages.len()),
            )));
        }
        Ok(())
    }
}
