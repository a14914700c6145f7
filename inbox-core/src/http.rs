//! A small HTTP endpoint for probes and scrapes (feature `http`): `/healthz` (live), `/readyz`
//! (ready) and `/metrics` (Prometheus text from a renderer you pass).
//!
//! ```no_run
//! # async fn run(consumer_health: inbox_core::Health) -> std::io::Result<()> {
//! use inbox_core::http::Endpoint;
//!
//! // let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
//! let server = Endpoint::new()
//!     .consumer(consumer_health) // from `Consumer::health`, before `run`
//!     .metrics(move || String::from("# prometheus.render() here\n"))
//!     .bind("0.0.0.0:9464")
//!     .await?;
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let serving = tokio::spawn(server.run_until(async { let _ = stopped.await; }));
//! // ... consumer.run().await ...
//! let _ = stop.send(());
//! let _ = serving.await;
//! # Ok(())
//! # }
//! ```
//!
//! | path | 200 | 503 |
//! |---|---|---|
//! | `/healthz` | every consumer is live ([`Health::is_live`]): its loop turned within `stalled_after` | one is stalled or stopped: restart the process |
//! | `/readyz` | every consumer is ready ([`Health::is_ready`]) | one is starting, backing off after a broker or store error, stopping or stopped: take the instance out of rotation, do not restart it |
//! | `/metrics` | the renderer's text, `text/plain; version=0.0.4` | – (404 without a renderer) |
//!
//! `GET` and `HEAD` only (405 otherwise). Each connection serves one request and is closed
//! (`Connection: close`): probes and Prometheus open one per request or cope with it. A request
//! head over 8 KiB is answered 431, one not complete within 5 s 408, and at most 32 connections
//! are served at once; further ones wait in the listen backlog. With no consumer added, both
//! probes answer 200.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::task::JoinSet;

use crate::Health;

/// The longest request head (request line and headers) read.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client may take to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once.
const MAX_CONNECTIONS: usize = 32;
/// After the response, how long unread input is drained before closing, so that closing does
/// not reset the connection under a response the client has not read yet.
const LINGER: Duration = Duration::from_millis(500);

type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// What the endpoint answers: the consumers it watches and the metrics renderer. Build it, then
/// [`Endpoint::bind`].
#[derive(Clone)]
pub struct Endpoint {
    consumers: Vec<Health>,
    stalled_after: Duration,
    metrics: Option<Render>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("consumers", &self.consumers.len())
            .field("stalled_after", &self.stalled_after)
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

impl Default for Endpoint {
    fn default() -> Self {
        Self::new()
    }
}

impl Endpoint {
    /// How long a consumer's loop may go without turning before `/healthz` fails, by default.
    pub const DEFAULT_STALLED_AFTER: Duration = Duration::from_secs(120);

    /// An endpoint watching no consumer yet, without metrics.
    pub fn new() -> Self {
        Self {
            consumers: Vec::new(),
            stalled_after: Self::DEFAULT_STALLED_AFTER,
            metrics: None,
        }
    }

    /// Watches a consumer ([`Consumer::health`](crate::Consumer::health)); both probes answer
    /// for all watched consumers together.
    pub fn consumer(mut self, health: Health) -> Self {
        self.consumers.push(health);
        self
    }

    /// How long a consumer's loop may go without turning before it counts as stalled (default
    /// [`Endpoint::DEFAULT_STALLED_AFTER`]). The loop turns at least once per broker poll and
    /// per finished batch, so keep it above the poll wait, the handler timeout and the longest
    /// batch.
    pub fn stalled_after(mut self, wait: Duration) -> Self {
        self.stalled_after = wait;
        self
    }

    /// Serves `/metrics` with the text `render` returns: `move || handle.render()` with a
    /// `metrics-exporter-prometheus` handle. It is called once per scrape.
    pub fn metrics(mut self, render: impl Fn() -> String + Send + Sync + 'static) -> Self {
        self.metrics = Some(Arc::new(render));
        self
    }

    /// Listens on `addr` (port 0 picks a free port: see [`Server::local_addr`]).
    pub async fn bind(self, addr: impl ToSocketAddrs) -> io::Result<Server> {
        Ok(Server {
            listener: TcpListener::bind(addr).await?,
            endpoint: Arc::new(self),
        })
    }

    /// Serves on a listener you made.
    pub fn serve(self, listener: TcpListener) -> Server {
        Server {
            listener,
            endpoint: Arc::new(self),
        }
    }

    /// The status and body of `GET path`.
    fn answer(&self, path: &str) -> Response {
        match path {
            "/healthz" | "/livez" => {
                let stalled: Vec<String> = self
                    .consumers
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| !h.is_live(self.stalled_after))
                    .map(|(i, h)| format!("{} {}", name(i, h), h.state().as_str()))
                    .collect();
                if stalled.is_empty() {
                    Response::text(200, "live\n")
                } else {
                    Response::text(503, format!("not live: {}\n", stalled.join(", ")))
                }
            }
            "/readyz" => {
                let waiting: Vec<String> = self
                    .consumers
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| !h.is_ready())
                    .map(|(i, h)| format!("{} {}", name(i, h), h.state().as_str()))
                    .collect();
                if waiting.is_empty() {
                    Response::text(200, "ready\n")
                } else {
                    Response::text(503, format!("not ready: {}\n", waiting.join(", ")))
                }
            }
            "/metrics" => match &self.metrics {
                Some(render) => Response {
                    status: 200,
                    content_type: "text/plain; version=0.0.4; charset=utf-8",
                    body: render(),
                    allow: false,
                },
                None => Response::text(404, "no metrics renderer configured\n"),
            },
            _ => Response::text(404, "not found; try /healthz, /readyz or /metrics\n"),
        }
    }
}

fn name(index: usize, health: &Health) -> String {
    health
        .consumer()
        .map_or_else(|| format!("consumer #{}", index + 1), str::to_owned)
}

/// A bound [`Endpoint`]; [`Server::run_until`] serves it.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    endpoint: Arc<Endpoint>,
}

impl Server {
    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` completes, then closes the listener and drops the connections
    /// still open. Spawn it beside the consumer and complete `shutdown` when the consumer's
    /// `run` returns, or let it end with the runtime.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = self.listener.accept(), if connections.len() < MAX_CONNECTIONS => {
                    match accepted {
                        Ok((stream, _)) => {
                            let endpoint = Arc::clone(&self.endpoint);
                            connections.spawn(async move {
                                if let Err(e) = respond(stream, &endpoint).await {
                                    tracing::debug!(error = %e, "health endpoint connection failed");
                                }
                            });
                        }
                        Err(e) => {
                            // Out of file descriptors, say: wait instead of spinning.
                            tracing::warn!(error = %e, "health endpoint cannot accept a connection");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }
        }
    }
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
    /// Send `Allow: GET, HEAD` (a 405).
    allow: bool,
}

impl Response {
    fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
            allow: false,
        }
    }

    fn bytes(&self, head_only: bool) -> Vec<u8> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            408 => "Request Timeout",
            431 => "Request Header Fields Too Large",
            503 => "Service Unavailable",
            505 => "HTTP Version Not Supported",
            _ => "Unknown",
        };
        let allow = if self.allow {
            "Allow: GET, HEAD\r\n"
        } else {
            ""
        };
        let mut out = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n\
             Cache-Control: no-store\r\n{allow}Connection: close\r\n\r\n",
            self.status,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        if !head_only {
            out.extend_from_slice(self.body.as_bytes());
        }
        out
    }
}

/// What a request head asks for, or the error response it gets.
fn parse(head: &[u8]) -> Result<(bool, String), Response> {
    let bad = |why: &str| Response::text(400, format!("bad request: {why}\n"));
    let line_end = head
        .iter()
        .position(|b| *b == b'\n')
        .ok_or_else(|| bad("no request line"))?;
    let line = std::str::from_utf8(&head[..line_end])
        .map_err(|_| bad("request line is not UTF-8"))?
        .trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("request line is not `METHOD target HTTP/1.1`"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(Response::text(505, "only HTTP/1.x is served\n"));
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => {
            let mut refused = Response::text(405, "only GET and HEAD are served\n");
            refused.allow = true;
            return Err(refused);
        }
    };
    // Origin form (`/readyz?x`), or absolute form (`http://host/readyz`).
    let path = match target.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => target,
    };
    let path = path.split(['?', '#']).next().unwrap_or(path);
    Ok((head_only, path.to_owned()))
}

/// The end of the request head, if it is all there (a blank line; bare `\n` line ends are
/// accepted too).
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Reads one request head, answers it and closes the connection.
async fn respond(mut stream: TcpStream, endpoint: &Endpoint) -> io::Result<()> {
    let mut buf = Vec::with_capacity(512);
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        let mut chunk = [0u8; 1024];
        loop {
            if let Some(end) = head_end(&buf) {
                return Ok(Some(end));
            }
            if buf.len() > MAX_HEAD {
                return Ok(None);
            }
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await;
    let (response, head_only) = match read {
        Err(_elapsed) => (
            Response::text(408, "request head not received in time\n"),
            false,
        ),
        Ok(Err(e)) => return Err(e),
        Ok(Ok(None)) => (Response::text(431, "request head too large\n"), false),
        Ok(Ok(Some(end))) if end > MAX_HEAD => {
            (Response::text(431, "request head too large\n"), false)
        }
        Ok(Ok(Some(end))) => match parse(&buf[..end]) {
            Ok((head_only, path)) => (endpoint.answer(&path), head_only),
            Err(refused) => (refused, false),
        },
    };
    stream.write_all(&response.bytes(head_only)).await?;
    stream.shutdown().await?;
    // Drain what the client still sends (a body, a pipelined request) until it closes.
    let _ = tokio::time::timeout(LINGER, async {
        let mut chunk = [0u8; 1024];
        while let Ok(n) = stream.read(&mut chunk).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_parsed_and_bad_ones_refused() {
        let ok = |head: &str| parse(head.as_bytes()).ok();
        assert_eq!(
            ok("GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"),
            Some((false, "/readyz".into()))
        );
        assert_eq!(
            ok("HEAD /metrics?x=1 HTTP/1.0\n\n"),
            Some((true, "/metrics".into()))
        );
        assert_eq!(
            ok("GET http://host:9/healthz HTTP/1.1\r\n\r\n"),
            Some((false, "/healthz".into()))
        );
        let status = |head: &str| parse(head.as_bytes()).err().map(|r| r.status);
        assert_eq!(status("POST /readyz HTTP/1.1\r\n\r\n"), Some(405));
        assert_eq!(status("GET /readyz HTTP/2.0\r\n\r\n"), Some(505));
        assert_eq!(status("GET  /readyz HTTP/1.1\r\n\r\n"), Some(400));
        assert_eq!(status("GET\r\n\r\n"), Some(400));
    }

    #[test]
    fn responses_carry_length_and_close() {
        let bytes = Response::text(503, "not ready\n").bytes(false);
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(text.contains("\r\nContent-Length: 10\r\n"));
        assert!(text.contains("\r\nConnection: close\r\n"));
        assert!(text.ends_with("\r\n\r\nnot ready\n"));
        let head = String::from_utf8(Response::text(200, "ready\n").bytes(true)).unwrap();
        assert!(head.ends_with(
            "Content-Length: 6\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
        ));
    }
}
