//! Messages published by Python's pika, not by this crate's producer, their IDs read where the
//! producers' conventions put them: the AMQP `message_id` property, CloudEvents binary mode
//! (`cloudEvents:id` or `cloudEvents_id` header) and structured mode
//! (`application/cloudevents+json`), the CloudEvents identity (`source` and `id`, in either
//! mode), the Debezium outbox router's `id` header, a JSON field of the body. The scenario is
//! `inbox_conformance::foreign_ids`; the clients install on first use.

use inbox_conformance::foreign_ids::Convention;

inbox_conformance::foreign_ids_suite!(inbox_conformance::rabbitmq::RabbitMq::default();
    amqp_message_id_property => Convention::message_id_property(),
    cloud_events_binary_cloud_events_colon_id => Convention::cloud_events_binary("cloudEvents:"),
    cloud_events_binary_cloud_events_underscore_id => Convention::cloud_events_binary("cloudEvents_"),
    cloud_events_binary_source_and_id => Convention::cloud_events_binary("cloudEvents:").source_and_id(),
    cloud_events_structured => Convention::cloud_events_structured(),
    cloud_events_source_and_id => Convention::cloud_events_source_and_id(),
    debezium_outbox_id_header => Convention::debezium(),
    json_field_of_the_body => Convention::json_field(),
);
