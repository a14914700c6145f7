//! What the source checks or creates at connect: the queue and its dead-letter queue.
// A failed step should fail the test loudly, with its error.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;
use inbox_core::Recovery;
use inbox_rabbitmq::lapin::options::QueueDeleteOptions;
use inbox_rabbitmq::Topology;

async fn dead_letter_queue_exists(queue: &str) -> bool {
    let (_connection, channel) = admin_channel().await;
    passive_declare(&channel, queue).await.is_ok()
}

#[tokio::test]
async fn a_missing_dead_letter_queue_fails_the_connect_with_its_name_and_the_fix() {
    let config = fresh_config("nodlq").topology(Topology::Expect);
    // The operator declared the queue but its dead-letter queue is gone.
    config.declare_topology().await.unwrap();
    let (_connection, channel) = admin_channel().await;
    channel
        .queue_delete(
            config.dead_letter_queue().into(),
            QueueDeleteOptions::default(),
        )
        .await
        .unwrap();

    let error = config.clone().connect().await.unwrap_err();
    let text = error.to_string();
    println!("missing DLQ, Topology::Expect: {text}");
    assert_eq!(error.recovery(), Recovery::Fatal);
    assert!(
        text.contains(&format!("`{}`", config.dead_letter_queue())),
        "{text}"
    );
    assert!(text.contains("does not exist"), "{text}");
    assert!(text.contains("declare_topology"), "{text}");

    // A source that may declare creates it.
    let declaring = config.clone().topology(Topology::Declare);
    declaring.connect().await.unwrap().close().await;
    assert!(dead_letter_queue_exists(&config.dead_letter_queue()).await);
    cleanup(&config).await;
}

#[tokio::test]
async fn a_missing_queue_fails_the_connect_with_its_name_and_the_fix() {
    let config = fresh_config("noqueue").topology(Topology::Expect);
    let error = config.clone().connect().await.unwrap_err();
    let text = error.to_string();
    println!("missing queue, Topology::Expect: {text}");
    assert_eq!(error.recovery(), Recovery::Fatal);
    assert!(text.contains(&format!("`{}`", config.queue())), "{text}");
    assert!(text.contains("does not exist"), "{text}");
    cleanup(&config).await;
}
