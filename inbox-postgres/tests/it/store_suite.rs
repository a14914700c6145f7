//! The store suite (`inbox_conformance::store`) on `PgInbox`, in each key mode; `cargo xtask
//! test` runs it again on the partitioned layout.

use inbox_conformance::TestDb;
use inbox_postgres::KeyMode;

inbox_conformance::store_suite!(text_keys, TestDb::keyed(KeyMode::Text));
inbox_conformance::store_suite!(uuid_keys, TestDb::keyed(KeyMode::Uuid));
inbox_conformance::store_suite!(hashed_keys, TestDb::keyed(KeyMode::Hashed));
