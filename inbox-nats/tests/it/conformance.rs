//! The conformance suite (`inbox-conformance`) on a real NATS JetStream stream.

inbox_conformance::suite!(inbox_conformance::nats::Nats);
