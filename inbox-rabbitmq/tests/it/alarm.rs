//! A broker resource alarm while a message is being dead-lettered. Alone in its test binary: the
//! alarm blocks every publisher on the broker, so no other test of this crate runs meanwhile.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::*;
use inbox_core::{Ack, MessageSource, Publish, Recovery};
use inbox_rabbitmq::RabbitConnection;

fn rabbitmqctl(args: &[&str]) -> String {
    let output = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("run rabbitmqctl");
    assert!(output.status.success(), "rabbitmqctl {args:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// A memory alarm on the broker, cleared (the watermark restored) when dropped, panics included.
struct MemoryAlarm {
    watermark: String,
}

impl MemoryAlarm {
    async fn raise() -> Self {
        let watermark = rabbitmqctl(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."]);
        let alarm = Self { watermark };
        rabbitmqctl(&["set_vm_memory_high_watermark", "0.0001"]);
        for _ in 0..100 {
            if rabbitmqctl(&["eval", "rabbit_alarm:get_alarms()."]).contains("memory") {
                return alarm;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the broker raised no memory alarm");
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let restore = format!(
            "vm_memory_monitor:set_vm_memory_high_watermark({}).",
            self.watermark
        );
        rabbitmqctl(&["eval", &restore]);
    }
}

/// The broker's state of the connection named `name`: `running`, `blocking` (during an alarm,
/// until it publishes), `blocked` (it published: the broker reads nothing more from it), ...
fn connection_state(name: &str) -> String {
    let listing = rabbitmqctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "state",
        "client_properties",
    ]);
    let needle = format!("\"connection_name\",\"{name}\"");
    let line = listing
        .lines()
        .find(|line| line.contains(&needle))
        .unwrap_or_else(|| panic!("no connection {name:?} in:\n{listing}"));
    line.split('\t').next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_dead_letter_during_a_memory_alarm_times_out_and_acks_keep_flowing() {
    let connection = RabbitConnection::new(amqp_url()).operation_timeout(Duration::from_secs(2));
    let config = fresh_config_on(&connection, "alarm");
    let publisher = publisher(&config).await;
    publisher.send(config.queue(), b"to park").await.unwrap();
    publisher.send(config.queue(), b"to ack").await.unwrap();
    publisher.close().await;
    let mut source = config.clone().connect().await.unwrap();
    let mut deliveries = Vec::new();
    while deliveries.len() < 2 {
        deliveries.extend(source.receive(2).await.unwrap());
    }
    let to_ack = deliveries.pop().unwrap();
    let to_park = deliveries.pop().unwrap();

    let alarm = MemoryAlarm::raise().await;
    let parked = tokio::time::timeout(
        Duration::from_secs(30),
        to_park
            .ack
            .dead_letter(&to_park.message, "test: parked during an alarm"),
    )
    .await;
    let consuming = connection_state(&config.effective_connection_name());
    let acked = tokio::time::timeout(Duration::from_secs(10), to_ack.ack.ack()).await;
    drop(alarm);
    println!(
        "during a memory alarm: dead-letter {parked:?}, consuming connection {consuming}, \
         ack {acked:?}"
    );

    let error = parked
        .expect("the dead-letter publish hung for 30 s")
        .expect_err("nothing can be stored during the alarm");
    assert_eq!(error.recovery(), Recovery::Retry, "{error}");
    // `blocking` means "blocked if it publishes": the broker still reads its acks.
    assert_ne!(consuming, "blocked", "the consuming connection was blocked");
    acked
        .expect("the ack hung for 10 s during the alarm")
        .unwrap();

    // Handed back by the failed dead letter, it is dead-lettered on a later attempt.
    let again = loop {
        if let Some(d) = source.receive(1).await.unwrap().pop() {
            break d;
        }
    };
    again
        .ack
        .dead_letter(&again.message, "test: parked after the alarm")
        .await
        .unwrap();
    source.close().await;
    let parked = drain(&config.dead_letter_queue()).await;
    assert!(!parked.is_empty() && parked.len() <= 2, "{}", parked.len());
    assert!(parked.iter().all(|p| p.body == b"to park"));
    assert_eq!(left_on(config.queue()).await, 0);
    cleanup(&config).await;
}
