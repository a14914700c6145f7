//! This crate's errors, each mapped to what the consumer loop does next.

use inbox_core::{Recovery, SourceError};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};

/// An error from the RabbitMQ adapter or its publisher.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration cannot work (empty queue name, prefetch of 0, …).
    #[error("invalid RabbitMQ configuration: {0}")]
    Config(String),
    /// A call to the broker failed.
    #[error("RabbitMQ {context}: {source}")]
    Amqp {
        /// What was being done.
        context: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// The broker answered a publish with `basic.nack`: it could not store the message.
    #[error("RabbitMQ refused to store the message published to `{routing_key}` (basic.nack); publish it again")]
    Nacked {
        /// Where it was published.
        routing_key: String,
    },
    /// A mandatory publish found no queue: the topology is missing.
    #[error("no queue is bound to routing key `{routing_key}` on exchange `{exchange}`; declare the topology first (RabbitSource::builder(queue).declare_topology())")]
    Unroutable {
        /// The exchange published to (`""` is the default exchange).
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// The broker did not confirm a publish (a message, a dead letter, a delayed copy) within
    /// [`operation_timeout`](crate::RabbitConnection::operation_timeout). The unconfirmed copy
    /// may still arrive, so a copy published again can be stored twice.
    #[error("RabbitMQ did not confirm the message published to `{routing_key}` within {waited:?} (a memory or disk alarm blocks publishers: see `rabbitmq-diagnostics alarms`; or the broker stopped answering); it may still arrive, so publish it again with the same ID")]
    ConfirmTimeout {
        /// Where it was published.
        routing_key: String,
        /// How long the publish waited.
        waited: std::time::Duration,
    },
    /// Connecting took longer than
    /// [`operation_timeout`](crate::RabbitConnection::operation_timeout); the consumer tries
    /// again after its backoff, a producer on its next send.
    #[error("RabbitMQ at {url} did not complete the connection (handshake, channel and, for a consumer, topology and consume) within {waited:?}; the broker hangs or the network drops packets")]
    ConnectTimeout {
        /// The broker address, without its password.
        url: String,
        /// How long the attempt waited.
        waited: std::time::Duration,
    },
    /// A queue the source needs does not exist, and [`Topology::Expect`](crate::Topology::Expect)
    /// does not create it.
    #[error("{role} `{queue}` does not exist on the broker; declare it (RabbitSource::builder(queue).declare_topology() does, and so does a source with Topology::Declare) or fix the queue name")]
    MissingQueue {
        /// `queue` or `dead-letter queue`.
        role: &'static str,
        /// Its name.
        queue: String,
    },
    /// A name or ID does not fit the 255 bytes of an AMQP short string: a queue name, routing
    /// key, consumer tag, header name or `message_id`.
    #[error("{what} `{value}` is {len} bytes, and AMQP carries at most 255 there; shorten it")]
    TooLong {
        /// What it is (`message ID`, `routing key`, …).
        what: &'static str,
        /// Its first 64 characters.
        value: String,
        /// Its length in bytes.
        len: usize,
    },
    /// An ack or nack could not be sent because its channel is closed. The broker hands the
    /// delivery out again (flagged `redelivered`); the inbox skips the copy if it was applied.
    #[error("the channel of delivery {position} closed before its {action} was sent; the broker redelivers it")]
    ChannelClosed {
        /// `ack` or `nack`.
        action: &'static str,
        /// The delivery's position (connection, channel, tag).
        position: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn amqp(context: impl Into<String>, source: lapin::Error) -> Self {
        Self::Amqp {
            context: context.into(),
            source,
        }
    }

    /// What the consumer does next: reconnect after a lost connection or channel, stop on a
    /// configuration or permission problem.
    pub fn recovery(&self) -> Recovery {
        match self {
            Error::Config(_)
            | Error::Unroutable { .. }
            | Error::MissingQueue { .. }
            | Error::TooLong { .. } => Recovery::Fatal,
            Error::Nacked { .. } | Error::ConfirmTimeout { .. } => Recovery::Retry,
            Error::ChannelClosed { .. } | Error::ConnectTimeout { .. } => Recovery::Reconnect,
            Error::Amqp { source, .. } => lapin_recovery(source),
        }
    }
}

/// Soft errors about the topology or permissions will not fix themselves; everything about a
/// lost socket, channel or connection is cured by reconnecting.
fn lapin_recovery(e: &lapin::Error) -> Recovery {
    use lapin::ErrorKind as K;
    match e.kind() {
        K::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(
                AMQPSoftError::ACCESSREFUSED
                | AMQPSoftError::NOTFOUND
                | AMQPSoftError::PRECONDITIONFAILED,
            ) => Recovery::Fatal,
            AMQPErrorKind::Soft(_) => Recovery::Reconnect,
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED | AMQPHardError::NOTIMPLEMENTED) => {
                Recovery::Fatal
            }
            AMQPErrorKind::Hard(_) => Recovery::Reconnect,
        },
        // A runtime shutting down under the I/O was an `IOError` before lapin 4.
        K::IOError(_)
        | K::RuntimeShutdownError(_)
        | K::InvalidChannel(_)
        | K::InvalidChannelState(..)
        | K::InvalidConnectionState(_)
        | K::MissingHeartbeatError
        | K::ChannelsLimitReached => Recovery::Reconnect,
        _ => Recovery::Fatal,
    }
}

impl From<Error> for SourceError {
    fn from(e: Error) -> Self {
        let recovery = e.recovery();
        let context = match &e {
            Error::Config(_) | Error::MissingQueue { .. } | Error::TooLong { .. } => {
                "configuring the RabbitMQ source"
            }
            Error::Amqp { .. } => "talking to RabbitMQ",
            Error::ConnectTimeout { .. } => "connecting to RabbitMQ",
            Error::Nacked { .. } | Error::Unroutable { .. } | Error::ConfirmTimeout { .. } => {
                "publishing to RabbitMQ"
            }
            Error::ChannelClosed { .. } => "acknowledging to RabbitMQ",
        };
        SourceError::new(recovery, context, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_channels_reconnect_and_config_errors_are_fatal() {
        let closed = Error::ChannelClosed {
            action: "ack",
            position: "connection 1 channel 1 tag 7".into(),
        };
        assert_eq!(closed.recovery(), Recovery::Reconnect);
        assert_eq!(SourceError::from(closed).recovery(), Recovery::Reconnect);
        assert_eq!(Error::Config("x".into()).recovery(), Recovery::Fatal);
        let timeout = Error::ConfirmTimeout {
            routing_key: "q.dlq".into(),
            waited: std::time::Duration::from_secs(10),
        };
        assert_eq!(SourceError::from(timeout).recovery(), Recovery::Retry);
        let hung = Error::ConnectTimeout {
            url: "amqp://guest:***@127.0.0.1:5672/%2f".into(),
            waited: std::time::Duration::from_secs(10),
        };
        assert_eq!(SourceError::from(hung).recovery(), Recovery::Reconnect);
    }
}
