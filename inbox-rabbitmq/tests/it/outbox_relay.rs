//! The outbox relay on RabbitMQ, where it differs from the other brokers: a queue that does not
//! exist stops it. (What every broker does, forwarding through the outbox, a lost confirm and two
//! relays at once, is in the conformance suite.)

#![allow(clippy::unwrap_used)] // a test fails loudly on the first surprise

use crate::common;

use common::*;
use inbox_conformance::outbox_table::{migrated, unsent};
use inbox_conformance::TestDb;
use inbox_core::Recovery;
use inbox_postgres::RelayError;
use inbox_rabbitmq::RabbitProducer;

#[tokio::test]
async fn a_queue_that_does_not_exist_stops_the_relay_and_leaves_the_rows_unsent() {
    let config = fresh_config("outbox-missing"); // never declared
    let db = TestDb::new().await;
    let outbox = migrated(&db).await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox.write(&mut tx, config.queue(), b"x").await.unwrap();
    tx.commit().await.unwrap();

    let publisher = RabbitProducer::builder().connect().await.unwrap();
    let error = outbox.relay(publisher).run_until_idle().await.unwrap_err();

    assert!(
        matches!(error, RelayError::Publish { row: 1, .. }),
        "{error}"
    );
    assert_eq!(error.recovery(), Recovery::Fatal);
    assert!(
        error.to_string().contains("declare the topology"),
        "{error}"
    );
    assert_eq!(unsent(&db).await, 1);
    db.drop().await;
}
