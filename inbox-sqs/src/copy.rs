//! A copy of a received message, sent to a dead-letter queue or back to its own queue (a
//! delayed redelivery), and the message attributes it carries.

use std::collections::HashMap;

use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::MessageAttributeValue;
use aws_sdk_sqs::Client;
use inbox_core::Message;
use tracing::warn;

use crate::delivery::SCHEDULE_ATTRIBUTES;
use crate::{fifo, Error};

/// SQS accepts at most this many message attributes per message.
const MAX_ATTRIBUTES: usize = 10;

/// Where a copy of a received message goes, and what it adds to it.
#[derive(Debug)]
pub(crate) struct Copy<'a> {
    pub(crate) queue_url: &'a str,
    /// The operation, for errors.
    pub(crate) operation: &'static str,
    /// Why original attributes may be cut, for the log.
    pub(crate) why: &'static str,
    /// The attributes the copy adds, in place of any of the same name; an empty value is left
    /// off (SQS refuses an empty String attribute).
    pub(crate) added: Vec<(&'static str, String)>,
    /// The `MessageDeduplicationId` on a FIFO queue; `None` on a standard one.
    pub(crate) fifo_dedup_id: Option<String>,
    pub(crate) delay_seconds: Option<i32>,
}

impl Copy<'_> {
    /// Sends the copy of `message`: its body, and the attributes it was received with
    /// (`original`, with their data types; else made from its headers) less the redelivery
    /// schedule's, plus the added ones. The ID always goes in `id_attribute`, the one the
    /// source reads, even when attributes must be cut or the ID came from the
    /// `MessageDeduplicationId` (a system attribute a send cannot copy): a dead letter
    /// replayed into the source, or a redelivered copy, keeps its ID.
    pub(crate) async fn send(
        self,
        client: &Client,
        id_attribute: &str,
        message: &Message,
        original: Option<&HashMap<String, MessageAttributeValue>>,
    ) -> Result<(), Error> {
        let mut attributes: Vec<(String, MessageAttributeValue)> = match original {
            Some(original) => original
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            None => message
                .headers
                .iter()
                .filter_map(|(name, value)| Some((name.clone(), attribute(name, value).ok()?)))
                .collect(),
        };
        let id = match attributes.iter().position(|(n, _)| n == id_attribute) {
            Some(i) => Some(attributes.swap_remove(i)),
            None => match &message.id {
                Ok(id) => Some((
                    id_attribute.to_owned(),
                    attribute(id_attribute, id.as_str())?,
                )),
                Err(_) => None,
            },
        };
        attributes.retain(|(name, _)| {
            !SCHEDULE_ATTRIBUTES.contains(&name.as_str())
                && !self.added.iter().any(|(added, _)| added == name)
        });
        // The last by name give way, and are logged, so nothing is dropped silently.
        attributes.sort_by(|a, b| a.0.cmp(&b.0));
        let room = MAX_ATTRIBUTES.saturating_sub(self.added.len() + usize::from(id.is_some()));
        if attributes.len() > room {
            let dropped: Vec<String> = attributes.drain(room..).map(|(name, _)| name).collect();
            warn!(
                queue_url = self.queue_url,
                ?dropped,
                "SQS allows 10 message attributes; dropped these to {}",
                self.why
            );
        }
        attributes.extend(id);
        for (name, value) in &self.added {
            if !value.is_empty() {
                attributes.push(((*name).to_owned(), attribute(name, value)?));
            }
        }

        let mut request = client
            .send_message()
            .queue_url(self.queue_url)
            .message_body(String::from_utf8_lossy(&message.payload))
            .set_message_attributes(Some(attributes.into_iter().collect()))
            .set_delay_seconds(self.delay_seconds);
        if let Some(dedup_id) = self.fifo_dedup_id {
            // A FIFO queue needs a group: the original's, so its order survives.
            request = request
                .message_group_id(fifo_group(message))
                .message_deduplication_id(dedup_id);
        }
        request
            .send()
            .await
            .map_err(|e| Error::sdk(self.operation, self.queue_url, e))?;
        Ok(())
    }
}

/// The message group of a copy on a FIFO queue: the original's group, made valid for SQS
/// (hashed where it is not); `dead-letter` without one.
fn fifo_group(message: &Message) -> String {
    match message.key.as_deref() {
        Some(key) if !key.is_empty() => fifo::fifo_id(&String::from_utf8_lossy(key)),
        _ => "dead-letter".to_owned(),
    }
}

/// The attribute `name` with the bytes `value`: text stays text, anything else (empty text
/// too, which SQS refuses as a `String`) is binary; the source reads both back as the same
/// bytes ([`attribute_bytes`]).
pub(crate) fn attribute(
    name: &str,
    value: impl AsRef<[u8]>,
) -> Result<MessageAttributeValue, Error> {
    let value = value.as_ref();
    let builder = MessageAttributeValue::builder();
    let builder = match std::str::from_utf8(value) {
        Ok(text) if !text.is_empty() => builder.data_type("String").string_value(text),
        _ => builder
            .data_type("Binary")
            .binary_value(Blob::new(value.to_vec())),
    };
    builder
        .build()
        .map_err(|e| Error::Config(format!("cannot build the message attribute `{name}`: {e}")))
}

/// An attribute's value as bytes: the text of a String or Number attribute, the bytes of a
/// Binary one.
pub(crate) fn attribute_bytes(value: &MessageAttributeValue) -> Vec<u8> {
    match (value.string_value(), value.binary_value()) {
        (Some(text), _) => text.as_bytes().to_vec(),
        (None, Some(blob)) => blob.as_ref().to_vec(),
        (None, None) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_become_text_or_binary_attributes_and_read_back_the_same() {
        for (value, data_type) in [(&b"42"[..], "String"), (&[0xff], "Binary"), (b"", "Binary")] {
            let built = attribute("h", value).expect("an attribute");
            assert_eq!(built.data_type(), data_type, "{value:?}");
            assert_eq!(attribute_bytes(&built), value);
        }
    }
}
