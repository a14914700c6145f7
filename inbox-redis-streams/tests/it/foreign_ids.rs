//! Entries added by Python's redis-py, not by this crate's producer, their IDs read where the
//! producers' conventions put them: an entry field, a structured-mode CloudEvent in the payload
//! (`id`, and `source` with `id`), the Debezium outbox router's `id` (as a field) and a JSON
//! field of the payload. The scenario is `inbox_conformance::foreign_ids`; the clients install
//! on first use.

use inbox_conformance::foreign_ids::Convention;

inbox_conformance::foreign_ids_suite!(inbox_conformance::redis::Redis;
    an_entry_field => Convention::event_id_header(),
    cloud_events_structured => Convention::cloud_events_structured(),
    cloud_events_source_and_id => Convention::cloud_events_source_and_id(),
    debezium_outbox_id_field => Convention::debezium(),
    json_field_of_the_payload => Convention::json_field(),
);
