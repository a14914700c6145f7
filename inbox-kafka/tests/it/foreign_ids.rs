//! Records published by Python's confluent-kafka, not by this crate's producer, their IDs read
//! where the producers' conventions put them: CloudEvents binary mode (`ce_id` header) and
//! structured mode (`application/cloudevents+json`), the CloudEvents identity (`source` and
//! `id`, in either mode), the Debezium outbox router's `id` header, a JSON field of the value,
//! a plain header. The scenario is `inbox_conformance::foreign_ids`; the clients install on
//! first use.

use inbox_conformance::foreign_ids::Convention;

inbox_conformance::foreign_ids_suite!(inbox_conformance::kafka::Kafka::default();
    cloud_events_binary_ce_id => Convention::cloud_events_binary("ce_"),
    cloud_events_structured => Convention::cloud_events_structured(),
    cloud_events_source_and_id => Convention::cloud_events_source_and_id(),
    cloud_events_binary_ce_source_and_ce_id => Convention::cloud_events_binary("ce_").source_and_id(),
    debezium_outbox_id_header => Convention::debezium(),
    json_field_of_the_value => Convention::json_field(),
    a_plain_header => Convention::event_id_header(),
);
