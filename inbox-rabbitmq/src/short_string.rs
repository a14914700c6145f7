//! AMQP strings: short ones (at most 255 bytes: queue names, routing keys, consumer tags,
//! header names and the `message_id` property) and long ones (header and argument values).

use lapin::types::{AMQPValue, LongString, ShortString};

use crate::{Error, Result};

/// `value` as a short string, or [`Error::TooLong`] naming `what` it is: lapin panics on a
/// longer one converted with `From`.
pub(crate) fn short_string(what: &'static str, value: &str) -> Result<ShortString> {
    ShortString::try_new(value).map_err(|_| Error::TooLong {
        what,
        value: shown(value),
        len: value.len(),
    })
}

/// `value` as a long-string header or argument value.
pub(crate) fn long_string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.to_owned()))
}

/// The start of a long value, enough to recognise it in an error message.
fn shown(value: &str) -> String {
    const SHOWN: usize = 64;
    match value.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}…", &value[..end]),
        None => value.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn at_most_255_bytes() {
        assert_eq!(short_string("queue", "orders").unwrap().as_str(), "orders");
        assert!(short_string("queue", &"q".repeat(255)).is_ok());
        let too_long = short_string("message ID", &"é".repeat(128)).unwrap_err();
        assert_eq!(too_long.recovery(), inbox_core::Recovery::Fatal);
        let text = too_long.to_string();
        assert!(text.starts_with("message ID `éééé"), "{text}");
        assert!(text.contains("…` is 256 bytes"), "{text}");
    }
}
