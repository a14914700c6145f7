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
use std::process::{Command, Stdio};

use crate::process::{free_port, Server};
use crate::tls::TestCa;
use crate::FaultProxy;

/// A Tansu with in-memory storage, killed when dropped (a panicking test included), with its
/// TLS front when it has one. `TANSU` names the binary, default `~/.cargo/bin/tansu`.
#[derive(Debug)]
pub struct PrivateTansu {
    /// The broker, stopped with this.
    _tansu: Server,
    pub(super) proxy: FaultProxy,
    /// socat, terminating TLS.
    tls: Option<Server>,
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
        // The proxy forwards to the broker once the broker has its port.
        let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], 9)))
            .await
            .expect("proxy");
        let to_proxy = proxy.addr();
        let tls = match &self.tls {
            Some(ca) => {
                let (cert, key) = (ca.cert.display(), ca.key.display());
                let listen =
                    format!("bind=127.0.0.1,reuseaddr,fork,cert={cert},key={key},verify=0");
                let what = "socat (install socat)";
                let front = Server::start(free_port(), "inbox-socat", what, move |port, _| {
                    let mut command = Command::new("socat");
                    command
                        .arg(format!("OPENSSL-LISTEN:{port},{listen}"))
                        .arg(format!("TCP:{to_proxy}"))
                        .stderr(Stdio::null());
                    command
                })
                .await;
                Some(front)
            }
            None => None,
        };
        let advertised = match &tls {
            Some(front) => format!("tcp://localhost:{}", front.port()),
            None => format!("tcp://{to_proxy}"),
        };
        let binary = std::env::var("TANSU").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            format!("{home}/.cargo/bin/tansu")
        });
        let what = format!("{binary} (install Tansu or set TANSU)");
        let authentication = self.authentication;
        let tansu = Server::start(free_port(), "inbox-tansu", &what, move |port, _| {
            let mut command = Command::new(&binary);
            command
                .arg("broker")
                .args(["--storage-engine", "memory://tansu/"])
                .args(["--listener-url", &format!("tcp://127.0.0.1:{port}")])
                .args(["--advertised-listener-url", &advertised])
                .stderr(Stdio::null());
            if authentication {
                command.arg("--authentication");
            }
            command
        })
        .await;
        proxy.redirect(([127, 0, 0, 1], tansu.port()).into());
        PrivateTansu {
            _tansu: tansu,
            proxy,
            tls,
        }
    }
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
        match self.tls_port() {
            Some(port) => format!("localhost:{port}"),
            None => self.proxy.addr().to_string(),
        }
    }

    /// The TLS port, when the broker has TLS.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls.as_ref().map(Server::port)
    }
}
