//! What the SQS adapter decides on its own that the simulated SQS needs: the deduplication ID
//! of a send, and the header its dead-letter reader puts on a letter for a replay
//! (`inbox_sqs::delivery`).

pub(crate) use inbox_sqs::delivery::{replay_header, send_dedup_id as deduplication_id};
