//! The conformance suite (`inbox-conformance`) on a real Kafka-protocol broker.

use crate::common;

inbox_conformance::suite!({
    common::init_tracing();
    inbox_conformance::kafka::Kafka::default()
});
