//! A member of a topic's group whose receive waits for its partitions.

use std::time::{Duration, Instant};

use inbox_core::{Delivery, MessageSource, SourceError};
use inbox_kafka::rdkafka::consumer::Consumer as _;
use inbox_kafka::{KafkaAck, KafkaSource};

/// How long a member without partitions keeps polling before it reports an empty batch.
const ASSIGNMENT_WAIT: Duration = Duration::from_secs(15);

/// The adapter's source, except that a receive does not come back empty while the member owns
/// no partition: before its group join completes, or between a rebalance's revoke and assign.
/// On Tansu the join of a second member takes seconds, longer than a poll; without this the
/// member's `run_until_idle` returned before it was given a partition, and the other member
/// read both.
#[derive(Debug)]
pub struct Member(KafkaSource);

impl Member {
    /// Wraps `source`.
    pub fn new(source: KafkaSource) -> Self {
        Self(source)
    }

    /// The adapter's source.
    pub fn source(&self) -> &KafkaSource {
        &self.0
    }

    /// The partitions this member owns.
    fn assignment(&self) -> Vec<i32> {
        self.0.consumer().assignment().map_or_else(
            |_| Vec::new(),
            |list| list.elements().iter().map(|e| e.partition()).collect(),
        )
    }
}

impl MessageSource for Member {
    type Ack = KafkaAck;

    async fn receive(&mut self, max: usize) -> Result<Vec<Delivery<KafkaAck>>, SourceError> {
        let deadline = Instant::now() + ASSIGNMENT_WAIT;
        loop {
            let before = self.assignment();
            // Cancel safe: only the adapter's own (cancel-safe) receive is awaited.
            let batch = self.0.receive(max).await?;
            // Empty is idle only after a whole poll with the same partitions: one assigned
            // during the poll may not have been fetched yet.
            let settled = !before.is_empty() && before == self.assignment();
            if !batch.is_empty() || settled || Instant::now() > deadline {
                return Ok(batch);
            }
        }
    }

    inbox_testkit::forward_source!(0: redelivery_window, system, consumer_group, capabilities);
}
