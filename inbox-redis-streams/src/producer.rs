//! Adding entries in the layout [`RedisStreamSource`](crate::RedisStreamSource) reads.

use std::time::Duration;

use inbox_core::{OutgoingMessage, Publish, PublishError};
use redis::aio::ConnectionManager;

use crate::connection::{Conn, Request};
use crate::{Error, RedisConnection, Result, DEFAULT_ID_FIELD, PAYLOAD_FIELD};

/// Adds entries to streams:
/// `XADD <stream> * <ID field> <id> payload <bytes> [<header> <value>…]`, a message's headers
/// as the further fields. Build it with [`RedisConnection::producer`]; it is not bound to a
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
    replicas: Option<Replicas>,
}

/// How many replicas must confirm each write (`WAIT`), and how long to wait for them.
#[derive(Debug, Clone, Copy)]
struct Replicas {
    count: u32,
    timeout: Duration,
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
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStreamProducer`] on the Redis its [`RedisConnection`] reaches (unless
/// [`connection_manager`](Self::connection_manager) gives a connection); start with
/// [`RedisConnection::producer`] (or [`RedisStreamProducer::builder`], on the Redis `REDIS_URL`
/// names).
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisStreamProducerBuilder {
    connection: RedisConnection,
    manager: Option<ConnectionManager>,
    id_field: String,
    replicas: Option<Replicas>,
}

impl std::fmt::Debug for RedisStreamProducerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamProducerBuilder")
            .field("connection", &self.connection)
            .field("connection_manager", &self.manager.is_some())
            .field("id_field", &self.id_field)
            .field("replicas", &self.replicas)
            .finish()
    }
}

impl RedisStreamProducerBuilder {
    pub(crate) fn new(connection: RedisConnection) -> Self {
        Self {
            connection,
            manager: None,
            id_field: DEFAULT_ID_FIELD.to_owned(),
            replicas: None,
        }
    }

    /// Confirms each send only once `replicas` replicas have it too (`WAIT <replicas> <timeout>`
    /// right after the `XADD`, on the same connection); default: no wait.
    ///
    /// Without it, a failover (Redis Cluster, Sentinel) loses the entries its master had
    /// answered but not yet replicated ([Lost writes](crate#redis-cluster)); with it, a send
    /// that returns `Ok` survives as long as one of those replicas takes over. When fewer
    /// replicas confirm within `timeout` the send
    /// fails with [`Error::NotReplicated`] ([`Recovery::Retry`](inbox_core::Recovery)): the
    /// entry may or may not survive, so send again under the same message ID, and the consumer
    /// applies it once either way. `WAIT` is not a transaction: it cannot undo the write, and a
    /// replica that confirmed can still lose the failover election to one that did not (rare;
    /// Redis prefers the replica with the most data). On a Redis Cluster each write
    /// and its `WAIT` go to the master of the stream's hash slot.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replicas = Some(Replicas {
            count: replicas,
            timeout,
        });
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

    /// Connects (unless given a connection manager) and returns the producer. A server that
    /// cannot be reached fails this, with an error naming it.
    pub async fn connect(self) -> Result<RedisStreamProducer> {
        if self.id_field.is_empty() || self.id_field == PAYLOAD_FIELD {
            return Err(Error::Config(format!(
                "the ID field `{}` is empty or the payload field; pick another name",
                self.id_field
            )));
        }
        if let Some(r) = self.replicas {
            crate::config::at_least_1ms("the wait for replicas", r.timeout)?;
        }
        let conn = match self.manager {
            Some(manager) => Connection::Manager(manager),
            None => Connection::Own(self.connection.open("the producer").await?),
        };
        Ok(RedisStreamProducer {
            conn,
            id_field: self.id_field,
            replicas: self.replicas,
        })
    }
}

impl RedisStreamProducer {
    /// Starts configuring a producer on the Redis `REDIS_URL` names:
    /// [`RedisConnection::from_env`]`()`[`.producer()`](RedisConnection::producer).
    pub fn builder() -> RedisStreamProducerBuilder {
        RedisConnection::from_env().producer()
    }

    /// Adds `message` to `stream` with one `XADD` and returns the entry ID Redis assigned.
    pub async fn add(&self, stream: &str, message: &OutgoingMessage) -> Result<String> {
        self.check_headers(message)?;
        let mut cmd = redis::cmd("XADD");
        cmd.arg((stream, "*", &self.id_field, message.id.as_str()))
            .arg((PAYLOAD_FIELD, message.payload.as_slice()));
        for (name, value) in message.traced_headers() {
            cmd.arg((name, value.as_ref()));
        }
        self.write(&cmd, stream, || format!("XADD to stream {stream}"))
            .await
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

    /// Runs the write `cmd` to `stream`, followed by `WAIT` on the same connection when
    /// replicas must confirm it; `context` names it in errors.
    async fn write<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        stream: &str,
        context: impl Fn() -> String,
    ) -> Result<T> {
        let Some(replicas) = self.replicas else {
            return self
                .request(Request::Cmd(cmd), Duration::ZERO)
                .await
                .map_err(|e| Error::redis(context(), e));
        };
        // One pipeline: on a cluster it goes to the node of the stream's slot, where `WAIT`
        // waits for this connection's writes, the `XADD` included.
        let mut pipeline = redis::pipe();
        pipeline
            .add_command(cmd.clone())
            .cmd("WAIT")
            .arg(replicas.count)
            .arg(replicas.timeout.as_millis().max(1) as u64);
        let (written, confirmed): (T, u32) = self
            .request(Request::Pipeline(&pipeline), replicas.timeout)
            .await
            .map_err(|e| Error::redis(format!("{} and WAIT", context()), e))?;
        if confirmed < replicas.count {
            return Err(Error::NotReplicated {
                stream: stream.to_owned(),
                confirmed,
                wanted: replicas.count,
                timeout: replicas.timeout,
            });
        }
        Ok(written)
    }

    /// Runs `request` once, waiting the operation timeout plus `extra`. Not repeated on a new
    /// connection: only the caller can retry under the same IDs.
    async fn request<T: redis::FromRedisValue>(
        &self,
        request: Request<'_>,
        extra: Duration,
    ) -> redis::RedisResult<T> {
        match &self.conn {
            Connection::Own(conn) => conn.request(request, extra).await,
            Connection::Manager(conn) => request.send(&mut conn.clone()).await,
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
impl Publish for RedisStreamProducer {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let traced =
            inbox_core::telemetry::traced_send("redis", destination, messages.len(), async {
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
                cmd.arg((XADD_ALL, 1, destination, &self.id_field, PAYLOAD_FIELD));
                for message in messages {
                    self.check_headers(message).map_err(failed)?;
                    let headers: Vec<_> = message.traced_headers().collect();
                    let id = message.id.as_str();
                    cmd.arg((id, message.payload.as_slice(), headers.len()));
                    for (name, value) in headers {
                        cmd.arg((name, value.as_ref()));
                    }
                }
                let added: usize = self
                    .write(&cmd, destination, || {
                        format!("EVAL of XADDs to stream {destination}")
                    })
                    .await
                    .map_err(failed)?;
                if added != messages.len() {
                    return Err(failed(Error::reply(
                        "EVAL",
                        format!("added {added} of {} entries", messages.len()),
                    )));
                }
                Ok(())
            });
        traced.await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_for_replicas_of_no_time_is_refused_before_connecting() {
        let e = RedisConnection::new("redis://127.0.0.1:1")
            .producer()
            .wait_for_replicas(1, Duration::ZERO)
            .connect()
            .await
            .expect_err("WAIT 1 0 would wait for ever");
        assert!(e.to_string().contains("at least 1 ms"), "{e}");
    }
}
