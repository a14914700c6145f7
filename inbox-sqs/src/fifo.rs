//! FIFO message group and deduplication IDs: what SQS accepts, and how other text is made to
//! fit.

/// Whether the queue at `url` is a FIFO queue: its name ends in `.fifo` (SQS requires it of a
/// FIFO queue, and refuses it on a standard one); a `/` after the name does not count. The one
/// rule for the source, the producer and the dead-letter copy, so that none sends a FIFO queue
/// a message without the group and deduplication IDs it refuses a send without.
pub(crate) fn is_fifo_queue(url: &str) -> bool {
    url.trim_end_matches('/').ends_with(".fifo")
}

/// SQS's longest group or deduplication ID.
const MAX_LEN: usize = 128;

/// Whether SQS accepts `text` as a `MessageGroupId` or `MessageDeduplicationId`: 1 to 128
/// characters, each an ASCII letter, digit or punctuation mark (``!"#$%&'()*+,-./:;<=>?@[\]^_`{|}~``).
pub(crate) fn is_valid_id(text: &str) -> bool {
    (1..=MAX_LEN).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation())
}

/// `text` itself where SQS accepts it as a group or deduplication ID, otherwise a stable
/// 32-digit hex hash of it (spaces, non-ASCII, too long, empty).
pub(crate) fn fifo_id(text: &str) -> String {
    if is_valid_id(text) {
        text.to_owned()
    } else {
        hash_hex(text.as_bytes())
    }
}

/// 32 hex digits of `bytes`: not cryptographic, only stable across processes and versions
/// (FNV-1a, twice with different seeds), which a deduplication ID needs.
pub(crate) fn hash_hex(bytes: &[u8]) -> String {
    let fnv = |seed: u64| {
        bytes.iter().fold(seed, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    format!(
        "{:016x}{:016x}",
        fnv(0xcbf2_9ce4_8422_2325),
        fnv(0x8422_2325_cbf2_9ce4)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_ids_are_kept_and_others_hashed_to_valid_ones() {
        let uuid = "0190d6a2-7c1e-7f3a-9b1e-3f2a1c4d5e6f";
        assert_eq!(fifo_id(uuid), uuid);
        assert_eq!(
            fifo_id("a!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
            "a!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
        );
        for odd in ["message 1", "évènement", "", &"x".repeat(129), "tab\there"] {
            let id = fifo_id(odd);
            assert!(is_valid_id(&id), "{odd:?} -> {id:?}");
            assert_eq!(id.len(), 32);
            assert_eq!(id, fifo_id(odd), "stable");
        }
        assert_ne!(fifo_id("évènement 1"), fifo_id("évènement 2"));
        assert!(is_valid_id(&"x".repeat(128)));
    }
}
