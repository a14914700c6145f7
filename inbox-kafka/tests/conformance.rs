//! The conformance suite (`inbox-conformance`) on a real Kafka-protocol broker.

mod common;

inbox_conformance::suite!({
    common::init_tracing();
    inbox_conformance::kafka::Kafka::default()
});
