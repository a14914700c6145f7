//! A `redis-server` of a test's own that takes TLS only, on a free loopback port, with a
//! [`TestCa`]'s server certificate: what a client reaches over `rediss://` trusting that CA; as
//! one server, or as a Redis Cluster of one node.

use std::time::Duration;

use inbox_testkit::eventually;

use super::{redis_cli, start_server};
use crate::process::{free_port, Server};
use crate::tls::TestCa;

/// The server; killed when dropped (a panicking test included). `REDIS_SERVER` names the
/// binary, default `redis-server` on the `PATH`.
#[derive(Debug)]
pub struct TlsRedis {
    server: Server,
}

impl TlsRedis {
    /// Starts a server with no plaintext port, serving TLS on a free port with `ca`'s server
    /// certificate (client certificates not asked for), and waits until it listens.
    ///
    /// # Panics
    /// When `redis-server` cannot be started or does not listen within 10 s.
    pub async fn start(ca: &TestCa) -> Self {
        let server = start_server(free_port(), Some(ca), &[]).await;
        Self { server }
    }

    /// A Redis Cluster of one node taking TLS only (its cluster bus too), holding every slot:
    /// what a cluster client reaches over `rediss://` trusting `ca`. `ca`'s certificate must
    /// name `127.0.0.1`, the address the node gives for its slots.
    ///
    /// # Panics
    /// When `redis-server` cannot be started, or the cluster is not up within 10 s.
    pub async fn start_cluster(ca: &TestCa) -> Self {
        let cluster = &["--cluster-enabled", "yes", "--tls-cluster", "yes"];
        let server = start_server(free_port(), Some(ca), cluster).await;
        // Through redis-cli over TLS: this crate's Redis client may be built without TLS.
        let (port, ca) = (server.port().to_string(), ca.ca.display().to_string());
        let tls = ["--tls", "--cacert", &ca, "-h", "127.0.0.1", "-p", &port];
        let cli = |command: &'static [&'static str]| async move {
            let out = redis_cli(tls.iter().chain(command)).await;
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let added = cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]).await;
        assert!(added.contains("OK"), "CLUSTER ADDSLOTSRANGE: {added}");
        let ok = eventually(Duration::from_secs(10), || async {
            cli(&["CLUSTER", "INFO"]).await.contains("cluster_state:ok")
        })
        .await;
        assert!(
            ok,
            "the one-node TLS cluster did not reach cluster_state:ok"
        );
        Self { server }
    }

    /// The port of its TLS listener.
    pub fn port(&self) -> u16 {
        self.server.port()
    }
}
