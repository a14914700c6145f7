//! The conformance suite (`inbox-conformance`) on a real SQS endpoint.

inbox_conformance::suite!(inbox_conformance::sqs::Sqs);
