//! One forwarding mechanism for the wrappers around a source or an ack handle (crash points,
//! anti-patterns, the suite's checks), so that each writes only the methods it changes.

/// Inside `impl MessageSource for Wrapper`, the named methods (`redelivery_window`, `system`,
/// `consumer_group`, `capabilities`) as the source in field `$inner` answers them:
/// `forward_source!(inner: redelivery_window, system, consumer_group);`.
#[macro_export]
macro_rules! forward_source {
    ($inner:tt: $($method:ident),+ $(,)?) => {
        $($crate::forward_source!(@ $inner $method);)+
    };
    (@ $inner:tt redelivery_window) => {
        fn redelivery_window(&self) -> ::core::option::Option<::core::time::Duration> {
            $crate::__core::MessageSource::redelivery_window(&self.$inner)
        }
    };
    (@ $inner:tt system) => {
        fn system(&self) -> &'static str {
            $crate::__core::MessageSource::system(&self.$inner)
        }
    };
    (@ $inner:tt consumer_group) => {
        fn consumer_group(&self) -> ::core::option::Option<&str> {
            $crate::__core::MessageSource::consumer_group(&self.$inner)
        }
    };
    (@ $inner:tt capabilities) => {
        fn capabilities(&self) -> $crate::__core::Capabilities {
            $crate::__core::MessageSource::capabilities(&self.$inner)
        }
    };
}

/// Inside `impl Ack for Wrapper`, the named methods (`ack`, `nack`, `dead_letter`,
/// `redeliver`, `is_stale`) as the handle in field `$inner` does them:
/// `forward_ack!(inner: nack, dead_letter);`.
#[macro_export]
macro_rules! forward_ack {
    ($inner:tt: $($method:ident),+ $(,)?) => {
        $($crate::forward_ack!(@ $inner $method);)+
    };
    (@ $inner:tt ack) => {
        fn ack(self) -> impl ::core::future::Future<Output = ::core::result::Result<(), $crate::__core::SourceError>> + Send {
            $crate::__core::Ack::ack(self.$inner)
        }
    };
    (@ $inner:tt nack) => {
        fn nack(self, retry_after: ::core::time::Duration) -> impl ::core::future::Future<Output = ::core::result::Result<(), $crate::__core::SourceError>> + Send {
            $crate::__core::Ack::nack(self.$inner, retry_after)
        }
    };
    (@ $inner:tt dead_letter) => {
        fn dead_letter(self, message: &$crate::__core::Message, reason: &str) -> impl ::core::future::Future<Output = ::core::result::Result<(), $crate::__core::SourceError>> + Send {
            $crate::__core::Ack::dead_letter(self.$inner, message, reason)
        }
    };
    (@ $inner:tt redeliver) => {
        fn redeliver(self, message: &$crate::__core::Message, delay: ::core::time::Duration, redelivery: u32) -> impl ::core::future::Future<Output = ::core::result::Result<(), $crate::__core::SourceError>> + Send {
            $crate::__core::Ack::redeliver(self.$inner, message, delay, redelivery)
        }
    };
    (@ $inner:tt is_stale) => {
        fn is_stale(&self) -> bool {
            $crate::__core::Ack::is_stale(&self.$inner)
        }
    };
}
