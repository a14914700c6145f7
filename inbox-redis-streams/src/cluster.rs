//! The key rule on a Redis Cluster: a stream and its dead-letter stream in one hash slot.
//!
//! The dead-letter script writes the dead-letter stream and acks the stream in one `EVAL`, and a
//! cluster runs a script only when all its keys hash to one slot (else `CROSSSLOT`). A key's
//! slot is CRC16 of its hash tag (the text between the first `{` and the next `}`, when not
//! empty) or of the whole key, modulo 16384.

use crate::{Error, Result};

/// The number of hash slots of a Redis Cluster.
const SLOTS: u16 = 16384;

/// The hash slot of `key`, as Redis Cluster computes it.
pub(crate) fn slot(key: &str) -> u16 {
    crc16(hash_tag(key).unwrap_or(key).as_bytes()) % SLOTS
}

/// The part of `key` that is hashed, when it has a hash tag: `orders` for `{orders}:dlq`.
fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

/// The default dead-letter stream on a cluster: `<stream>:dlq` when the stream has a hash tag
/// (`{orders}` → `{orders}:dlq`), else `{<stream>}:dlq` (`orders` → `{orders}:dlq`), whose tag
/// hashes to the stream's own slot.
pub(crate) fn dead_letter_stream(stream: &str) -> String {
    if hash_tag(stream).is_some() {
        format!("{stream}:dlq")
    } else {
        format!("{{{stream}}}:dlq")
    }
}

/// Refuses a dead-letter stream outside the stream's slot, naming both slots and the fix.
pub(crate) fn check_same_slot(stream: &str, dead_letter_stream: &str) -> Result<()> {
    let (a, b) = (slot(stream), slot(dead_letter_stream));
    if a == b {
        return Ok(());
    }
    Err(Error::Config(format!(
        "on a Redis Cluster the dead-letter stream must share the stream's hash slot (one script \
         writes both): `{stream}` is in slot {a}, `{dead_letter_stream}` in slot {b}; give both \
         one hash tag (`{{orders}}` and `{{orders}}:dlq`) or leave the dead-letter stream unset"
    )))
}

/// CRC-16/XMODEM (polynomial 0x1021, initial value 0), the checksum of Redis Cluster's slots.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_clusters() {
        // `CLUSTER KEYSLOT` on Redis 7.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("orders"), slot("{orders}:dlq"));
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        // An empty tag is no tag: the whole key is hashed.
        assert_eq!(slot("{}orders"), crc16(b"{}orders") % SLOTS);
        assert_eq!(hash_tag("a{b}c{d}"), Some("b"));
        assert_eq!(hash_tag("a{b"), None);
    }

    #[test]
    fn the_default_dead_letter_stream_shares_the_slot() {
        for stream in ["orders", "{orders}", "inbox:{x}:y", "a{b"] {
            let dlq = dead_letter_stream(stream);
            assert!(check_same_slot(stream, &dlq).is_ok(), "{stream} → {dlq}");
        }
        // Names whose braces make a tag of the wrapped name: the settings check refuses them.
        for stream in ["a}b{", "{}orders"] {
            let dlq = dead_letter_stream(stream);
            assert!(check_same_slot(stream, &dlq).is_err(), "{stream} → {dlq}");
        }
        assert_eq!(dead_letter_stream("orders"), "{orders}:dlq");
        assert_eq!(dead_letter_stream("{orders}"), "{orders}:dlq");
        let e = check_same_slot("orders", "orders:dlq").expect_err("two slots");
        assert!(e.to_string().contains("hash tag"), "{e}");
    }
}
