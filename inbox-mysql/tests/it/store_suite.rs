//! The store suite (`inbox_conformance::store`) on `MySqlInbox`, in each key mode, against the
//! MariaDB or MySQL server of `INBOX_MYSQL_URL` (`cargo xtask services` starts one).

use inbox_conformance::mysql_wallet::keyed;
use inbox_mysql::KeyMode;

inbox_conformance::store_suite!(text_keys, keyed(KeyMode::Text));
inbox_conformance::store_suite!(uuid_keys, keyed(KeyMode::Uuid));
inbox_conformance::store_suite!(hashed_keys, keyed(KeyMode::Hashed));
