//! Where the broker is: `AMQP_URL`.

/// The local broker `cargo xtask services` starts: the tests' default, never the adapter's.
pub const LOCAL_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// `AMQP_URL`, or [`LOCAL_AMQP_URL`].
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| LOCAL_AMQP_URL.to_owned())
}
