//! SQS: a standard queue with a 5 s visibility timeout; a1/a2 delete on receive.

use std::time::Duration;

use inbox_core::{async_trait, BoxError, MessageId, StatsSnapshot};
use inbox_sqs::aws_sdk_sqs::types::QueueAttributeName;
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_sqs::{AckMode, SqsProducer, SqsSource};
use inbox_testkit::TestDb;

use super::{Broker, Outgoing};
use crate::cli::{BrokerKind, ConsumerSpec};
use crate::consume::{self, Shutdown, Watch};

/// The local SQS endpoint (moto) used when the environment names none.
const LOCAL_ENDPOINT: &str = "http://127.0.0.1:4566";
const VISIBILITY: Duration = Duration::from_secs(5);

pub(crate) struct Sqs {
    client: Client,
}

impl Sqs {
    /// A client from the environment; the local endpoint, region us-east-1 and test
    /// credentials only where none are configured.
    pub(crate) async fn connect() -> Result<Self, BoxError> {
        let client = inbox_sqs::connect_or_local(LOCAL_ENDPOINT).await;
        client
            .list_queues()
            .max_results(1)
            .send()
            .await
            .map_err(|e| format!("cannot reach SQS: {e:?}; run `cargo xtask services` or set AWS_ENDPOINT_URL_SQS"))?;
        Ok(Self { client })
    }

    async fn url(&self, name: &str) -> Result<String, BoxError> {
        let out = self.client.get_queue_url().queue_name(name).send().await?;
        Ok(out.queue_url().unwrap_or_default().to_owned())
    }
}

#[async_trait]
impl Broker for Sqs {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Sqs
    }

    async fn create(&self, name: &str) -> Result<(), BoxError> {
        for queue in [name.to_owned(), format!("{name}-dlq")] {
            self.client
                .create_queue()
                .queue_name(queue)
                .attributes(
                    QueueAttributeName::VisibilityTimeout,
                    VISIBILITY.as_secs().to_string(),
                )
                .send()
                .await?;
        }
        Ok(())
    }

    async fn publish(&self, name: &str, events: &[Outgoing]) -> Result<(), BoxError> {
        let producer = SqsProducer::builder()
            .client(self.client.clone())
            .connect()
            .await?;
        let mut batch = Vec::with_capacity(events.len());
        for event in events {
            let body = String::from_utf8(event.payload.clone())?;
            batch.push(inbox_sqs::Outgoing::with_id(
                MessageId::new(event.id.clone())?,
                body,
            ));
        }
        Ok(producer.send_messages(name, &batch).await?)
    }

    async fn consume(
        &self,
        spec: &ConsumerSpec,
        db: &TestDb,
        watch: Watch,
        shutdown: Shutdown,
    ) -> Result<StatsSnapshot, BoxError> {
        let mut builder = SqsSource::builder(self.url(&spec.name).await?)
            .client(self.client.clone())
            .dead_letter_queue(self.url(&format!("{}-dlq", spec.name)).await?)
            .poll_timeout(Duration::from_secs(1))
            .max_messages(spec.variant.batch().clamp(1, 10))
            // Off in the zombie test: the stalled handler loses its message when the
            // visibility timeout runs out.
            .heartbeat(!spec.zombie);
        if spec.variant.auto_ack() {
            builder = builder.ack_mode(AckMode::DeleteOnReceive);
        }
        let source = builder.connect().await?;
        crate::ready();
        Ok(consume::run(source, spec, db, watch, shutdown).await?)
    }

    async fn left(&self, name: &str) -> Result<Option<u64>, BoxError> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(self.url(name).await?)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await?;
        let get = |name: QueueAttributeName| {
            out.attributes()
                .and_then(|a| a.get(&name))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Ok(Some(
            get(QueueAttributeName::ApproximateNumberOfMessages)
                + get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        ))
    }

    fn redelivery_delay(&self) -> Duration {
        VISIBILITY + Duration::from_secs(3)
    }

    async fn remove(&self, name: &str) {
        for queue in [name.to_owned(), format!("{name}-dlq")] {
            if let Ok(url) = self.url(&queue).await {
                let _ = self.client.delete_queue().queue_url(url).send().await;
            }
        }
    }
}
