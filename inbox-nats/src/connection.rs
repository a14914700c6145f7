//! [`NatsConnection`]: where and how to reach NATS, shared by the source, the producer and the
//! dead-letter reader.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use tracing::{info, warn};

use crate::{Error, NatsDeadLettersBuilder, NatsProducerBuilder, NatsSourceBuilder, Result};

/// The variable [`NatsConnection::from_env`] reads.
pub const NATS_URL: &str = "NATS_URL";

/// Where and how to reach NATS: the server URLs, TLS, the login and how long an operation may
/// take. The source, the producer and the dead-letter reader are all built from it, so a
/// setting made here reaches the three at once.
///
/// ```no_run
/// # async fn f() -> inbox_nats::Result<()> {
/// use std::time::Duration;
/// use inbox_nats::NatsConnection;
///
/// let nats = NatsConnection::new("tls://nats.internal:4222")
///     .root_certificates("/etc/nats/ca.pem")
///     .credentials_file("/etc/nats/wallet.creds")
///     .operation_timeout(Duration::from_secs(5));
/// let source = nats.source("CREDITS", "wallet").connect().await?;
/// let producer = nats.producer().connect().await?;
/// let dead_letters = nats.dead_letters("CREDITS.dlq").connect().await?;
/// # let _ = (source, producer, dead_letters); Ok(()) }
/// ```
///
/// Its `Debug` output hides passwords, tokens and seeds.
#[derive(Clone)]
#[must_use]
pub struct NatsConnection {
    servers: Option<Vec<String>>,
    login: Login,
    root_certificates: Vec<PathBuf>,
    client_certificate: Option<(PathBuf, PathBuf)>,
    require_tls: bool,
    operation_timeout: Duration,
    ping_interval: Duration,
    name: Option<String>,
}

/// How the client logs in, besides credentials in the URL.
#[derive(Clone)]
enum Login {
    None,
    UserPassword(String, String),
    Token(String),
    #[cfg(feature = "nkeys")]
    NKey(String),
    #[cfg(feature = "nkeys")]
    CredentialsFile(PathBuf),
    #[cfg(feature = "nkeys")]
    Credentials(String),
}

impl fmt::Debug for NatsConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let login = match &self.login {
            Login::None => "none".to_owned(),
            Login::UserPassword(user, _) => format!("user {user}, password ***"),
            Login::Token(_) => "token ***".to_owned(),
            #[cfg(feature = "nkeys")]
            Login::NKey(_) => "nkey seed ***".to_owned(),
            #[cfg(feature = "nkeys")]
            Login::CredentialsFile(path) => format!("credentials file {}", path.display()),
            #[cfg(feature = "nkeys")]
            Login::Credentials(_) => "credentials ***".to_owned(),
        };
        f.debug_struct("NatsConnection")
            .field("servers", &self.shown())
            .field("login", &login)
            .field("root_certificates", &self.root_certificates)
            .field("client_certificate", &self.client_certificate)
            .field("require_tls", &self.require_tls)
            .field("operation_timeout", &self.operation_timeout)
            .field("ping_interval", &self.ping_interval)
            .finish()
    }
}

impl NatsConnection {
    fn at(servers: Option<Vec<String>>) -> Self {
        Self {
            servers,
            login: Login::None,
            root_certificates: Vec::new(),
            client_certificate: None,
            require_tls: false,
            operation_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(10),
            name: None,
        }
    }

    /// The server at `url` (`nats://host:4222`, `tls://host:4222`; a user and password or a
    /// token may be in the URL), or several, comma-separated: the client learns the rest of a
    /// cluster from any of them.
    pub fn new(url: impl Into<String>) -> Self {
        let url = url.into();
        Self::at(Some(url.split(',').map(|u| u.trim().to_owned()).collect()))
    }

    /// The server(s) [`NATS_URL`] names. Unset, connecting fails with an error saying so:
    /// there is no default, so a missing setting never reaches a server on localhost.
    pub fn from_env() -> Self {
        Self::at(None)
    }

    /// Logs in with a user and password.
    pub fn user_and_password(
        mut self,
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.login = Login::UserPassword(user.into(), password.into());
        self
    }

    /// Logs in with a token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.login = Login::Token(token.into());
        self
    }

    #[cfg(feature = "nkeys")]
    /// Logs in with an NKey, given its seed (`SU…`). Feature `nkeys` (on by default).
    pub fn nkey(mut self, seed: impl Into<String>) -> Self {
        self.login = Login::NKey(seed.into());
        self
    }

    #[cfg(feature = "nkeys")]
    /// Logs in with a decentralized-auth creds file (a user JWT and its NKey seed), read at each
    /// connect. Feature `nkeys` (on by default).
    pub fn credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.login = Login::CredentialsFile(path.into());
        self
    }

    #[cfg(feature = "nkeys")]
    /// Logs in with the contents of a creds file. Feature `nkeys` (on by default).
    pub fn credentials(mut self, creds: impl Into<String>) -> Self {
        self.login = Login::Credentials(creds.into());
        self
    }

    /// Trusts the CA certificates in this PEM file (beside the system's), for servers whose
    /// certificates a private CA signed; implies TLS.
    pub fn root_certificates(mut self, pem: impl Into<PathBuf>) -> Self {
        self.root_certificates.push(pem.into());
        self.require_tls = true;
        self
    }

    /// Presents this client certificate and key (PEM files) for mutual TLS; implies TLS.
    pub fn client_certificate(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_certificate = Some((cert.into(), key.into()));
        self.require_tls = true;
        self
    }

    /// Refuses a connection without TLS (a `tls://` URL requires it too).
    pub fn require_tls(mut self, required: bool) -> Self {
        self.require_tls = required;
        self
    }

    /// How long connecting, or one request (a fetch, an ack confirm, a publish confirm), may wait
    /// for the server (default 10 s). Past it the operation fails with a
    /// [`Recovery::Retry`](inbox_core::Recovery) error; the client reconnects by itself.
    pub fn operation_timeout(mut self, wait: Duration) -> Self {
        self.operation_timeout = wait;
        self
    }

    /// How often the client pings the server (default 10 s): two pings unanswered and it drops
    /// the connection and connects anew, so a connection whose peer went silent is replaced.
    pub fn ping_interval(mut self, every: Duration) -> Self {
        self.ping_interval = every;
        self
    }

    /// The client name the server shows in its connection list.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// A source reading the JetStream stream `stream` through the durable pull consumer
    /// `consumer`; finish with [`connect`](NatsSourceBuilder::connect).
    pub fn source(
        &self,
        stream: impl Into<String>,
        consumer: impl Into<String>,
    ) -> NatsSourceBuilder {
        NatsSourceBuilder::new(self.clone(), stream.into(), consumer.into())
    }

    /// A producer publishing to any subject a stream stores; finish with
    /// [`connect`](NatsProducerBuilder::connect).
    pub fn producer(&self) -> NatsProducerBuilder {
        NatsProducerBuilder::new(self.clone())
    }

    /// A reader of the dead letters on `subject` (like `CREDITS.dlq`), for
    /// [`inbox_core::replay`]; finish with [`connect`](NatsDeadLettersBuilder::connect).
    pub fn dead_letters(&self, subject: impl Into<String>) -> NatsDeadLettersBuilder {
        NatsDeadLettersBuilder::new(self.clone(), subject.into())
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The servers, without credentials, for errors and logs.
    fn shown(&self) -> String {
        match &self.servers {
            None => NATS_URL.to_owned(),
            Some(urls) => urls
                .iter()
                .map(|u| inbox_core::redact_url(u))
                .collect::<Vec<_>>()
                .join(","),
        }
    }

    fn servers(&self) -> Result<Vec<String>> {
        let urls = match &self.servers {
            Some(urls) => urls.clone(),
            None => match std::env::var(NATS_URL) {
                Ok(url) if !url.trim().is_empty() => {
                    url.split(',').map(|u| u.trim().to_owned()).collect()
                }
                _ => {
                    return Err(Error::Config(format!(
                        "{NATS_URL} is not set: set it (nats://host:4222) or give the address \
                         with NatsConnection::new"
                    )))
                }
            },
        };
        if urls.iter().any(String::is_empty) {
            return Err(Error::Config("a NATS server URL is empty".into()));
        }
        Ok(urls)
    }

    /// Connects at once, for `purpose` (named in logs and errors), so a wrong address or a
    /// refused login fails the build. The client reconnects by itself afterwards, for ever.
    pub(crate) async fn open(&self, purpose: &'static str) -> Result<Client> {
        self.open_watched(purpose).await.map(|(client, _)| client)
    }

    /// [`open`](Self::open), and a counter of the connections lost since, which a source
    /// watches: a pull in flight when its connection went is never answered.
    pub(crate) async fn open_watched(
        &self,
        purpose: &'static str,
    ) -> Result<(Client, tokio::sync::watch::Receiver<u64>)> {
        let (lost_tx, lost) = tokio::sync::watch::channel(0u64);
        let lost_tx = std::sync::Arc::new(lost_tx);
        if self.operation_timeout < Duration::from_millis(1) {
            return Err(Error::Config(
                "operation_timeout is under 1 ms; use at least 1 ms".into(),
            ));
        }
        let servers = self.servers()?;
        let shown = self.shown();
        let failed = |source: inbox_core::BoxError| Error::Connect {
            server: shown.clone(),
            purpose,
            source,
        };
        let mut options = match &self.login {
            Login::None => ConnectOptions::new(),
            Login::UserPassword(user, password) => {
                ConnectOptions::with_user_and_password(user.clone(), password.clone())
            }
            Login::Token(token) => ConnectOptions::with_token(token.clone()),
            #[cfg(feature = "nkeys")]
            Login::NKey(seed) => ConnectOptions::with_nkey(seed.clone()),
            #[cfg(feature = "nkeys")]
            Login::CredentialsFile(path) => ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|e| {
                    Error::Config(format!(
                        "cannot read the NATS credentials file {}: {e}",
                        path.display()
                    ))
                })?,
            #[cfg(feature = "nkeys")]
            Login::Credentials(creds) => ConnectOptions::with_credentials(creds)
                .map_err(|e| Error::Config(format!("the NATS credentials do not parse: {e}")))?,
        };
        for ca in &self.root_certificates {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.client_certificate {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if let Some(name) = &self.name {
            options = options.name(name);
        }
        let shown_events = shown.clone();
        options = options
            .require_tls(self.require_tls)
            .connection_timeout(self.operation_timeout)
            .request_timeout(Some(self.operation_timeout))
            .ping_interval(self.ping_interval)
            .max_reconnects(None)
            .event_callback(move |event| {
                let server = shown_events.clone();
                let lost_tx = std::sync::Arc::clone(&lost_tx);
                async move {
                    match event {
                        Event::Connected => {
                            info!(%server, purpose, "NATS connection (re)established")
                        }
                        Event::Disconnected => {
                            lost_tx.send_modify(|n| *n += 1);
                            warn!(%server, purpose, "NATS connection lost; reconnecting")
                        }
                        other => warn!(%server, purpose, event = %other, "NATS client event"),
                    }
                }
            });
        let addresses: Vec<async_nats::ServerAddr> = servers
            .iter()
            .map(|url| {
                url.parse().map_err(|e| {
                    Error::Config(format!(
                        "`{}` is not a NATS server URL: {e}",
                        inbox_core::redact_url(url)
                    ))
                })
            })
            .collect::<Result<_>>()?;
        let client = options
            .connect(addresses)
            .await
            .map_err(|e| failed(Box::new(e)))?;
        Ok((client, lost))
    }
}
