//! This crate's errors, and what the consumer loop does after each.

use inbox_core::{Recovery, SourceError};
use redis::{RedisError, RetryMethod};

/// Why a Redis stream operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is unusable; the message says which setting and how to fix it.
    #[error("invalid Redis stream configuration: {0}")]
    Config(String),
    /// Redis refused the command or the connection failed.
    #[error("{context}: {source}")]
    Redis {
        /// What was being done, e.g. `XACK on stream orders`.
        context: String,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// The consumer group, or the whole stream key, was deleted while the source ran (Redis
    /// answered `NOGROUP`); fatal, see [A deleted consumer group](crate#a-deleted-consumer-group).
    #[error(
        "consumer group `{group}` of stream `{stream}` is gone (the group or the stream key was \
         deleted while the consumer ran); it is not re-created on its own. Create it at the entry \
         to resume from, `XGROUP CREATE {stream} {group} <entry ID> MKSTREAM` (`$`: new entries \
         only; `0`: the whole stream again, where the inbox skips the IDs it still holds), then \
         restart the consumer"
    )]
    GroupMissing {
        /// The stream key.
        stream: String,
        /// The consumer group.
        group: String,
        /// Redis's `NOGROUP` error.
        #[source]
        source: RedisError,
    },
    /// Fewer replicas than
    /// [`wait_for_replicas`](crate::RedisStreamProducerBuilder::wait_for_replicas) asks for
    /// confirmed the write in time; retry under the same message IDs.
    #[error(
        "the master added to stream `{stream}`, but only {confirmed} of {wanted} replicas \
         confirmed it within {timeout:?}; a failover could lose it: send again under the same \
         message ID (the consumer skips a second copy)"
    )]
    NotReplicated {
        /// The stream key.
        stream: String,
        /// Replicas that confirmed (`WAIT`'s reply).
        confirmed: u32,
        /// Replicas asked for.
        wanted: u32,
        /// How long `WAIT` waited.
        timeout: std::time::Duration,
    },
    /// Redis answered with a shape this crate does not understand (a server that is not Redis
    /// 7, or a proxy that rewrites replies).
    #[error("unexpected reply to {command}: {detail}")]
    Reply {
        /// The command.
        command: &'static str,
        /// What was wrong with the reply.
        detail: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn redis(context: impl Into<String>, source: RedisError) -> Self {
        Self::Redis {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn reply(command: &'static str, detail: impl Into<String>) -> Self {
        Self::Reply {
            command,
            detail: detail.into(),
        }
    }

    /// What the consumer does next: reconnect after a lost connection, retry after a busy or
    /// loading server, stop on anything else (a deleted group, a wrong key type, no
    /// permission, a bad configuration).
    pub fn recovery(&self) -> Recovery {
        match self {
            Error::Config(_) | Error::GroupMissing { .. } | Error::Reply { .. } => Recovery::Fatal,
            Error::Redis { source, .. } => redis_recovery(source),
            // Replicas catch up, or a failover ends: the same send succeeds later.
            Error::NotReplicated { .. } => Recovery::Retry,
        }
    }

    /// `NOGROUP` becomes [`Error::GroupMissing`], naming the stream and the group.
    pub(crate) fn no_group(self, stream: &str, group: &str) -> Self {
        match self {
            Error::Redis { source, .. } if source.code() == Some("NOGROUP") => {
                Error::GroupMissing {
                    stream: stream.to_owned(),
                    group: group.to_owned(),
                    source,
                }
            }
            other => other,
        }
    }
}

fn redis_recovery(e: &RedisError) -> Recovery {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        return Recovery::Reconnect;
    }
    if e.is_timeout() {
        return Recovery::Retry;
    }
    // A deleted group does not come back by itself; see `Error::GroupMissing`.
    if e.code() == Some("NOGROUP") {
        return Recovery::Fatal;
    }
    // Server states that pass by themselves.
    if let Some("OOM" | "BUSY" | "LOADING" | "TRYAGAIN" | "MASTERDOWN" | "CLUSTERDOWN") = e.code() {
        return Recovery::Retry;
    }
    match e.retry_method() {
        RetryMethod::Reconnect | RetryMethod::ReconnectFromInitialConnections => {
            Recovery::Reconnect
        }
        // `READONLY` (a replica refusing writes) asks a cluster client to refresh its slot map;
        // one server's connection has none, and the same command fails again.
        RetryMethod::NoRetry | RetryMethod::RefreshSlotsAndRetry => Recovery::Fatal,
        _ => Recovery::Retry,
    }
}

impl From<Error> for SourceError {
    fn from(e: Error) -> Self {
        let recovery = e.recovery();
        let context = match &e {
            Error::Config(_) => "Redis stream configuration",
            Error::Redis { .. } => "Redis stream command",
            Error::GroupMissing { .. } => "Redis stream consumer group",
            Error::Reply { .. } => "Redis stream reply",
            Error::NotReplicated { .. } => "Redis replication",
        };
        SourceError::new(recovery, context, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server error as the client parses it off the wire.
    fn server_error(line: &str) -> RedisError {
        match redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
            Ok(redis::Value::ServerError(e)) => e.into(),
            other => panic!("not a server error: {other:?}"),
        }
    }

    fn recovery(e: RedisError) -> Recovery {
        Error::redis("test", e).recovery()
    }

    #[test]
    fn each_server_error_and_lost_connection_has_its_next_step() {
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(recovery(reset.into()), Recovery::Reconnect);
        let timed_out = std::io::Error::from(std::io::ErrorKind::TimedOut);
        assert_eq!(recovery(timed_out.into()), Recovery::Reconnect);
        for (reply, next) in [
            ("LOADING loading the dataset", Recovery::Retry),
            ("BUSY a script is running", Recovery::Retry),
            ("NOGROUP no such group", Recovery::Fatal),
            ("READONLY a replica", Recovery::Fatal),
            ("WRONGTYPE not a stream", Recovery::Fatal),
            ("NOPERM no permission", Recovery::Fatal),
        ] {
            assert_eq!(recovery(server_error(reply)), next, "{reply}");
        }
    }
}
