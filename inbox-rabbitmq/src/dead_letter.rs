//! Publishing dead letters: on a connection of their own, each publish bounded by a timeout.

use std::fmt;
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::{BasicProperties, Channel, Connection};

use crate::producer::publish_confirmed;
use crate::{connect, Error, RabbitSourceBuilder, Result};

/// The dead-letter publisher of one [`RabbitSource`](crate::RabbitSource).
///
/// Its own connection, because RabbitMQ blocks a whole connection once it publishes during a
/// memory or disk alarm: on the consuming connection the acks would stop too. Opened at the
/// first dead letter and reopened when lost.
pub(crate) struct DeadLetters {
    url: String,
    name: String,
    timeout: Duration,
    heartbeat: Option<u16>,
    open: Option<(Connection, Channel)>,
}

impl fmt::Debug for DeadLetters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetters")
            .field("name", &self.name)
            .field("timeout", &self.timeout)
            .field("connected", &self.open.is_some())
            .finish_non_exhaustive()
    }
}

impl DeadLetters {
    pub(crate) fn new(config: &RabbitSourceBuilder) -> Self {
        Self {
            url: config.url.clone(),
            name: format!("{} dead letters", config.effective_connection_name()),
            timeout: config.operation_timeout,
            heartbeat: config.heartbeat_secs(),
            open: None,
        }
    }

    /// Publishes to `queue` through the default exchange and waits for the confirm, for at most
    /// the timeout: a broker that cannot store it (an alarm) must not stall the consumer.
    pub(crate) async fn publish(
        &mut self,
        queue: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<()> {
        let timeout = self.timeout;
        let published = async {
            let channel = self.channel().await?;
            publish_confirmed(&channel, "", queue, payload, properties).await
        };
        match tokio::time::timeout(timeout, published).await {
            Ok(result) => result,
            // The connection stays: a late confirm is dropped, and the next publish waits anew.
            Err(_elapsed) => Err(Error::ConfirmTimeout {
                routing_key: queue.to_owned(),
                waited: timeout,
            }),
        }
    }

    async fn channel(&mut self) -> Result<Channel> {
        if let Some((_, channel)) = &self.open {
            if channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        // Dropping the last handle closes a lost connection in the background.
        self.open = None;
        let connection = connect::open(&self.url, &self.name, self.heartbeat).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| Error::amqp("opening the dead-letter channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| Error::amqp("enabling publisher confirms", e))?;
        self.open = Some((connection, channel.clone()));
        Ok(channel)
    }

    pub(crate) async fn close(self) {
        if let Some((connection, _)) = self.open {
            let _ = connection.close(200, "consumer closed".into()).await;
        }
    }
}
