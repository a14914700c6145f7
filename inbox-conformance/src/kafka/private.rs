//! A Tansu broker of a test's own, reached only through a [`FaultProxy`]: Kafka clients
//! connect to the address the broker advertises, not the one they were given, so a proxy in
//! front of the shared broker would carry only the bootstrap. This one listens on one port and
//! advertises its proxy: every byte a client (and its commits and heartbeats) exchanges with it
//! crosses the proxy.
//!
//! With [`PrivateTansuBuilder::tls`] it is reached over TLS only. Tansu 0.6 cannot serve TLS
//! itself: `tansu broker` refuses `--cert` together with `--key` (clap puts both in one
//! exclusive group), and its listener never wraps a connection in the TLS acceptor it builds
//! (`let _acceptor = ...` in `tansu-broker`'s `listen`), whatever the listener URL's scheme.
//! So `socat` terminates TLS in front of the proxy, with the test CA's server certificate, and
//! Tansu advertises socat's port under the name `localhost`: every connection a client makes,
//! bootstrap and advertised, is a TLS connection it verifies against `ssl.ca.location`.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::tls::TestCa;
use crate::FaultProxy;
use inbox_testkit::eventually;

/// A Tansu with in-memory storage, killed when dropped (a panicking test included), with its
/// TLS front when it has one. `TANSU` names the binary, default `~/.cargo/bin/tansu`.
#[derive(Debug)]
pub struct PrivateTansu {
    process: Child,
    pub(super) proxy: FaultProxy,
    /// socat, terminating TLS on `tls_port`.
    tls: Option<(Child, u16)>,
}

/// How a [`PrivateTansu`] is reached. Start with [`PrivateTansu::builder`].
#[derive(Debug, Clone, Default)]
#[must_use = "a builder does nothing until `start` is called"]
pub struct PrivateTansuBuilder {
    tls: Option<TestCa>,
    authentication: bool,
}

impl PrivateTansuBuilder {
    /// TLS only, with `ca`'s server certificate (make it for `localhost`): a plaintext
    /// connection reaches no broker.
    pub fn tls(mut self, ca: &TestCa) -> Self {
        self.tls = Some(ca.clone());
        self
    }

    /// Tansu's `--authentication`: every request but the SASL handshake needs a login first.
    /// No login succeeds on Tansu 0.6 as built here: its SASL library is built without PLAIN
    /// (a PLAIN handshake closes the connection), its in-memory storage keeps no SCRAM users
    /// (`upsert_user_scram_credential` stores nothing, and `tansu user create` would need a
    /// login first), and it offers OAUTHBEARER but refuses every token (its check knows PLAIN
    /// and SCRAM only). What it shows is how a client reports a refused login.
    pub fn authentication(mut self, on: bool) -> Self {
        self.authentication = on;
        self
    }

    /// Starts the broker (and its TLS front) and waits until they listen.
    ///
    /// # Panics
    /// When Tansu (or, for TLS, `socat`) cannot be started or does not listen within 10 s.
    pub async fn start(self) -> PrivateTansu {
        let listener: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let proxy = FaultProxy::start(listener).await.expect("proxy");
        let tls_port = self.tls.as_ref().map(|_| free_port());
        let advertised = match tls_port {
            Some(port) => format!("tcp://localhost:{port}"),
            None => format!("tcp://{}", proxy.addr()),
        };
        let tansu = std::env::var("TANSU").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            format!("{home}/.cargo/bin/tansu")
        });
        let mut command = Command::new(&tansu);
        command
            .arg("broker")
            .args(["--storage-engine", "memory://tansu/"])
            .args(["--listener-url", &format!("tcp://{listener}")])
            .args(["--advertised-listener-url", &advertised]);
        if self.authentication {
            command.arg("--authentication");
        }
        let process = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {tansu}: {e}; install Tansu or set TANSU"));
        let mut server = PrivateTansu {
            process,
            proxy,
            tls: None,
        };
        listening(listener, "the private Tansu").await;
        if let (Some(ca), Some(port)) = (&self.tls, tls_port) {
            let front = Command::new("socat")
                .arg(format!(
                    "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={},key={},verify=0",
                    ca.cert.display(),
                    ca.key.display()
                ))
                .arg(format!("TCP:{}", server.proxy.addr()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start socat: {e}; install socat"));
            server.tls = Some((front, port));
            listening(([127, 0, 0, 1], port).into(), "socat's TLS front").await;
        }
        server
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

async fn listening(addr: SocketAddr, what: &str) {
    let up = eventually(Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(addr).await.is_ok()
    })
    .await;
    assert!(up, "{what} did not listen on {addr}");
}

impl PrivateTansu {
    /// A plaintext Tansu without authentication.
    pub async fn start() -> Self {
        Self::builder().start().await
    }

    /// Options: TLS, authentication.
    pub fn builder() -> PrivateTansuBuilder {
        PrivateTansuBuilder::default()
    }

    /// Where clients connect: the proxy, or with TLS `localhost:<port>` (the name in the
    /// certificate, and what the broker advertises).
    pub fn brokers(&self) -> String {
        match &self.tls {
            Some((_, port)) => format!("localhost:{port}"),
            None => self.proxy.addr().to_string(),
        }
    }

    /// The TLS port, when the broker has TLS.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls.as_ref().map(|(_, port)| *port)
    }
}

impl Drop for PrivateTansu {
    fn drop(&mut self) {
        if let Some((front, _)) = &mut self.tls {
            let _ = front.kill();
            let _ = front.wait();
        }
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
