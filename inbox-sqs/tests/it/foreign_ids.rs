//! Messages published by Python's boto3, not by this crate's producer, their IDs read where the
//! producers' conventions put them: the `MessageDeduplicationId` of a FIFO queue, a message
//! attribute, a structured-mode CloudEvent (`id`, and `source` with `id`), the Debezium outbox
//! router's `id` (as an attribute) and a JSON field of the body. The scenario is
//! `inbox_conformance::foreign_ids`; the clients install on first use.

use inbox_conformance::foreign_ids::Convention;
use inbox_conformance::sqs::{Sqs, SqsFifo};

inbox_conformance::foreign_ids_suite!(SqsFifo;
    fifo_message_deduplication_id => Convention::message_id_property().fifo(),
);

inbox_conformance::foreign_ids_suite!(Sqs;
    a_message_attribute => Convention::event_id_header(),
    cloud_events_structured => Convention::cloud_events_structured(),
    cloud_events_source_and_id => Convention::cloud_events_source_and_id(),
    debezium_outbox_id_attribute => Convention::debezium(),
    json_field_of_the_body => Convention::json_field(),
);
