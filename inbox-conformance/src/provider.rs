//! A stand-in for a downstream provider (a payment or email API) over real HTTP/1.1 on
//! loopback, for tests of side effects outside the database: it counts every effect it applies
//! per idempotency key, so a test can assert duplicates and losses where they happen.
//!
//! - `POST /effects` with headers `Idempotency-Key` and `Fencing-Token` and any body applies one
//!   effect and answers `200` with `effect <n>`. In [`ProviderMode::Keys`] a second call with a
//!   key already applied applies nothing and answers the first result, and a call whose key is
//!   still being applied gets `409` (as Stripe does); in the other modes every call applies.
//! - `GET /status/<key>` answers `applied`, `pending` (a call with that key is being applied)
//!   or `none`, in [`ProviderMode::StatusLookup`] only; `404` otherwise.
//!
//! Faults for the next calls with a key ([`TestProvider::next_call`]): slow (applies and answers
//! after a delay, whether or not the client is still there), apply and hang, apply and close
//! without answering, refuse with a status code.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use inbox_testkit::{eventually, lock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// What the provider offers for deduplication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderMode {
    /// Deduplicates on the `Idempotency-Key` header, like Stripe.
    Keys,
    /// No deduplication, but `GET /status/<key>` says whether a call with that key (sent as a
    /// reference, like an email's metadata) was applied.
    StatusLookup,
    /// Neither: every call applies, and nothing can be looked up.
    Neither,
}

/// How the provider treats one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Applies and answers at once.
    Normal,
    /// Waits this long, then applies and answers; it applies even when the client has gone.
    /// A call whose key was applied before ([`ProviderMode::Keys`]) waits as long, then answers
    /// with the first result.
    Slow(Duration),
    /// Applies, then holds the connection open without ever answering.
    ApplyThenHang,
    /// Applies, then closes the connection without answering.
    ApplyThenClose,
    /// Applies nothing and answers with this status code.
    Refuse(u16),
}

/// One applied effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Its number, from 1, in the order applied.
    pub number: u64,
    /// The idempotency key (or reference) it was called with.
    pub key: String,
    /// The fencing token it was called with.
    pub token: u64,
}

/// One call received, applied or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The idempotency key (or reference).
    pub key: String,
    /// The fencing token.
    pub token: u64,
}

#[derive(Debug)]
struct State {
    mode: ProviderMode,
    faults: HashMap<String, VecDeque<Behaviour>>,
    calls: Vec<Call>,
    applied: Vec<Applied>,
    in_progress: HashMap<String, usize>,
}

impl State {
    fn applied_number(&self, key: &str) -> Option<u64> {
        self.applied.iter().find(|a| a.key == key).map(|a| a.number)
    }
}

/// A provider on a free loopback port, stopped (every connection closed) when dropped.
#[derive(Debug)]
pub struct TestProvider {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    accept: JoinHandle<()>,
}

impl TestProvider {
    /// Listens on 127.0.0.1 at a free port.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub async fn start(mode: ProviderMode) -> io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            mode,
            faults: HashMap::new(),
            calls: Vec::new(),
            applied: Vec::new(),
            in_progress: HashMap::new(),
        }));
        let shared = Arc::clone(&state);
        let accept = tokio::spawn(async move {
            // Dropped with this task: every connection it serves is aborted with it.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            connections.spawn(serve(stream, Arc::clone(&shared)));
                        }
                        Err(_) => break,
                    },
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Ok(Self {
            addr,
            state,
            accept,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A client for it.
    pub fn client(&self) -> ProviderClient {
        ProviderClient { addr: self.addr }
    }

    /// Treats the next call with `key` that has no behaviour yet as `behaviour`: called `n`
    /// times, it sets the next `n` calls, in order; calls after those are normal.
    pub fn next_call(&self, key: &str, behaviour: Behaviour) {
        let mut state = self.state();
        state
            .faults
            .entry(key.to_owned())
            .or_default()
            .push_back(behaviour);
    }

    /// Effects applied for `key`: 1 is right, 2 a duplicate, 0 a loss.
    pub fn effects(&self, key: &str) -> usize {
        self.state().applied.iter().filter(|a| a.key == key).count()
    }

    /// Every applied effect, in order.
    pub fn applied(&self) -> Vec<Applied> {
        self.state().applied.clone()
    }

    /// Calls received with `key`, applied or not.
    pub fn calls(&self, key: &str) -> Vec<Call> {
        let state = self.state();
        state
            .calls
            .iter()
            .filter(|c| c.key == key)
            .cloned()
            .collect()
    }

    /// Calls being applied now (slow ones, say).
    pub fn in_progress(&self) -> usize {
        self.state().in_progress.values().sum()
    }

    /// Waits until at least `n` calls with `key` arrived; `false` after `timeout`.
    pub async fn wait_for_calls(&self, key: &str, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| {
            s.calls.iter().filter(|c| c.key == key).count() >= n
        })
        .await
    }

    /// Waits until no call is being applied; `false` after `timeout`.
    pub async fn wait_settled(&self, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.in_progress.values().all(|n| *n == 0))
            .await
    }

    /// Whether `done` holds of the state within `timeout`, looked at every 50 ms.
    async fn wait(&self, timeout: Duration, done: impl Fn(&State) -> bool) -> bool {
        eventually(timeout, || std::future::ready(done(&self.state()))).await
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

impl Drop for TestProvider {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A provider's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The HTTP status code.
    pub status: u16,
    /// The body, as text.
    pub body: String,
}

/// What `GET /status/<key>` said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallStatus {
    /// A call with the key was applied.
    Applied,
    /// A call with the key is being applied.
    Pending,
    /// No call with the key was applied.
    NotApplied,
}

/// A tiny HTTP/1.1 client for a [`TestProvider`]: one connection per request.
#[derive(Debug, Clone, Copy)]
pub struct ProviderClient {
    addr: SocketAddr,
}

impl ProviderClient {
    /// A client for the provider at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Self { addr }
    }

    /// `POST /effects` with `key` as `Idempotency-Key`, `token` as `Fencing-Token`, and `body`.
    /// Waits for the answer as long as it takes: bound it from outside.
    ///
    /// # Errors
    /// When the connection fails or closes before an answer (the outcome is then unknown).
    pub async fn call(&self, key: &str, token: u64, body: &[u8]) -> io::Result<Reply> {
        let head = format!(
            "POST /effects HTTP/1.1\r\nHost: {}\r\nIdempotency-Key: {key}\r\nFencing-Token: {token}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            body.len()
        );
        self.request(head.as_bytes(), body).await
    }

    /// `GET /status/<key>`.
    ///
    /// # Errors
    /// When the connection fails, or the provider has no status lookup (any answer but `200`).
    pub async fn status(&self, key: &str) -> io::Result<CallStatus> {
        let head = format!(
            "GET /status/{key} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        );
        let reply = self.request(head.as_bytes(), &[]).await?;
        match (reply.status, reply.body.as_str()) {
            (200, "applied") => Ok(CallStatus::Applied),
            (200, "pending") => Ok(CallStatus::Pending),
            (200, "none") => Ok(CallStatus::NotApplied),
            (status, body) => Err(io::Error::other(format!(
                "status lookup answered {status} {body:?}"
            ))),
        }
    }

    async fn request(&self, head: &[u8], body: &[u8]) -> io::Result<Reply> {
        let mut stream = TcpStream::connect(self.addr).await?;
        stream.write_all(head).await?;
        stream.write_all(body).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        let text = String::from_utf8_lossy(&answer);
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the provider closed the connection without answering",
            ));
        };
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| io::Error::other(format!("not an HTTP answer: {head:?}")))?;
        Ok(Reply {
            status,
            body: body.to_owned(),
        })
    }
}

/// A parsed request: method, path and the two headers the provider reads.
struct Request {
    method: String,
    path: String,
    key: Option<String>,
    token: u64,
}

async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>) {
    let Ok(Some(request)) = read_request(&mut stream).await else {
        return;
    };
    let (status, body) = match (request.method.as_str(), request.path.as_str()) {
        ("POST", "/effects") => match request.key {
            Some(key) => match apply(&state, key, request.token).await {
                Some(answer) => answer,
                // Applied and told not to answer; hang holds the connection until dropped.
                None => return,
            },
            None => (400, "no Idempotency-Key header".to_owned()),
        },
        ("GET", path) if path.starts_with("/status/") => {
            let key = &path["/status/".len()..];
            let state = lock(&state);
            if state.mode != ProviderMode::StatusLookup {
                (404, "no status lookup".to_owned())
            } else if state.applied_number(key).is_some() {
                (200, "applied".to_owned())
            } else if state.in_progress.get(key).is_some_and(|n| *n > 0) {
                (200, "pending".to_owned())
            } else {
                (200, "none".to_owned())
            }
        }
        _ => (404, "no such endpoint".to_owned()),
    };
    let answer = format!(
        "HTTP/1.1 {status} {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    );
    let _ = stream.write_all(answer.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// What the provider does with a call, decided under the lock.
enum Step {
    Answer(u16, String),
    /// The key was applied before: the first result, after the behaviour's delay.
    Replay(u64, Behaviour),
    Apply(Behaviour),
}

/// Applies one call; `None` when the answer is to be withheld.
async fn apply(state: &Mutex<State>, key: String, token: u64) -> Option<(u16, String)> {
    // Decided first: the lock is released before any wait.
    let step = decide(&mut lock(state), &key, token);
    let behaviour = match step {
        Step::Answer(status, body) => return Some((status, body)),
        Step::Replay(number, behaviour) => {
            if let Behaviour::Slow(delay) = behaviour {
                tokio::time::sleep(delay).await;
            }
            return Some((200, format!("effect {number}")));
        }
        Step::Apply(behaviour) => behaviour,
    };
    if let Behaviour::Slow(delay) = behaviour {
        tokio::time::sleep(delay).await;
    }
    let number = {
        let mut s = lock(state);
        if let Some(n) = s.in_progress.get_mut(&key) {
            *n -= 1;
        }
        let number = s.applied.len() as u64 + 1;
        s.applied.push(Applied { number, key, token });
        number
    };
    match behaviour {
        Behaviour::ApplyThenHang => {
            std::future::pending::<()>().await;
            None
        }
        Behaviour::ApplyThenClose => None,
        _ => Some((200, format!("effect {number}"))),
    }
}

fn decide(s: &mut State, key: &str, token: u64) -> Step {
    s.calls.push(Call {
        key: key.to_owned(),
        token,
    });
    let behaviour = s
        .faults
        .get_mut(key)
        .and_then(VecDeque::pop_front)
        .unwrap_or(Behaviour::Normal);
    if s.mode == ProviderMode::Keys {
        if let Some(number) = s.applied_number(key) {
            return Step::Replay(number, behaviour);
        }
        if s.in_progress.get(key).is_some_and(|n| *n > 0) {
            return Step::Answer(
                409,
                "a request with this idempotency key is in progress".into(),
            );
        }
    }
    if let Behaviour::Refuse(status) = behaviour {
        return Step::Answer(status, "refused".to_owned());
    }
    *s.in_progress.entry(key.to_owned()).or_default() += 1;
    Step::Apply(behaviour)
}

async fn read_request(stream: &mut TcpStream) -> io::Result<Option<Request>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        if buf.len() > 64 * 1024 {
            return Ok(None);
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let method = first.next().unwrap_or_default().to_owned();
    let path = first.next().unwrap_or_default().to_owned();
    let (mut key, mut token, mut length) = (None, 0, 0usize);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "idempotency-key" => key = Some(value.to_owned()),
            "fencing-token" => token = value.parse().unwrap_or(0),
            "content-length" => length = value.parse().unwrap_or(0),
            _ => {}
        }
    }
    // The body is read and dropped: effects are counted by key.
    let mut remaining = (buf.len() - head_end - 4).min(length);
    while remaining < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        remaining += n;
    }
    Ok(Some(Request {
        method,
        path,
        key,
        token,
    }))
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        409 => "Conflict",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        503 => "Service Unavailable",
        _ => "Status",
    }
}
