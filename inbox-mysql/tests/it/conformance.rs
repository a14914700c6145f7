//! The adapter conformance suite on the MySQL store: every scenario of `inbox-conformance` run
//! against Redis Streams, with the inbox and the wallet in a MySQL database of each test's own.
//! The outbox relay's scenarios are PostgreSQL's and say so as they skip.

inbox_conformance::suite!(
    inbox_conformance::redis::Redis,
    inbox_conformance::store::MySqlDb
);
