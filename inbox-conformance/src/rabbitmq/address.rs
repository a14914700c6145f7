//! Where the broker is: `AMQP_URL`, its socket address, the URL through a proxy.

use std::net::SocketAddr;

/// The local broker `cargo xtask services` starts: the tests' default, never the adapter's.
pub const LOCAL_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// `AMQP_URL`, or [`LOCAL_AMQP_URL`].
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| LOCAL_AMQP_URL.to_owned())
}

/// `url` with its host and port replaced by `addr` (user, password and vhost kept).
pub fn url_via(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("an amqp:// URL");
    let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let userinfo = authority
        .rsplit_once('@')
        .map(|(user, _)| format!("{user}@"))
        .unwrap_or_default();
    format!("{scheme}://{userinfo}{addr}{tail}")
}

/// The broker's socket address, from `AMQP_URL`.
pub async fn broker_addr() -> SocketAddr {
    let url = amqp_url();
    let rest = url.split_once("://").expect("an amqp:// URL").1;
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    };
    let mut addrs = tokio::net::lookup_host(host_port)
        .await
        .expect("resolve the broker");
    addrs.next().expect("the broker has an address")
}
