//! The suite on SQS (feature `sqs`): [`Sqs`] gives each scenario a standard queue of its own and
//! a dead-letter queue that the source parks messages in.
//!
//! The endpoint is `AWS_ENDPOINT_URL_SQS` (default [`LOCAL_ENDPOINT`], moto), with dummy
//! credentials where none are configured.

mod endpoint;
mod queues;

pub use endpoint::{
    client, proxied_client, proxy, ATTEMPT_TIMEOUT, LOCAL_ENDPOINT, OPERATION_TIMEOUT,
};
pub use queues::{attr, create_queue, delete_queue, drain, queue, queue_name};

use std::sync::Arc;
use std::time::Duration;

use inbox_core::DynPublish;
use inbox_sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use inbox_sqs::aws_sdk_sqs::Client;
use inbox_sqs::{SqsConnection, SqsSource, SqsSourceBuilder, DEFAULT_ID_ATTRIBUTE};

use crate::{LosingSource, Proxied, Restartable, TestBroker, TestQueue};

/// SQS under test, with the suite's timings: a 2 s visibility timeout, and receives that wait
/// 1 s longer than it.
#[derive(Debug, Clone, Copy)]
pub struct Sqs;

/// The queues' visibility timeout, in whole seconds: a message a consumer died holding is
/// visible again after this.
const VISIBILITY_SECS: u32 = 2;
const VISIBILITY: Duration = Duration::from_secs(VISIBILITY_SECS as u64);

/// How long a receive waits for a message. A restarted consumer then goes idle only after what
/// its crashed predecessor held is visible again: a committed but undeleted message comes back
/// to it (and is skipped) even when the others were applied first. One second more than the
/// visibility timeout because moto's long poll looks for visible messages once a second.
const WAIT: Duration = Duration::from_secs(VISIBILITY_SECS as u64 + 1);

/// A standard queue of its own and its dead-letter queue (the source's `dead_letter_queue`).
#[derive(Debug)]
pub struct Queue {
    sqs: Client,
    url: String,
    dlq: String,
}

impl TestBroker for Sqs {
    type Queue = Queue;

    async fn queue(&self, scenario: &str) -> Queue {
        let sqs = client().await;
        let url = queue(&sqs, scenario, VISIBILITY_SECS).await;
        let dlq = queue(&sqs, &format!("{scenario}-dlq"), 30).await;
        Queue { sqs, url, dlq }
    }

    /// `name`: the queue's URL and its dead-letter queue's, separated by a space.
    async fn attach(&self, name: &str) -> Queue {
        let (url, dlq) = name.split_once(' ').expect("two queue URLs");
        Queue {
            sqs: client().await,
            url: url.to_owned(),
            dlq: dlq.to_owned(),
        }
    }
}

impl Queue {
    /// The settings of every source of this queue.
    fn builder(&self) -> SqsSourceBuilder {
        self.builder_on(self.sqs.clone()).poll_timeout(WAIT)
    }

    /// A source of this queue through `sqs`, parking its dead letters in the queue's.
    fn builder_on(&self, sqs: Client) -> SqsSourceBuilder {
        let connection = SqsConnection::new(sqs);
        connection.source(&self.url).dead_letter_queue(&self.dlq)
    }
}

/// The source of `builder`'s settings.
async fn connect(builder: SqsSourceBuilder) -> SqsSource {
    builder.connect().await.expect("source")
}

impl TestQueue for Queue {
    type Source = SqsSource;

    fn name(&self) -> String {
        format!("{} {}", self.url, self.dlq)
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        let mut request = self
            .sqs
            .send_message()
            .queue_url(&self.url)
            .message_body(String::from_utf8_lossy(payload));
        if let Some(id) = id {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(id)
                .build()
                .expect("ID attribute");
            request = request.message_attributes(DEFAULT_ID_ATTRIBUTE, value);
        }
        request.send().await.expect("send");
    }

    async fn source(&self, _member: &str) -> SqsSource {
        // SQS has no group members: every source shares the queue.
        connect(self.builder()).await
    }

    async fn losing_source(&self, _member: &str) -> Option<LosingSource<SqsSource>> {
        // With the heartbeat off, a message comes back after the visibility timeout, however
        // long its handler runs.
        Some(LosingSource {
            source: connect(self.builder().heartbeat(false)).await,
            stall: VISIBILITY + 2 * WAIT,
        })
    }

    async fn proxied_source(&self, _member: &str) -> Option<Proxied<SqsSource>> {
        // The proxy forwards bytes: it cannot stand between a client and an HTTPS endpoint.
        let proxy = proxy().await?;
        // A call on a silent connection fails after 2 s per attempt, 5 s in all; the long poll
        // is shorter than an attempt, as the source requires.
        let source = self.builder_on(proxied_client(&proxy).await);
        Some(Proxied {
            source: connect(source.poll_timeout(Duration::from_secs(1))).await,
            proxy,
            // Longer than a delete and then a receive can take to fail, and several visibility
            // timeouts: receives, deletes and heartbeat extensions all hang and time out.
            blackhole: Duration::from_secs(12),
            counts_faults: true,
        })
    }

    async fn restartable(&self) -> Result<Restartable<Queue>, String> {
        Err("moto keeps its queues in memory, so a restart would lose them".into())
    }

    fn redelivery_delay(&self) -> Duration {
        // moto looks for visible messages once a second; a receive may be waiting already.
        VISIBILITY + Duration::from_secs(3)
    }

    async fn producer(&self) -> Arc<dyn DynPublish> {
        Arc::new(
            SqsConnection::new(self.sqs.clone())
                .producer()
                .connect()
                .await
                .expect("producer"),
        )
    }

    fn destination(&self) -> String {
        self.url.clone()
    }

    async fn left(&self) -> u64 {
        let names = [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        ];
        let out = self
            .sqs
            .get_queue_attributes()
            .queue_url(&self.url)
            .set_attribute_names(Some(names.to_vec()))
            .send()
            .await
            .expect("get queue counts");
        names
            .iter()
            .filter_map(|name| out.attributes()?.get(name)?.parse::<u64>().ok())
            .sum()
    }

    async fn dead_letter_reader(&self) -> Option<Box<dyn inbox_core::replay::DynDeadLetters>> {
        let reader = SqsConnection::new(self.sqs.clone()).dead_letters(&self.dlq);
        crate::connected_reader(reader.connect().await)
    }

    async fn cleanup(&self) {
        delete_queue(&self.sqs, &self.url).await;
        delete_queue(&self.sqs, &self.dlq).await;
    }

    fn python_target(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({"broker": "sqs", "queue_url": self.url}))
    }

    async fn source_reading(&self, _member: &str, from: inbox_core::IdFrom) -> Option<SqsSource> {
        Some(connect(self.builder().id_from(from)).await)
    }
}

/// SQS with FIFO queues (content-based deduplication on, so a producer may leave out the
/// deduplication ID), as [`Sqs`] otherwise: for what only a FIFO queue has.
#[derive(Debug, Clone, Copy)]
pub struct SqsFifo;

impl TestBroker for SqsFifo {
    type Queue = Queue;

    async fn queue(&self, scenario: &str) -> Queue {
        let sqs = client().await;
        let fifo = [
            (QueueAttributeName::FifoQueue, "true"),
            (QueueAttributeName::ContentBasedDeduplication, "true"),
        ];
        let name = format!("{}.fifo", queue_name(scenario));
        let url = create_queue(&sqs, &name, VISIBILITY_SECS, &fifo).await;
        let dlq = queue(&sqs, &format!("{scenario}-dlq"), 30).await;
        Queue { sqs, url, dlq }
    }

    async fn attach(&self, name: &str) -> Queue {
        Sqs.attach(name).await
    }
}
