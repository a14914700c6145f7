//! A `redis-server` of a test's own that takes TLS only, on a free loopback port, with a
//! [`TestCa`]'s server certificate: what a client reaches over `rediss://` trusting that CA; as
//! one server, or as a Redis Cluster of one node.

use std::process::{Command, Stdio};
use std::time::Duration;

use inbox_testkit::eventually;

use crate::process::Server;
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
        Self::spawn(ca, false).await
    }

    /// A Redis Cluster of one node taking TLS only (its cluster bus too), holding every slot:
    /// what a cluster client reaches over `rediss://` trusting `ca`. `ca`'s certificate must
    /// name `127.0.0.1`, the address the node gives for its slots.
    ///
    /// # Panics
    /// When `redis-server` cannot be started, or the cluster is not up within 10 s.
    pub async fn start_cluster(ca: &TestCa) -> Self {
        let server = Self::spawn(ca, true).await;
        // Through redis-cli over TLS: this crate's Redis client may be built without TLS.
        let cli = |command: &[&str]| {
            let port = server.port().to_string();
            let ca = ca.ca.display().to_string();
            let cli = std::env::var("REDIS_CLI").unwrap_or_else(|_| "redis-cli".into());
            let out = Command::new(&cli)
                .args(["--tls", "--cacert", &ca, "-h", "127.0.0.1", "-p", &port])
                .args(command)
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("cannot run {cli}: {e}"));
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let added = cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
        assert!(added.contains("OK"), "CLUSTER ADDSLOTSRANGE: {added}");
        let ok = eventually(Duration::from_secs(10), || {
            let info = cli(&["CLUSTER", "INFO"]);
            async move { info.contains("cluster_state:ok") }
        })
        .await;
        assert!(
            ok,
            "the one-node TLS cluster did not reach cluster_state:ok"
        );
        server
    }

    /// A server as [`start`](TlsRedis::start) describes, a cluster node when `cluster`.
    async fn spawn(ca: &TestCa, cluster: bool) -> Self {
        let path = |p: &std::path::Path| p.display().to_string();
        let (cert, key, ca) = (path(&ca.cert), path(&ca.key), path(&ca.ca));
        let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let what = format!("{binary} with TLS (run `cargo xtask services` to install it)");
        let server = Server::start("inbox-tls-redis", &what, move |port, dir| {
            let mut command = Command::new(&binary);
            command
                .args(["--port", "0", "--tls-port", &port.to_string()])
                .args(["--tls-cert-file", &cert, "--tls-key-file", &key])
                .args(["--tls-ca-cert-file", &ca, "--tls-auth-clients", "no"])
                .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]);
            if cluster {
                command
                    .args(["--cluster-enabled", "yes", "--tls-cluster", "yes"])
                    .arg("--cluster-config-file")
                    .arg(dir.join("nodes.conf"));
            }
            command
        })
        .await;
        Self { server }
    }

    /// The port of its TLS listener.
    pub fn port(&self) -> u16 {
        self.server.port()
    }
}
