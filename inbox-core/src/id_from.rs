//! Where a message's ID is read from: one notion for every adapter.
//!
//! [`IdFrom`] names the convention a source reads (a header, the protocol's message-ID property,
//! CloudEvents, the Debezium outbox event router, a JSON field of the payload); an adapter shows
//! one received message through [`IdCarrier`], and [`IdFrom::read`] does the rest, the same way
//! on every broker.

use std::borrow::Cow;
use std::fmt;

use crate::message::{IdError, MessageId};

/// Where a source reads each message's ID. Every adapter's builder takes one (`.id_from(..)`);
/// its older options (`id_header`, `id_attribute`, `id_field`) are shorthands for
/// [`IdFrom::Header`].
///
/// A message whose ID is not where the convention says is dead-lettered with a reason that
/// names the header, property or field that was expected.
///
/// ```
/// use inbox_core::IdFrom;
///
/// // A CloudEvent's `source` and `id`, else the Debezium outbox router's `id` header.
/// let from = IdFrom::cloud_events_source_and_id().or(IdFrom::Debezium);
/// assert_eq!(
///     from.to_string(),
///     "CloudEvents source and id, else Debezium outbox id"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdFrom {
    /// A header by name: a Kafka record header, a RabbitMQ (AMQP) header, an SQS message
    /// attribute, a Redis stream entry field.
    Header(String),
    /// The ID property the protocol itself defines for the producer to set: AMQP's
    /// `message_id`; on an SQS FIFO queue, the `MessageDeduplicationId`. Kafka and Redis Streams
    /// have none, and their builders refuse this.
    MessageIdProperty,
    /// A CloudEvent's `id`, in binary content mode (the attribute as a header: `ce_id` on Kafka,
    /// `cloudEvents_id` or `cloudEvents:id` on AMQP) or else in structured content mode (the
    /// `id` member of a JSON event, `application/cloudevents+json`, recognised by its
    /// `specversion` member). With [`CloudEventsIdentity::SourceAndId`] the ID is the event's
    /// `source` and `id` together, as the CloudEvents spec defines an event's identity.
    CloudEvents(CloudEventsIdentity),
    /// What the Debezium outbox event router writes: the outbox row's ID in the header `id`. A
    /// value written as a JSON string (a JSON header converter) is read without its quotes.
    Debezium,
    /// A member of the JSON payload, named by a JSON pointer (RFC 6901: `/event/id`); a name
    /// without a leading `/` is a top-level member (`id` is `/id`). A string is the ID as it is,
    /// an integer in decimal.
    JsonField(String),
    /// Where the message sits in its stream, for topics whose producers set no ID: on Kafka
    /// the topic, partition and offset (`<topic>/<partition>/<offset>`). Brokers without a
    /// stable position (SQS, RabbitMQ) refuse it at `connect`.
    ///
    /// A weaker promise than a producer's ID: it removes redeliveries (a crash before the
    /// offset commit, a rebalance, a zombie's late write), but a producer's or a relay's resend
    /// is a new record at a new position and is applied again, and so is a dead letter
    /// replayed to the topic. A topic deleted and created again, or a cluster restored without
    /// its offsets, starts its offsets over: its new records would be taken for duplicates of
    /// the old ones and skipped, so use a new consumer name (or purge the inbox) then.
    Position,
    /// The first of these conventions that finds something; a message none of them finds is
    /// dead-lettered naming them all.
    FirstOf(Vec<IdFrom>),
}

/// Which CloudEvents attributes make the message ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloudEventsIdentity {
    /// The `id` attribute alone: enough where every producer of the stream shares one ID space
    /// (UUIDs, say).
    Id,
    /// The `source` and `id` attributes together, which the spec makes unique per event: two
    /// sources may each send an event `1`. The message ID is `<n>:<source>:<id>`, where `<n>` is
    /// the length of `source` in bytes, so no `source` and `id` can be mistaken for another pair
    /// (`/a:b` + `c` and `/a` + `b:c` give `4:/a:b:c` and `2:/a:b:c`).
    SourceAndId,
}

impl IdFrom {
    /// A header (attribute, entry field) by name.
    pub fn header(name: impl Into<String>) -> Self {
        Self::Header(name.into())
    }

    /// A member of the JSON payload, by JSON pointer (`/event/id`) or top-level name (`id`).
    pub fn json_field(pointer: impl Into<String>) -> Self {
        Self::JsonField(pointer.into())
    }

    /// A CloudEvent's `id` (binary or structured content mode).
    pub fn cloud_events() -> Self {
        Self::CloudEvents(CloudEventsIdentity::Id)
    }

    /// A CloudEvent's `source` and `id` together (see [`CloudEventsIdentity::SourceAndId`]).
    pub fn cloud_events_source_and_id() -> Self {
        Self::CloudEvents(CloudEventsIdentity::SourceAndId)
    }

    /// This convention, or `other` where this one finds nothing.
    pub fn or(self, other: IdFrom) -> Self {
        let mut all = match self {
            Self::FirstOf(all) => all,
            one => vec![one],
        };
        all.push(other);
        Self::FirstOf(all)
    }

    /// The header name, where this is [`IdFrom::Header`].
    pub fn header_name(&self) -> Option<&str> {
        match self {
            Self::Header(name) => Some(name),
            _ => None,
        }
    }

    /// Whether this convention may read the protocol's message-ID property: an adapter asks
    /// the broker for it only then.
    pub fn reads_property(&self) -> bool {
        match self {
            Self::MessageIdProperty => true,
            Self::FirstOf(all) => all.iter().any(Self::reads_property),
            _ => false,
        }
    }

    /// The first header this convention reads by name, where it reads one.
    pub fn first_header(&self) -> Option<&str> {
        match self {
            Self::Header(name) => Some(name),
            Self::FirstOf(all) => all.iter().find_map(Self::first_header),
            _ => None,
        }
    }

    /// Checks this convention against what a broker offers: a name that is empty, a pointer
    /// that is not one, or a message-ID property the broker does not have. The error says what
    /// to use instead; adapters report it as a configuration error.
    pub fn check(&self, binding: &Binding) -> Result<(), String> {
        match self {
            Self::Header(name) if name.is_empty() => {
                Err(format!("the ID {} name is empty", binding.header))
            }
            Self::MessageIdProperty if binding.property.is_none() => Err(format!(
                "{} has no message-ID property a producer sets; read the ID from a {} \
                 (IdFrom::Header), CloudEvents or a JSON field instead",
                binding.broker, binding.header
            )),
            Self::JsonField(pointer) if pointer.is_empty() || pointer == "/" => Err(format!(
                "the JSON field `{pointer}` names no member; use a pointer such as `/event/id`"
            )),
            Self::Position if binding.position.is_none() => Err(format!(
                "{} has no stable position to read an ID from (IdFrom::Position); read the ID \
                 from a {} (IdFrom::Header), CloudEvents or a JSON field instead",
                binding.broker, binding.header
            )),
            Self::FirstOf(all) if all.is_empty() => {
                Err("IdFrom::FirstOf lists no convention".into())
            }
            Self::FirstOf(all) => all.iter().try_for_each(|one| one.check(binding)),
            _ => Ok(()),
        }
    }

    /// Reads the ID of one message as this convention says, or says which header, property or
    /// field was expected and what was wrong with it.
    pub fn read(&self, message: &dyn IdCarrier) -> Result<MessageId, IdError> {
        match self.find(message) {
            Found::Id(id) => Ok(id),
            Found::Invalid(e) => Err(e),
            Found::Missing(field) => Err(IdError::Missing { field }),
        }
    }

    fn find(&self, message: &dyn IdCarrier) -> Found {
        let binding = message.binding();
        match self {
            Self::Header(name) => header(message, name, |v| v),
            Self::Debezium => header(message, "id", unquote),
            Self::MessageIdProperty => {
                let field = binding.property.unwrap_or("message-ID property").to_owned();
                match message.property() {
                    Some(raw) => Found::parse(&field, &raw),
                    None => Found::Missing(field),
                }
            }
            Self::JsonField(pointer) => json_field(message, pointer),
            Self::Position => {
                let field = binding.position.unwrap_or("position").to_owned();
                match message.position() {
                    Some(position) => Found::text(&field, &position),
                    None => Found::Missing(field),
                }
            }
            Self::CloudEvents(identity) => cloud_events(message, *identity),
            Self::FirstOf(all) => {
                let mut missing = Vec::new();
                for one in all {
                    match one.find(message) {
                        Found::Missing(field) => missing.push(field),
                        found => return found,
                    }
                }
                Found::Missing(missing.join(", nor "))
            }
        }
    }
}

impl fmt::Display for IdFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => write!(f, "header {name}"),
            Self::MessageIdProperty => f.write_str("the message-ID property"),
            Self::CloudEvents(CloudEventsIdentity::Id) => f.write_str("CloudEvents id"),
            Self::CloudEvents(CloudEventsIdentity::SourceAndId) => {
                f.write_str("CloudEvents source and id")
            }
            Self::Debezium => f.write_str("Debezium outbox id"),
            Self::JsonField(pointer) => write!(f, "JSON field {}", pointer_of(pointer)),
            Self::Position => f.write_str("the position in the stream"),
            Self::FirstOf(all) => {
                let names: Vec<String> = all.iter().map(ToString::to_string).collect();
                f.write_str(&names.join(", else "))
            }
        }
    }
}

/// What a broker calls the places an ID can be, for checks and error messages: an adapter
/// declares one as a constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The broker, as a user names it (`Kafka`).
    pub broker: &'static str,
    /// What a header is called there: `header`, `message attribute`, `field`.
    pub header: &'static str,
    /// How the message-ID property is named in errors (`property message_id`), or `None` where
    /// the protocol has none.
    pub property: Option<&'static str>,
    /// How a message's position is named in errors (`topic, partition and offset`), or `None`
    /// where the broker has no stable one ([`IdFrom::Position`] is refused there).
    pub position: Option<&'static str>,
    /// The prefixes of CloudEvents attributes in binary content mode, in the order tried
    /// (Kafka `ce_`; AMQP `cloudEvents_`, then `cloudEvents:`; NATS `ce-`): a new adapter takes
    /// them from the CloudEvents protocol binding for its broker. Empty where CloudEvents defines
    /// no binding for the broker (SQS, Redis Streams): only structured mode is read there.
    pub cloud_events_prefixes: &'static [&'static str],
}

/// One received message as an adapter shows it to [`IdFrom::read`].
pub trait IdCarrier {
    /// The broker's names for the places an ID can be.
    fn binding(&self) -> &Binding;

    /// The header (attribute, entry field) `name`: its bytes (text as it is, an integer in
    /// decimal), `Err` with the value's type where it is neither, `None` where there is no such
    /// header or its value is null.
    fn header(&self, name: &str) -> Option<Result<Cow<'_, [u8]>, String>>;

    /// The protocol's message-ID property, where the message has one.
    fn property(&self) -> Option<Cow<'_, [u8]>> {
        None
    }

    /// The message's position in its stream, where the broker has a stable one
    /// ([`IdFrom::Position`]).
    fn position(&self) -> Option<Cow<'_, str>> {
        None
    }

    /// The body.
    fn payload(&self) -> &[u8];
}

enum Found {
    Id(MessageId),
    Invalid(IdError),
    Missing(String),
}

impl Found {
    fn parse(field: &str, raw: &[u8]) -> Self {
        match IdError::parse(field, Some(raw)) {
            Ok(id) => Self::Id(id),
            Err(e) => Self::Invalid(e),
        }
    }

    fn text(field: &str, text: &str) -> Self {
        Self::parse(field, text.as_bytes())
    }
}

fn header(message: &dyn IdCarrier, name: &str, clean: fn(&[u8]) -> &[u8]) -> Found {
    let field = format!("{} {name}", message.binding().header);
    match message.header(name) {
        None => Found::Missing(field),
        Some(Ok(raw)) => Found::parse(&field, clean(&raw)),
        Some(Err(kind)) => Found::Missing(format!("{field} as text or integer (it is a {kind})")),
    }
}

/// `"abc"` as `abc`: a string header written by a JSON converter.
fn unquote(raw: &[u8]) -> &[u8] {
    match raw {
        [b'"', inner @ .., b'"'] if !inner.contains(&b'"') && !inner.contains(&b'\\') => inner,
        other => other,
    }
}

fn pointer_of(pointer: &str) -> Cow<'_, str> {
    if pointer.starts_with('/') {
        Cow::Borrowed(pointer)
    } else {
        // A plain name: escape it as one reference token (RFC 6901).
        Cow::Owned(format!(
            "/{}",
            pointer.replace('~', "~0").replace('/', "~1")
        ))
    }
}

fn json_field(message: &dyn IdCarrier, pointer: &str) -> Found {
    let pointer = pointer_of(pointer);
    let field = format!("JSON field {pointer} of the payload");
    let doc: serde_json::Value = match serde_json::from_slice(message.payload()) {
        Ok(doc) => doc,
        Err(e) => return Found::Missing(format!("{field} (the payload is not JSON: {e})")),
    };
    json_value(&field, doc.pointer(&pointer))
}

fn json_value(field: &str, value: Option<&serde_json::Value>) -> Found {
    match value {
        None | Some(serde_json::Value::Null) => Found::Missing(field.to_owned()),
        Some(serde_json::Value::String(text)) => Found::text(field, text),
        Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
            Found::text(field, &n.to_string())
        }
        Some(other) => Found::Missing(format!(
            "{field} as text or integer (it is {})",
            json_kind(other)
        )),
    }
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a fractional number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn cloud_events(message: &dyn IdCarrier, identity: CloudEventsIdentity) -> Found {
    let binding = message.binding();
    // Binary content mode: the attributes are headers.
    for prefix in binding.cloud_events_prefixes {
        let id_name = format!("{prefix}id");
        if message.header(&id_name).is_none() {
            continue;
        }
        return identify(
            identity,
            header(message, &id_name, |v| v),
            || header(message, &format!("{prefix}source"), |v| v),
            &format!("{} {prefix}source and {id_name}", binding.header),
        );
    }
    // Structured content mode: the event is the JSON body.
    let structured = serde_json::from_slice::<serde_json::Value>(message.payload())
        .ok()
        .filter(|doc| doc.get("specversion").is_some());
    let Some(event) = structured else {
        let headers: Vec<String> = binding
            .cloud_events_prefixes
            .iter()
            .map(|p| format!("{} {p}id", binding.header))
            .collect();
        let binary = if headers.is_empty() {
            String::new()
        } else {
            format!("{}, nor ", headers.join(", nor "))
        };
        return Found::Missing(format!(
            "CloudEvents id ({binary}a structured-mode JSON event with specversion and id)"
        ));
    };
    identify(
        identity,
        json_value("CloudEvents id of the structured event", event.get("id")),
        || {
            json_value(
                "CloudEvents source of the structured event",
                event.get("source"),
            )
        },
        "CloudEvents source and id of the structured event",
    )
}

/// The event's `id`, or with [`CloudEventsIdentity::SourceAndId`] its `source` and `id`
/// together (named `field`), or what was wrong with either.
fn identify(
    identity: CloudEventsIdentity,
    id: Found,
    source: impl FnOnce() -> Found,
    field: &str,
) -> Found {
    match (id, identity) {
        (Found::Id(id), CloudEventsIdentity::SourceAndId) => match source() {
            Found::Id(source) => combine(field, source.as_str(), id.as_str()),
            other => other,
        },
        (id, _) => id,
    }
}

/// `<len(source)>:<source>:<id>`: see [`CloudEventsIdentity::SourceAndId`].
fn combine(field: &str, source: &str, id: &str) -> Found {
    Found::text(field, &format!("{}:{source}:{id}", source.len()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const KAFKA: Binding = Binding {
        broker: "Kafka",
        header: "header",
        property: None,
        position: Some("topic, partition and offset"),
        cloud_events_prefixes: &["ce_"],
    };
    const AMQP: Binding = Binding {
        broker: "RabbitMQ",
        header: "header",
        property: Some("property message_id"),
        position: None,
        cloud_events_prefixes: &["cloudEvents_", "cloudEvents:"],
    };

    struct Msg {
        binding: Binding,
        headers: Vec<(&'static str, &'static str)>,
        property: Option<&'static str>,
        position: Option<&'static str>,
        payload: &'static str,
    }

    impl IdCarrier for Msg {
        fn binding(&self) -> &Binding {
            &self.binding
        }
        fn header(&self, name: &str) -> Option<Result<Cow<'_, [u8]>, String>> {
            self.headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| Ok(Cow::Borrowed(v.as_bytes())))
        }
        fn property(&self) -> Option<Cow<'_, [u8]>> {
            self.property.map(|p| Cow::Borrowed(p.as_bytes()))
        }
        fn position(&self) -> Option<Cow<'_, str>> {
            self.position.map(Cow::Borrowed)
        }
        fn payload(&self) -> &[u8] {
            self.payload.as_bytes()
        }
    }

    fn kafka(headers: Vec<(&'static str, &'static str)>, payload: &'static str) -> Msg {
        Msg {
            binding: KAFKA,
            headers,
            property: None,
            position: None,
            payload,
        }
    }

    fn id(from: &IdFrom, m: &Msg) -> String {
        from.read(m).unwrap().as_str().to_owned()
    }

    fn err(from: &IdFrom, m: &Msg) -> String {
        from.read(m).unwrap_err().to_string()
    }

    #[test]
    fn headers_and_debezium() {
        let m = kafka(vec![("event_id", "e1"), ("id", "\"d-1\"")], "{}");
        assert_eq!(id(&IdFrom::header("event_id"), &m), "e1");
        assert_eq!(id(&IdFrom::Debezium, &m), "d-1");
        assert_eq!(
            err(&IdFrom::header("other"), &m),
            "message has no ID: header other is missing"
        );
        let plain = kafka(vec![("id", "d-2")], "{}");
        assert_eq!(id(&IdFrom::Debezium, &plain), "d-2");
    }

    #[test]
    fn a_position_where_the_broker_has_one_and_a_refusal_where_not() {
        // A Kafka record at offset 15 of partition 2 of `orders`.
        let at = |headers| Msg {
            position: Some("orders/2/15"),
            ..kafka(headers, "{}")
        };
        assert_eq!(id(&IdFrom::Position, &at(vec![])), "orders/2/15");
        // A header first, the position for records without one.
        let either = IdFrom::header("event_id").or(IdFrom::Position);
        assert_eq!(id(&either, &at(vec![])), "orders/2/15");
        assert_eq!(id(&either, &at(vec![("event_id", "e1")])), "e1");
        assert!(IdFrom::Position.check(&KAFKA).is_ok());
        let refused = IdFrom::Position.check(&AMQP).unwrap_err();
        assert!(
            refused.contains("RabbitMQ has no stable position"),
            "{refused}"
        );
        assert_eq!(
            err(&IdFrom::Position, &kafka(vec![], "{}")),
            "message has no ID: topic, partition and offset is missing"
        );
    }

    #[test]
    fn json_fields_by_pointer_or_name() {
        let m = kafka(vec![], r#"{"id": 7, "event": {"id": "x/1"}, "f": 1.5}"#);
        assert_eq!(id(&IdFrom::json_field("/event/id"), &m), "x/1");
        assert_eq!(id(&IdFrom::json_field("id"), &m), "7");
        assert_eq!(
            err(&IdFrom::json_field("/event/nope"), &m),
            "message has no ID: JSON field /event/nope of the payload is missing"
        );
        assert!(err(&IdFrom::json_field("f"), &m).contains("a fractional number"));
        let not_json = kafka(vec![], "plain");
        assert!(err(&IdFrom::json_field("id"), &not_json).contains("the payload is not JSON"));
    }

    #[test]
    fn cloud_events_binary_and_structured() {
        let ce = IdFrom::cloud_events();
        let both = IdFrom::cloud_events_source_and_id();
        let binary = kafka(vec![("ce_id", "42"), ("ce_source", "/orders")], "data");
        assert_eq!(id(&ce, &binary), "42");
        assert_eq!(id(&both, &binary), "7:/orders:42");
        let structured = kafka(
            vec![],
            r#"{"specversion":"1.0","id":"42","source":"/a:b","type":"t"}"#,
        );
        assert_eq!(id(&ce, &structured), "42");
        assert_eq!(id(&both, &structured), "4:/a:b:42");
        let no_source = kafka(vec![("ce_id", "42")], "data");
        assert_eq!(
            err(&both, &no_source),
            "message has no ID: header ce_source is missing"
        );
        assert_eq!(
            err(&ce, &kafka(vec![], r#"{"id":"1"}"#)),
            "message has no ID: CloudEvents id (header ce_id, nor a structured-mode JSON event \
             with specversion and id) is missing"
        );
        let amqp = Msg {
            binding: AMQP,
            ..kafka(vec![("cloudEvents:id", "9")], "")
        };
        assert_eq!(id(&ce, &amqp), "9");
    }

    #[test]
    fn source_and_id_pairs_never_collide() {
        let pairs = [("/a:b", "c"), ("/a", "b:c"), ("1:/a", "b")];
        let ids: Vec<String> = pairs
            .iter()
            .map(|(s, i)| match combine("f", s, i) {
                Found::Id(id) => id.as_str().to_owned(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(ids, ["4:/a:b:c", "2:/a:b:c", "4:1:/a:b"]);
    }

    #[test]
    fn properties_fallbacks_and_checks() {
        let m = Msg {
            binding: AMQP,
            property: Some("p-1"),
            ..kafka(vec![], "")
        };
        assert_eq!(id(&IdFrom::MessageIdProperty, &m), "p-1");
        let either = IdFrom::header("event_id").or(IdFrom::MessageIdProperty);
        assert_eq!(id(&either, &m), "p-1");
        let none = IdFrom::header("event_id").or(IdFrom::json_field("id"));
        assert_eq!(
            err(&none, &m),
            "message has no ID: header event_id, nor JSON field /id of the payload (the \
             payload is not JSON: EOF while parsing a value at line 1 column 0) is missing"
        );
        assert!(IdFrom::MessageIdProperty.check(&KAFKA).is_err());
        assert!(IdFrom::MessageIdProperty.check(&AMQP).is_ok());
        assert!(IdFrom::header("").check(&AMQP).is_err());
        assert!(IdFrom::json_field("/").check(&AMQP).is_err());
    }
}
