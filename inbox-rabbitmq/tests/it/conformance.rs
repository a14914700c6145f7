//! The conformance suite (`inbox-conformance`) on a real RabbitMQ quorum queue.

inbox_conformance::suite!(inbox_conformance::rabbitmq::RabbitMq::default());
