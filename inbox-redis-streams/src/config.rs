//! How a [`RedisStreamSource`] is set up.

use std::future::Future;
use std::time::Duration;

use inbox_core::IdFrom;

use redis::{Cmd, FromRedisValue, ToRedisArgs};

use crate::connection::Conn;
use crate::{Error, RedisConnection, RedisStreamSource, Result};

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
    /// The hash of entries handed back under a redelivery schedule: entry ID to its
    /// [`Mark`](crate::sweep::Mark). Read by the claim sweep, which leaves such an entry
    /// pending until it has been idle for its delay.
    pub(crate) fn redeliveries_key(&self) -> String {
        format!("{}:{}:redeliveries", self.stream, self.group)
    }

    /// `<command> <stream> <args…>` on `conn`, repeated once after a dropped connection
    /// ([`Conn::idempotent`]); a failure names the command and the stream.
    pub(crate) fn on_stream<'a, T: FromRedisValue + Send + 'a>(
        &self,
        conn: &'a Conn,
        command: &'static str,
        args: impl ToRedisArgs,
    ) -> impl Future<Output = Result<T>> + Send + 'a {
        let mut cmd = redis::cmd(command);
        cmd.arg(&self.stream).arg(args);
        run(conn, cmd, format!("{command} on stream {}", self.stream))
    }

    /// `<command> <stream> <group> <args…>`, like [`on_stream`](Self::on_stream).
    pub(crate) fn on_group<'a, T: FromRedisValue + Send + 'a>(
        &self,
        conn: &'a Conn,
        command: &'static str,
        args: impl ToRedisArgs,
    ) -> impl Future<Output = Result<T>> + Send + 'a {
        let mut cmd = redis::cmd(command);
        cmd.arg(&self.stream).arg(&self.group).arg(args);
        run(conn, cmd, format!("{command} on stream {}", self.stream))
    }

    /// `<command> <redeliveries key> <args…>`, like [`on_stream`](Self::on_stream).
    pub(crate) fn on_marks<'a, T: FromRedisValue + Send + 'a>(
        &self,
        conn: &'a Conn,
        command: &'static str,
        args: impl ToRedisArgs,
    ) -> impl Future<Output = Result<T>> + Send + 'a {
        let key = self.redeliveries_key();
        let mut cmd = redis::cmd(command);
        cmd.arg(&key).arg(args);
        run(conn, cmd, format!("{command} {key}"))
    }
}

/// The command, built before the future so that the future holds no borrowed arguments.
async fn run<T: FromRedisValue + Send>(conn: &Conn, cmd: Cmd, context: String) -> Result<T> {
    conn.idempotent(&cmd)
        .await
        .map_err(|e| Error::redis(context, e))
}

/// Refuses a duration under 1 ms: Redis counts in milliseconds and reads 0 as for ever
/// (`BLOCK 0`, `WAIT n 0`) or, for a claim, as at once.
pub(crate) fn at_least_1ms(what: &str, duration: Duration) -> Result<()> {
    if duration < Duration::from_millis(1) {
        return Err(Error::Config(format!(
            "{what} is under 1 ms; use at least 1 ms"
        )));
    }
    Ok(())
}

/// Builds a [`RedisStreamSource`] on the Redis its [`RedisConnection`] reaches; start with
/// [`RedisConnection::source`] (or [`RedisStreamSource::builder`], on the Redis `REDIS_URL`
/// names), finish with [`RedisStreamSourceBuilder::connect`]. Its `Debug` output hides a
/// password in the URL.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisStreamSourceBuilder {
    connection: RedisConnection,
    stream: String,
    group: String,
    consumer: Option<String>,
    id_from: IdFrom,
    dead_letter_stream: Option<String>,
    poll_timeout: Duration,
    claim_idle: Duration,
    claim_interval: Duration,
}

impl RedisStreamSourceBuilder {
    pub(crate) fn new(connection: RedisConnection, stream: String, group: String) -> Self {
        Self {
            connection,
            stream,
            group,
            consumer: None,
            id_from: IdFrom::Header(crate::DEFAULT_ID_FIELD.to_owned()),
            dead_letter_stream: None,
            poll_timeout: Duration::from_secs(2),
            claim_idle: Duration::from_secs(60),
            claim_interval: Duration::from_secs(5),
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

    /// Connects, creates the consumer group if it is missing and returns the source. A server
    /// that cannot be reached fails this, with an error naming it.
    pub async fn connect(self) -> Result<RedisStreamSource> {
        let connection = self.connection.clone();
        let settings = self.settings()?;
        // Two connections: a blocking XREADGROUP holds its connection until it returns, and acks
        // should not queue behind it.
        let reader = connection.open("reads").await?;
        let commands = connection.open("commands").await?;
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
        let consumer = self.consumer.unwrap_or_else(default_consumer_name);
        nonempty("consumer name", &consumer)?;
        let dead_letter_stream = match self.dead_letter_stream {
            Some(name) => name,
            #[cfg(feature = "cluster")]
            None if self.connection.is_cluster() => {
                crate::cluster::dead_letter_stream(&self.stream)
            }
            None => format!("{}:dlq", self.stream),
        };
        if dead_letter_stream == self.stream {
            return Err(Error::Config(format!(
                "the dead-letter stream is the stream `{}` itself; pick another key",
                self.stream
            )));
        }
        #[cfg(feature = "cluster")]
        if self.connection.is_cluster() {
            crate::cluster::check_same_slot(&self.stream, &dead_letter_stream)?;
        }
        at_least_1ms("poll_timeout", self.poll_timeout)?;
        at_least_1ms("claim_idle", self.claim_idle)?;
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
        let b = || RedisConnection::from_env().source("s", "g");
        for (bad, fix) in [
            (b().id_field("payload"), "holds the payload"),
            (
                b().id_from(IdFrom::MessageIdProperty),
                "Redis Streams has no message-ID",
            ),
            (b().poll_timeout(Duration::ZERO), "at least 1 ms"),
            (b().claim_idle(Duration::ZERO), "at least 1 ms"),
            (b().dead_letter_stream("s"), "pick another key"),
        ] {
            let e = bad.settings().expect_err(fix);
            assert!(e.to_string().contains(fix), "{e}");
        }
        assert!(b().id_from(IdFrom::cloud_events()).settings().is_ok());
        let s = b().settings().expect("parses");
        assert_eq!(s.dead_letter_stream, "s:dlq");
        assert!(s.consumer.ends_with(&format!("-{}", std::process::id())));
    }

    #[cfg(feature = "cluster")]
    #[test]
    fn on_a_cluster_the_dead_letter_stream_shares_the_slot_and_passwords_stay_hidden() {
        let b = |stream: &str| {
            RedisConnection::cluster(["redis://:hunter2@127.0.0.1:7000"]).source(stream, "g")
        };
        assert_eq!(
            b("orders").settings().expect("parses").dead_letter_stream,
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
