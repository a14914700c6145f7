//! The conformance suite (`inbox-conformance`) on a real Redis stream.

inbox_conformance::suite!(inbox_conformance::redis::Redis);
