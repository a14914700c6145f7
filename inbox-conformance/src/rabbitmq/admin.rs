//! A look at the broker from outside the adapter: queues' contents, taking messages off, deleting
//! queues, closing a client's connection as an operator would.

use std::time::Duration;

use inbox_rabbitmq::lapin::options::{
    BasicAckOptions, BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use inbox_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use inbox_rabbitmq::lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Queue};
use inbox_rabbitmq::RabbitSourceBuilder;

use super::amqp_url;

/// A plain lapin channel for inspecting queues.
pub async fn admin_channel() -> (Connection, Channel) {
    // lapin's `tokio` feature: its I/O runs on this test's runtime.
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("admin connection");
    let channel = connection.create_channel().await.expect("admin channel");
    (connection, channel)
}

/// Messages ready in `queue` now: neither delivered nor in flight to a consumer.
pub(super) async fn ready_on(queue: &str) -> u32 {
    passive_declare(&admin_channel().await.1, queue)
        .await
        .expect("passive declare")
        .message_count()
}

/// Messages in `queue` once no consumer holds any (waits for closed consumers to go away,
/// so their unacked deliveries are counted too). A dropped source closes its connection in
/// the background; on a loaded machine the broker has been seen to list it for over 10 s.
pub async fn left_on(queue: &str) -> u32 {
    let (_connection, channel) = admin_channel().await;
    for _ in 0..300 {
        let q = passive_declare(&channel, queue)
            .await
            .expect("passive declare");
        if q.consumer_count() == 0 {
            return q.message_count();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("queue {queue} still has consumers after 30 s");
}

/// `queue` as the broker reports it (its messages and consumers), without declaring it; an
/// error where no such queue exists.
pub async fn passive_declare(
    channel: &Channel,
    queue: &str,
) -> Result<Queue, inbox_rabbitmq::lapin::Error> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
}

/// A dead-lettered message as read back from the DLQ.
#[derive(Debug)]
pub struct Parked {
    /// The message body.
    pub body: Vec<u8>,
    /// Its properties, headers included.
    pub properties: BasicProperties,
}

impl Parked {
    /// The header `name`, as text.
    pub fn header(&self, name: &str) -> Option<String> {
        let headers = self.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            other => Some(format!("{other:?}")),
        }
    }

    /// The `message_id` property.
    pub fn message_id(&self) -> Option<String> {
        self.properties.message_id().as_ref().map(|s| s.to_string())
    }
}

/// Takes (and acks) every message in `queue`.
pub async fn drain(queue: &str) -> Vec<Parked> {
    let (_connection, channel) = admin_channel().await;
    let mut out = Vec::new();
    while let Some(got) = channel
        .basic_get(queue.into(), BasicGetOptions::default())
        .await
        .expect("basic.get")
    {
        let delivery = got.delivery;
        delivery.ack(BasicAckOptions::default()).await.expect("ack");
        out.push(Parked {
            body: delivery.data,
            properties: delivery.properties,
        });
    }
    out
}

/// Deletes the queue of `config` and its DLQ.
pub async fn cleanup(config: &RabbitSourceBuilder) {
    let (_connection, channel) = admin_channel().await;
    let delay_queues = (0..8).map(|n| format!("{}.delay.{n}", config.queue()));
    for queue in [config.queue().to_owned(), config.dead_letter_queue()]
        .into_iter()
        .chain(delay_queues)
    {
        let _ = channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
    }
}

/// The Erlang pid of the broker connection whose client-provided name is `name`, from
/// `rabbitmqctl list_connections`.
pub async fn connection_pids(name: &str) -> Vec<String> {
    let list = [
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    ];
    let output = rabbitmqctl(&list).await;
    let listing = String::from_utf8_lossy(&output.stdout);
    // rabbitmqctl prints the property as `{"connection_name","NAME"}` (older releases as
    // `{<<"connection_name">>,longstr,<<"NAME">>}`).
    let needles = [
        format!("\"connection_name\",\"{name}\""),
        format!("<<\"{name}\">>"),
    ];
    let pids: Vec<String> = listing
        .lines()
        .filter(|line| needles.iter().any(|n| line.contains(n.as_str())))
        .filter_map(|line| line.split('\t').next())
        .map(str::to_owned)
        .collect();
    assert!(
        !pids.is_empty(),
        "no connection named {name:?} in rabbitmqctl list_connections:\n{listing}"
    );
    pids
}

/// Closes broker connections by pid, as an operator or a network failure would
/// (`rabbitmqctl close_connection`).
pub async fn close_pids(pids: &[String]) {
    for pid in pids {
        rabbitmqctl(&["close_connection", pid, "inbox test: connection loss"]).await;
    }
}

/// Closes the broker connection whose client-provided name is `name`.
pub async fn close_connection(name: &str) {
    close_pids(&connection_pids(name).await).await;
}

/// `rabbitmqctl` with `args`, once it succeeded: its output.
///
/// # Panics
/// When it cannot be run, does not return within 60 s, or fails.
pub(super) async fn rabbitmqctl(args: &[&str]) -> std::process::Output {
    let line = args.join(" ");
    let run = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap_or_else(|_| panic!("rabbitmqctl {line} did not return within 60 s"))
        .unwrap_or_else(|e| panic!("run rabbitmqctl {line}: {e}"));
    crate::child::succeeded(&output, &format!("rabbitmqctl {line}"));
    output
}
