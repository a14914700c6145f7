//! Servers a test starts as processes of its own on free loopback ports: killed when dropped (a
//! panicking test included), their directory removed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use inbox_testkit::eventually;

/// A free loopback port.
///
/// # Panics
/// When no loopback port can be bound.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Whether something listens on loopback `port` within `limit`.
pub(crate) async fn listens(port: u16, limit: Duration) -> bool {
    eventually(limit, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await
}

/// How a [`Server`] is started: the command for its port and directory.
type Launch = Box<dyn Fn(u16, &Path) -> Command + Send + Sync>;

/// A server process listening on loopback `port`, with a directory of its own that outlives a
/// [`restart`](Server::restart). Its stdin and stdout are closed.
pub(crate) struct Server {
    port: u16,
    dir: PathBuf,
    launch: Launch,
    /// What the server is, for messages: the binary and how to get it.
    what: String,
    process: Option<Child>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("what", &self.what)
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish()
    }
}

impl Server {
    /// Starts `launch(port, dir)` on a free port with a fresh directory named after `name`, and
    /// waits until it listens; `what` names the server and how to install it, for the panics.
    ///
    /// # Panics
    /// When the server cannot be started or does not listen within 10 s.
    pub(crate) async fn start(
        name: &str,
        what: &str,
        launch: impl Fn(u16, &Path) -> Command + Send + Sync + 'static,
    ) -> Self {
        let dir = std::env::temp_dir().join(crate::unique_name(name));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let mut server = Self {
            port: free_port(),
            dir,
            launch: Box::new(launch),
            what: what.to_owned(),
            process: None,
        };
        server.spawn().await;
        server
    }

    /// The port it listens on.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    async fn spawn(&mut self) {
        let child = (self.launch)(self.port, &self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.what));
        self.process = Some(child);
        assert!(
            listens(self.port, Duration::from_secs(10)).await,
            "{} did not listen on {}",
            self.what,
            self.port
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl crate::Restart for Server {
    /// SIGTERM (the server closes its clients and its store and exits), 2 s down, then the same
    /// server on the same port and directory again; returns once it listens.
    fn restart(&mut self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let process = self.process.as_mut().expect("the server runs");
            let stopped = Command::new("kill")
                .args(["-TERM", &process.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(stopped, "cannot send SIGTERM to {}", self.what);
            let exited = eventually(Duration::from_secs(10), || {
                let done = matches!(process.try_wait(), Ok(Some(_)));
                async move { done }
            })
            .await;
            assert!(exited, "{} did not exit after SIGTERM", self.what);
            self.process = None;
            tokio::time::sleep(Duration::from_secs(2)).await;
            self.spawn().await;
        })
    }
}
