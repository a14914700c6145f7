//! The store suite (`inbox_conformance::store`) on `MySqlInbox`, in each key mode, against the
//! MariaDB or MySQL server of `INBOX_MYSQL_URL` (`cargo xtask services` starts one).

use inbox_conformance::store::MySql;
use inbox_mysql::KeyMode;

inbox_conformance::store_suite!(text_keys, MySql::new(KeyMode::Text));
inbox_conformance::store_suite!(uuid_keys, MySql::new(KeyMode::Uuid));
inbox_conformance::store_suite!(hashed_keys, MySql::new(KeyMode::Hashed));
