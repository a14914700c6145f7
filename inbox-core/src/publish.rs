//! The producing side: [`Publish`], which every adapter's producer implements, so an outbox
//! relay (or any caller) can send through any broker the same way.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::telemetry::{TraceParent, TRACEPARENT_HEADER};
use crate::{MessageId, Recovery};

/// One message to publish: the ID the consuming inbox deduplicates on, the body, an optional
/// ordering key and headers. Every adapter's producer and the outbox take it.
///
/// ```
/// use inbox_core::OutgoingMessage;
///
/// let message = OutgoingMessage::generate(r#"{"amount":100}"#)
///     .key("account-1")
///     .header("content-type", "application/json");
/// assert_eq!(message.headers, [("content-type".to_owned(), b"application/json".to_vec())]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutgoingMessage {
    /// The message ID. Keep it when sending the same message again (after an error, from an
    /// outbox row), so the consumer applies it once.
    pub id: MessageId,
    /// The body.
    pub payload: Vec<u8>,
    /// Messages with one key keep their order where the broker has per-key order: the Kafka
    /// record key (one partition per key), the SQS FIFO `MessageGroupId`. RabbitMQ queues and
    /// Redis streams have one order for all their messages and ignore it.
    pub key: Option<String>,
    /// Headers, in order, as the consumer finds them in [`Message::headers`](crate::Message):
    /// Kafka record headers, SQS message attributes (`String`, or `Binary` for a value that is
    /// not UTF-8), AMQP headers (long strings), Redis stream fields. SQS and AMQP keep one
    /// value per name and hand them out sorted by name. A name may not be the adapter's ID
    /// header (or, on Redis, the `payload` field).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl OutgoingMessage {
    /// A message with ID `id`, no key and no headers.
    pub fn new(id: MessageId, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            id,
            payload: payload.into(),
            key: None,
            headers: Vec::new(),
        }
    }

    /// A message with a fresh UUIDv7 ID, no key and no headers.
    pub fn generate(payload: impl Into<Vec<u8>>) -> Self {
        Self::new(MessageId::generate(), payload)
    }

    /// Sets the ordering key.
    #[must_use]
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header (after those already set).
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The headers a producer sends (and the outbox stores): [`headers`](Self::headers), then
    /// the current span's trace context as [`TRACEPARENT_HEADER`]
    /// ([`TraceParent::current`], feature `opentelemetry`) unless the headers carry one.
    pub fn traced_headers(&self) -> impl Iterator<Item = (&str, Cow<'_, [u8]>)> {
        let traced = self
            .headers
            .iter()
            .any(|(name, _)| name == TRACEPARENT_HEADER);
        let current = if traced { None } else { TraceParent::current() };
        self.headers
            .iter()
            .map(|(name, value)| (name.as_str(), Cow::Borrowed(value.as_slice())))
            .chain(current.map(|parent| {
                let value = parent.to_string().into_bytes();
                (TRACEPARENT_HEADER, Cow::Owned(value))
            }))
    }
}

/// Sends messages to a broker and returns once the broker confirmed every one of them.
///
/// `destination` names a topic, queue or stream, per call: every adapter's producer
/// (`KafkaProducer`, `SqsProducer`, `RabbitProducer`, `RedisStreamProducer`) serves any
/// destination of its broker. [`Destinations`] routes names to producers of different brokers.
///
/// Contract:
/// - `Ok` only after the broker confirmed every message (stored, replicated as configured).
/// - Messages go out in slice order where the broker keeps an order (a Kafka partition, a FIFO
///   group, a queue, a stream), as long as nothing fails; implementations send a batch
///   pipelined (all in flight, then the confirms), not one round-trip per message.
/// - On `Err`, any subset may have reached the broker: send them all again **with the same
///   IDs**, and the consuming inbox skips the copies. The error's [`Recovery`] says whether
///   another attempt can help.
///
/// Publishers of different types behind one type (a `Box` or an `Arc`) go through
/// [`DynPublish`].
pub trait Publish: Send + Sync {
    /// Sends `messages` to `destination`, each under its own ID, pipelined, and returns once the
    /// broker confirmed them all.
    fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> impl Future<Output = Result<(), PublishError>> + Send;

    /// Sends `payload` to `destination` under a fresh UUIDv7 ID, confirmed, and returns the ID.
    /// To send it again after an error, use [`Publish::send_with_id`] with that ID.
    fn send(
        &self,
        destination: &str,
        payload: &[u8],
    ) -> impl Future<Output = Result<MessageId, PublishError>> + Send {
        async move {
            let id = MessageId::generate();
            self.send_with_id(destination, &id, payload).await?;
            Ok(id)
        }
    }

    /// Sends `payload` to `destination` under `id`, confirmed. Sending again with the same ID
    /// is safe: the consuming inbox applies the message once.
    fn send_with_id(
        &self,
        destination: &str,
        id: &MessageId,
        payload: &[u8],
    ) -> impl Future<Output = Result<(), PublishError>> + Send {
        async move {
            let message = OutgoingMessage::new(id.clone(), payload);
            self.send_batch(destination, std::slice::from_ref(&message))
                .await
        }
    }
}

/// `Arc<P>` and `Box<P>` publish through `P`.
macro_rules! forward_publish {
    ($($pointer:ident),+) => {$(
        impl<P: Publish + ?Sized> Publish for $pointer<P> {
            async fn send_batch(
                &self,
                destination: &str,
                messages: &[OutgoingMessage],
            ) -> Result<(), PublishError> {
                (**self).send_batch(destination, messages).await
            }
        }
    )+};
}

forward_publish!(Arc, Box);

/// [`Publish`] as a trait object, for publishers of different types behind one type:
/// `Box<dyn DynPublish>`, `Arc<dyn DynPublish>` (as [`Destinations`] keeps its routes).
///
/// `Publish`'s methods return `impl Future`, which keeps it from being made into a `dyn`
/// object; this trait has the same methods returning boxed futures, under names of their own
/// (`dyn_` and the `Publish` method's), so that they are never ambiguous beside `Publish`'s.
/// Every `Publish` implements it, and `dyn DynPublish` implements `Publish`, so a
/// `Box<dyn DynPublish>` or an `Arc<dyn DynPublish>` goes wherever a `Publish` does.
///
/// ```
/// use std::sync::Arc;
/// use inbox_core::{DynPublish, Publish};
///
/// fn erased(publisher: impl Publish + 'static) -> Arc<dyn DynPublish> {
///     Arc::new(publisher)
/// }
/// fn takes(_: impl Publish) {}
/// # fn f(p: impl Publish + 'static) {
/// takes(erased(p));
/// # }
/// ```
pub trait DynPublish: Send + Sync {
    /// [`Publish::send_batch`].
    fn dyn_send_batch<'a>(
        &'a self,
        destination: &'a str,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Result<(), PublishError>>;

    /// [`Publish::send`].
    fn dyn_send<'a>(
        &'a self,
        destination: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<MessageId, PublishError>>;

    /// [`Publish::send_with_id`].
    fn dyn_send_with_id<'a>(
        &'a self,
        destination: &'a str,
        id: &'a MessageId,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), PublishError>>;
}

impl<P: Publish> DynPublish for P {
    fn dyn_send_batch<'a>(
        &'a self,
        destination: &'a str,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(Publish::send_batch(self, destination, messages))
    }
    fn dyn_send<'a>(
        &'a self,
        destination: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<MessageId, PublishError>> {
        Box::pin(Publish::send(self, destination, payload))
    }
    fn dyn_send_with_id<'a>(
        &'a self,
        destination: &'a str,
        id: &'a MessageId,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(Publish::send_with_id(self, destination, id, payload))
    }
}

impl Publish for dyn DynPublish + '_ {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        self.dyn_send_batch(destination, messages).await
    }
    async fn send(&self, destination: &str, payload: &[u8]) -> Result<MessageId, PublishError> {
        self.dyn_send(destination, payload).await
    }
    async fn send_with_id(
        &self,
        destination: &str,
        id: &MessageId,
        payload: &[u8],
    ) -> Result<(), PublishError> {
        self.dyn_send_with_id(destination, id, payload).await
    }
}

/// Why a [`Publish::send_batch`] failed, and whether trying again can help: the same
/// [`OperationError`](crate::OperationError) sources and stores fail with.
pub type PublishError = crate::OperationError;

/// A [`Publish`] that hands each destination to the publisher registered for it: different
/// brokers (or differently configured producers) for different destinations.
///
/// ```
/// # use inbox_core::{Destinations, OutgoingMessage, Publish, PublishError};
/// # struct Producer;
/// # impl Publish for Producer {
/// #     async fn send_batch(&self, _: &str, _: &[OutgoingMessage]) -> Result<(), PublishError> { Ok(()) }
/// # }
/// # let (orders_queue, payments_stream) = (Producer, Producer);
/// let publisher = Destinations::new()
///     .route("orders", orders_queue)
///     .route("payments", payments_stream);
/// ```
///
/// A destination with no route fails with [`Recovery::Fatal`], naming it.
#[derive(Default)]
pub struct Destinations {
    routes: HashMap<String, Box<dyn DynPublish>>,
}

impl Destinations {
    /// No routes yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends messages for `destination` through `publisher` (replacing an earlier route).
    #[must_use]
    pub fn route(
        mut self,
        destination: impl Into<String>,
        publisher: impl Publish + 'static,
    ) -> Self {
        self.routes.insert(destination.into(), Box::new(publisher));
        self
    }

    /// The routed destinations, sorted.
    fn routed(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.routes.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

impl fmt::Debug for Destinations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Destinations")
            .field("routes", &self.routed())
            .finish()
    }
}

impl Publish for Destinations {
    async fn send_batch(
        &self,
        destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        match self.routes.get(destination) {
            Some(publisher) => publisher.dyn_send_batch(destination, messages).await,
            None => Err(PublishError::new(
                Recovery::Fatal,
                format!("publishing to `{destination}`"),
                format!(
                    "no publisher is routed for destination `{destination}` (routed: {}); \
                     add one with Destinations::route",
                    self.routed().join(", ")
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Keeps what it is sent, with the destination.
    #[derive(Default)]
    struct Keeper(Mutex<Vec<(String, OutgoingMessage)>>);

    impl Keeper {
        fn destinations(&self) -> Vec<String> {
            let kept = self.0.lock().unwrap();
            kept.iter().map(|(d, _)| d.clone()).collect()
        }
    }

    impl Publish for Keeper {
        async fn send_batch(
            &self,
            destination: &str,
            messages: &[OutgoingMessage],
        ) -> Result<(), PublishError> {
            let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
            kept.extend(messages.iter().map(|m| (destination.to_owned(), m.clone())));
            Ok(())
        }
    }

    #[tokio::test]
    async fn destinations_route_by_name_and_refuse_unknown_ones() {
        let orders = Arc::new(Keeper::default());
        let payments = Arc::new(Keeper::default());
        let publisher = Destinations::new()
            .route("orders", Arc::clone(&orders))
            .route("payments", Arc::clone(&payments));
        let batch = [
            OutgoingMessage::generate("a"),
            OutgoingMessage::generate("b"),
        ];
        publisher.send_batch("orders", &batch).await.unwrap();
        publisher.send_batch("payments", &batch[..1]).await.unwrap();
        assert_eq!(orders.destinations(), ["orders", "orders"]);
        assert_eq!(payments.destinations(), ["payments"]);

        let e = publisher.send_batch("refunds", &batch).await.unwrap_err();
        assert_eq!(e.recovery(), Recovery::Fatal);
        assert_eq!(
            e.to_string(),
            "publishing to `refunds`: no publisher is routed for destination `refunds` \
             (routed: orders, payments); add one with Destinations::route"
        );
    }

    #[tokio::test]
    async fn send_generates_a_fresh_id_and_send_with_id_keeps_the_given_one() {
        let keeper = Keeper::default();
        let first = keeper.send("orders", b"a").await.unwrap();
        let second = keeper.send("orders", b"b").await.unwrap();
        assert_ne!(first, second);
        keeper.send_with_id("orders", &first, b"a").await.unwrap();
        let kept = keeper.0.lock().unwrap();
        let ids: Vec<&MessageId> = kept.iter().map(|(_, m)| &m.id).collect();
        assert_eq!(ids, [&first, &second, &first]);
        assert_eq!(kept[1].1.payload, b"b");
        let uuid = uuid::Uuid::parse_str(first.as_str()).unwrap();
        assert_eq!(uuid.get_version_num(), 7, "{first} is not a UUIDv7");
    }

    #[test]
    fn headers_go_out_in_order_and_a_traceparent_of_their_own_is_not_replaced() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let message = OutgoingMessage::generate("x")
            .header("b", "2")
            .header(TRACEPARENT_HEADER, parent)
            .header("a", [0xff]);
        let sent: Vec<(&str, Vec<u8>)> = message
            .traced_headers()
            .map(|(name, value)| (name, value.into_owned()))
            .collect();
        assert_eq!(
            sent,
            [
                ("b", b"2".to_vec()),
                (TRACEPARENT_HEADER, parent.as_bytes().to_vec()),
                ("a", vec![0xff]),
            ]
        );
    }

    #[test]
    fn publishers_and_their_futures_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Destinations>();
        assert_send_sync::<PublishError>();
        assert_send_sync::<Arc<dyn DynPublish>>();
        fn assert_send<T: Send>(_: &T) {}
        let publisher = Destinations::new();
        let batch = [OutgoingMessage::generate("a")];
        assert_send(&publisher.send_batch("x", &batch));
    }
}
