//! A Tansu broker of a scenario's own, reached only through a [`FaultProxy`]: Kafka clients
//! connect to the address the broker advertises, not the one they were given, so a proxy in
//! front of the shared broker would carry only the bootstrap. This one listens on one port and
//! advertises its proxy: every byte a client (and its commits and heartbeats) exchanges with it
//! crosses the proxy.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::FaultProxy;
use inbox_testkit::eventually;

/// A Tansu with in-memory storage, killed when dropped (a panicking test included). `TANSU`
/// names the binary, default `~/.cargo/bin/tansu`.
#[derive(Debug)]
pub(super) struct PrivateTansu {
    process: Child,
    pub(super) proxy: FaultProxy,
}

impl PrivateTansu {
    pub(super) async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let listener: SocketAddr = ([127, 0, 0, 1], port).into();
        let proxy = FaultProxy::start(listener).await.expect("proxy");
        let tansu = std::env::var("TANSU").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            format!("{home}/.cargo/bin/tansu")
        });
        let process = Command::new(&tansu)
            .arg("broker")
            .args(["--storage-engine", "memory://tansu/"])
            .args(["--listener-url", &format!("tcp://{listener}")])
            .args([
                "--advertised-listener-url",
                &format!("tcp://{}", proxy.addr()),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {tansu}: {e}; install Tansu or set TANSU"));
        let server = Self { process, proxy };
        let up = eventually(Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(listener).await.is_ok()
        })
        .await;
        assert!(up, "the private Tansu did not listen on {listener}");
        server
    }

    /// Where clients connect: the proxy.
    pub(super) fn brokers(&self) -> String {
        self.proxy.addr().to_string()
    }
}

impl Drop for PrivateTansu {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
