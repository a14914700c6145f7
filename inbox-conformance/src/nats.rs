//! The suite on NATS JetStream (feature `nats`): [`Nats`] gives each scenario a stream of its
//! own, storing the subject the scenario sends to and `<subject>.dlq`, consumed by the durable
//! consumer [`CONSUMER`] (filtered on the subject) and dead-lettered to `<subject>.dlq`.
//!
//! The server is found at `NATS_URL` (default `nats://127.0.0.1:4222`), with JetStream on.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use inbox_core::DynPublish;
use inbox_nats::async_nats::jetstream::{self, stream, Context};
use inbox_nats::async_nats::{self, HeaderMap};
use inbox_nats::{NatsConnection, NatsSource, NatsSourceBuilder};

use crate::process::{free_port, Server};
use crate::{FaultProxy, LosingSource, Proxied, Restartable, TestBroker, TestQueue};

/// The durable consumer every source of the suite reads through.
pub const CONSUMER: &str = "wallet";

/// How long a delivery stays with a member before the server hands it out again.
pub const ACK_WAIT: Duration = Duration::from_secs(2);

/// `NATS_URL`, or the local default.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// A JetStream context on [`nats_url`].
///
/// # Panics
/// When the server cannot be reached.
pub async fn context() -> Context {
    let client = async_nats::connect(nats_url())
        .await
        .expect("connect to NATS_URL");
    jetstream::new(client)
}

/// A source of `stream` on `connection` through [`CONSUMER`], reading `subject`, with the
/// suite's timings: 200 ms polls, [`ACK_WAIT`].
pub fn builder_on(connection: &NatsConnection, stream: &str, subject: &str) -> NatsSourceBuilder {
    connection
        .source(stream, CONSUMER)
        .filter_subject(subject)
        .dead_letter_subject(format!("{subject}.dlq"))
        .ack_wait(ACK_WAIT)
        .poll_timeout(Duration::from_millis(200))
}

/// NATS JetStream under test.
#[derive(Debug, Clone, Copy)]
pub struct Nats;

/// A stream of its own, storing `<name>` and `<name>.dlq`.
#[derive(Debug)]
pub struct Stream {
    name: String,
    /// The server: `NATS_URL`, or a private one's.
    url: String,
    js: Context,
}

impl Stream {
    /// The subject messages are sent to (also the stream's name).
    pub fn subject(&self) -> &str {
        &self.name
    }

    /// The dead-letter subject.
    pub fn dead_letter_subject(&self) -> String {
        format!("{}.dlq", self.name)
    }

    /// A JetStream context on the stream's server.
    pub fn context(&self) -> &Context {
        &self.js
    }

    fn connection(&self) -> NatsConnection {
        NatsConnection::new(&self.url)
    }

    /// The settings of every source of this stream.
    fn builder(&self) -> NatsSourceBuilder {
        builder_on(&self.connection(), &self.name, &self.name)
    }

    /// A new stream `name` on the server at `url`, storing `name` and `name.dlq`.
    async fn create(name: String, url: String) -> Self {
        let client = async_nats::connect(&url).await.expect("connect to NATS");
        let js = jetstream::new(client);
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![name.clone(), format!("{name}.dlq")],
            ..Default::default()
        })
        .await
        .expect("create the stream");
        Stream { name, url, js }
    }

    /// Sends `payload` with these headers, confirmed.
    ///
    /// # Panics
    /// When the stream does not confirm it.
    pub async fn send_with_headers(&self, headers: &[(&str, &str)], payload: &[u8]) {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(*name, *value);
        }
        self.js
            .publish_with_headers(self.name.clone(), map, payload.to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("the stream confirms the message");
    }
}

impl TestBroker for Nats {
    type Queue = Stream;

    async fn queue(&self, scenario: &str) -> Stream {
        let name = crate::unique_name(&format!("inbox-test-{scenario}"));
        Stream::create(name, nats_url()).await
    }

    async fn attach(&self, name: &str) -> Stream {
        Stream {
            name: name.to_owned(),
            url: nats_url(),
            js: context().await,
        }
    }
}

/// The source of `builder`'s settings.
async fn connect(builder: NatsSourceBuilder) -> NatsSource {
    builder.connect().await.expect("source connects")
}

impl TestQueue for Stream {
    type Source = NatsSource;

    fn name(&self) -> String {
        self.name.clone()
    }

    async fn send(&self, id: Option<&str>, payload: &[u8]) {
        match id {
            Some(id) => self.send_with_headers(&[("event_id", id)], payload).await,
            None => self.send_with_headers(&[], payload).await,
        }
    }

    async fn source(&self, _member: &str) -> NatsSource {
        // The members of one durable pull consumer share its messages.
        connect(self.builder()).await
    }

    async fn source_reading(&self, _member: &str, from: inbox_core::IdFrom) -> Option<NatsSource> {
        Some(connect(self.builder().id_from(from)).await)
    }

    async fn losing_source(&self, _member: &str) -> Option<LosingSource<NatsSource>> {
        // Without "in progress" a delivery held past ack_wait goes to another member.
        Some(LosingSource {
            source: connect(self.builder().progress(false)).await,
            stall: ACK_WAIT * 3,
        })
    }

    async fn proxied_source(&self, _member: &str) -> Option<Proxied<NatsSource>> {
        let (proxy, through) = FaultProxy::in_front_of_url(&nats_url(), 4222).await.ok()?;
        // A silent connection is given up after two missed pings (about 1 s).
        let connection = NatsConnection::new(through)
            .operation_timeout(Duration::from_secs(1))
            .ping_interval(Duration::from_millis(500));
        Some(Proxied {
            source: connect(builder_on(&connection, &self.name, &self.name)).await,
            proxy,
            blackhole: Duration::from_secs(4),
            counts_faults: true,
        })
    }

    async fn restartable(&self) -> Result<Restartable<Stream>, String> {
        let server = private_nats().await;
        let url = format!("nats://127.0.0.1:{}", server.port());
        let queue = Stream::create(self.name.clone(), url).await;
        Ok(Restartable {
            queue,
            server: Box::new(server),
        })
    }

    fn redelivery_delay(&self) -> Duration {
        ACK_WAIT + Duration::from_secs(1)
    }

    async fn producer(&self) -> Arc<dyn DynPublish> {
        let producer = self.connection().producer().connect().await;
        Arc::new(producer.expect("producer connects"))
    }

    async fn dead_letter_reader(&self) -> Option<Box<dyn inbox_core::replay::DynDeadLetters>> {
        let reader = self.connection().dead_letters(self.dead_letter_subject());
        crate::connected_reader(reader.connect().await)
    }

    async fn left(&self) -> u64 {
        let stream = self.js.get_stream(&self.name).await.expect("the stream");
        match stream.consumer_info(CONSUMER).await {
            // Not delivered yet, and delivered but not acked.
            Ok(info) => info.num_pending + u64::try_from(info.num_ack_pending).unwrap_or(0),
            // No consumer read yet: everything on the subject is left.
            Err(_) => {
                let info = stream
                    .info_with_subjects(self.name.clone())
                    .await
                    .expect("stream info");
                let mut subjects = std::pin::pin!(info);
                let mut left = 0;
                while let Some(Ok((subject, count))) =
                    futures_util::StreamExt::next(&mut subjects).await
                {
                    if subject == self.name {
                        left += u64::try_from(count).unwrap_or(0);
                    }
                }
                left
            }
        }
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// A `nats-server` of a scenario's own with JetStream, which it may restart: the stream and its
/// consumer are kept in its store directory. `NATS_SERVER` names the binary, default
/// `nats-server` on the `PATH` or in `/usr/sbin`.
async fn private_nats() -> Server {
    let binary = std::env::var("NATS_SERVER").unwrap_or_else(|_| {
        let packaged = "/usr/sbin/nats-server";
        if std::path::Path::new(packaged).is_file() {
            packaged
        } else {
            "nats-server"
        }
        .into()
    });
    let what = format!("{binary} (install nats-server or set NATS_SERVER)");
    Server::start(free_port(), "inbox-nats", &what, move |port, dir| {
        let mut command = Command::new(&binary);
        command
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir)
            .stderr(Stdio::null());
        command
    })
    .await
}
