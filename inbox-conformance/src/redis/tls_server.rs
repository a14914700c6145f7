//! A `redis-server` of a test's own that takes TLS only, on a free loopback port, with a
//! [`TestCa`]'s server certificate: what a client reaches over `rediss://` trusting that CA.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use inbox_testkit::eventually;

use crate::tls::TestCa;

/// The server; killed when dropped (a panicking test included). `REDIS_SERVER` names the
/// binary, default `redis-server` on the `PATH`.
#[derive(Debug)]
pub struct TlsRedis {
    process: Child,
    port: u16,
}

impl TlsRedis {
    /// Starts a server with no plaintext port, serving TLS on a free port with `ca`'s server
    /// certificate (client certificates not asked for), and waits until it listens.
    ///
    /// # Panics
    /// When `redis-server` cannot be started or does not listen within 10 s.
    pub async fn start(ca: &TestCa) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let path = |p: &Path| p.display().to_string();
        let server = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let process = Command::new(&server)
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args([
                "--tls-cert-file",
                &path(&ca.cert),
                "--tls-key-file",
                &path(&ca.key),
            ])
            .args([
                "--tls-ca-cert-file",
                &path(&ca.ca),
                "--tls-auth-clients",
                "no",
            ])
            .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {server}: {e} (run `cargo xtask services` to install it)")
            });
        let server = Self { process, port };
        let up = eventually(Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        assert!(up, "the TLS redis-server did not listen on {port}");
        server
    }

    /// The port of its TLS listener.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
