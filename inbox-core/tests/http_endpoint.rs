//! The probe endpoint over real TCP: readiness follows the consumer from starting to stopped,
//! probes are answered side by side, malformed and oversized requests get their status, and the
//! server stops when told.

use std::net::SocketAddr;
use std::time::Duration;

use inbox_core::http::Endpoint;
use inbox_core::{async_trait, Consumer, Handler, HandlerError, Message, MessageId};
use inbox_testkit::{MemoryBroker, MemoryStore, MemoryTx};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

struct Add;

#[async_trait]
impl Handler<MemoryTx<i64>> for Add {
    async fn handle(
        &self,
        tx: &mut MemoryTx<i64>,
        _id: &MessageId,
        message: &Message,
    ) -> Result<(), HandlerError> {
        *tx.state_mut() += message.json::<i64>()?;
        Ok(())
    }
}

struct Reply {
    status: u16,
    head: String,
    body: String,
}

/// Sends `request` as is and reads the whole reply (the server closes after it).
async fn send(addr: SocketAddr, request: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connects");
    stream.write_all(request).await.expect("sends");
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut reply))
        .await
        .expect("the server answers and closes")
        .expect("reads");
    let reply = String::from_utf8(reply).expect("UTF-8 reply");
    let (head, body) = reply.split_once("\r\n\r\n").expect("a complete head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|n| n.parse().ok())
        .expect("a Content-Length");
    if !request.starts_with(b"HEAD") {
        assert_eq!(body.len(), length, "Content-Length matches the body");
    }
    Reply {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n").as_bytes(),
    )
    .await
}

#[tokio::test]
async fn probes_follow_the_consumer_and_bad_requests_are_refused() {
    let broker = MemoryBroker::new();
    broker.publish(Some("a"), "5");
    let store = MemoryStore::<i64>::new();
    let consumer = Consumer::new("probed", broker.source(), store.clone(), Add);
    let stats = consumer.stats();
    let server = Endpoint::new()
        .consumer(consumer.health())
        .metrics(move || {
            format!(
                "# TYPE probed_applied counter\nprobed_applied {}\n",
                stats.snapshot().applied
            )
        })
        .bind("127.0.0.1:0")
        .await
        .expect("binds");
    let addr = server.local_addr().expect("an address");
    let (stop_server, server_stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.run_until(async {
        let _ = server_stopped.await;
    }));

    // Built, not running: live, not ready.
    let reply = get(addr, "/readyz").await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert!(reply.body.contains("starting"), "{}", reply.body);
    assert_eq!(get(addr, "/healthz").await.status, 200);

    let (stop_consumer, consumer_stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run_until(async {
        let _ = consumer_stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while get(addr, "/readyz").await.status != 200 {
        assert!(tokio::time::Instant::now() < deadline, "never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while store.state().await != 5 {
        assert!(tokio::time::Instant::now() < deadline, "never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Many probes at once, each on its own connection.
    let probes: Vec<_> = (0..40)
        .map(|i| {
            let path = ["/healthz", "/readyz", "/metrics"][i % 3];
            tokio::spawn(async move { get(addr, path).await.status })
        })
        .collect();
    for probe in probes {
        assert_eq!(probe.await.expect("probe task"), 200);
    }

    let metrics = get(addr, "/metrics?name[]=x").await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics
            .head
            .contains("Content-Type: text/plain; version=0.0.4"),
        "{}",
        metrics.head
    );
    assert!(
        metrics.body.contains("probed_applied 1\n"),
        "{}",
        metrics.body
    );

    let head = send(addr, b"HEAD /readyz HTTP/1.1\r\n\r\n").await;
    assert_eq!(head.status, 200);
    assert!(head.head.contains("Content-Length: 6"), "{}", head.head);
    assert_eq!(head.body, "", "HEAD has no body");

    let post = send(
        addr,
        b"POST /readyz HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await;
    assert_eq!(post.status, 405);
    assert!(post.head.contains("Allow: GET, HEAD"), "{}", post.head);
    assert_eq!(get(addr, "/nothing-here").await.status, 404);
    assert_eq!(send(addr, b"GET /readyz\r\n\r\n").await.status, 400);
    let huge = format!("GET /readyz HTTP/1.1\r\nX-Filler: {}\r\n", "x".repeat(9000));
    assert_eq!(send(addr, huge.as_bytes()).await.status, 431);
    // A client using bare line feeds is still understood.
    assert_eq!(send(addr, b"GET /healthz HTTP/1.0\n\n").await.status, 200);

    // Stopped: neither live nor ready.
    let _ = stop_consumer.send(());
    running.await.expect("consumer task").expect("consumer ran");
    let ready = get(addr, "/readyz").await;
    assert_eq!(ready.status, 503);
    assert!(ready.body.contains("probed stopped"), "{}", ready.body);
    assert_eq!(get(addr, "/healthz").await.status, 503);

    // The server stops with the application.
    let _ = stop_server.send(());
    serving.await.expect("server task");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "the listener is closed"
    );
}

#[tokio::test]
async fn an_endpoint_without_a_renderer_has_no_metrics() {
    let server = Endpoint::new().bind("127.0.0.1:0").await.expect("binds");
    let addr = server.local_addr().expect("an address");
    let serving = tokio::spawn(server.run_until(std::future::pending()));
    assert_eq!(get(addr, "/metrics").await.status, 404);
    // No consumer to wait for: both probes pass.
    assert_eq!(get(addr, "/readyz").await.status, 200);
    assert_eq!(get(addr, "/healthz").await.status, 200);
    serving.abort();
}
