//! One forwarding mechanism for wrappers of a source or an ack handle, so that each writes only
//! the methods it changes (the trait is in scope where they are used: inside its `impl`).

/// Inside `impl MessageSource for Wrapper`, the named methods (`redelivery_window`, `system`,
/// `consumer_group`, `capabilities`) as the source in field `$i` answers them:
/// `forward_source!(inner: system, capabilities);`.
#[macro_export]
macro_rules! forward_source {
    ($i:tt: $($method:ident),+) => { $($crate::forward_source!(@ $i $method);)+ };
    (@ $i:tt redelivery_window) => {
        fn redelivery_window(&self) -> Option<::core::time::Duration> {
            self.$i.redelivery_window()
        }
    };
    (@ $i:tt system) => { fn system(&self) -> &'static str { self.$i.system() } };
    (@ $i:tt consumer_group) => {
        fn consumer_group(&self) -> Option<&str> { self.$i.consumer_group() }
    };
    (@ $i:tt capabilities) => {
        fn capabilities(&self) -> $crate::__core::Capabilities { self.$i.capabilities() }
    };
}

/// Inside `impl Ack for Wrapper`, the named methods (`ack`, `nack`, `dead_letter`, `redeliver`,
/// `is_stale`) as the handle in field `$i` does them: `forward_ack!(inner: nack, dead_letter);`.
#[macro_export]
macro_rules! forward_ack {
    ($i:tt: $($method:ident),+) => { $($crate::forward_ack!(@ $i $method);)+ };
    (@ $i:tt ack) => {
        async fn ack(self) -> ::core::result::Result<(), $crate::__core::SourceError> {
            self.$i.ack().await
        }
    };
    (@ $i:tt nack) => {
        async fn nack(
            self,
            retry_after: ::core::time::Duration,
        ) -> ::core::result::Result<(), $crate::__core::SourceError> {
            self.$i.nack(retry_after).await
        }
    };
    (@ $i:tt dead_letter) => {
        async fn dead_letter(
            self,
            message: &$crate::__core::Message,
            reason: &str,
        ) -> ::core::result::Result<(), $crate::__core::SourceError> {
            self.$i.dead_letter(message, reason).await
        }
    };
    (@ $i:tt redeliver) => {
        async fn redeliver(
            self,
            message: &$crate::__core::Message,
            delay: ::core::time::Duration,
            redelivery: u32,
        ) -> ::core::result::Result<(), $crate::__core::SourceError> {
            self.$i.redeliver(message, delay, redelivery).await
        }
    };
    (@ $i:tt is_stale) => { fn is_stale(&self) -> bool { self.$i.is_stale() } };
}
