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
    free_ports(1, 0)[0]
}

/// `n` distinct loopback ports `p` that are free, each with `p + companion` free as well (a
/// Redis Cluster node's bus port is its port plus 10,000; 0 for none).
///
/// The ports come from below the kernel's ephemeral range, so no outgoing connection of another
/// test can take one between this check and the server's bind (a port the kernel handed out for
/// `bind(0)` can: that is how a cluster node once failed to start).
///
/// # Panics
/// When no such ports are found in 10,000 tries.
pub(crate) fn free_ports(n: usize, companion: u16) -> Vec<u16> {
    let top = ephemeral_low()
        .saturating_sub(companion)
        .max(FIRST_PORT + 1);
    let mut ports: Vec<u16> = Vec::with_capacity(n);
    for _ in 0..10_000 {
        if ports.len() == n {
            break;
        }
        let port = rand::random_range(FIRST_PORT..top);
        let taken = |p: u16| ports.iter().any(|&q| q == p || q + companion == p);
        if taken(port) || (companion > 0 && taken(port + companion)) {
            continue;
        }
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && (companion == 0 || free(port + companion)) {
            ports.push(port);
        }
    }
    assert_eq!(
        ports.len(),
        n,
        "no {n} free loopback ports below the ephemeral range"
    );
    ports
}

/// The lowest port a test server takes: above the well-known and most registered services'.
const FIRST_PORT: u16 = 10_000;

/// The first port of the kernel's ephemeral range (`ip_local_port_range`), 32768 when it
/// cannot be read.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
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
    /// Starts `launch(port, dir)` on loopback `port` ([`free_port`], say) with a fresh directory
    /// named after `name`, and waits until it listens; `what` names the server and how to
    /// install it, for the panics.
    ///
    /// # Panics
    /// When the server cannot be started or does not listen within 10 s.
    pub(crate) async fn start(
        port: u16,
        name: &str,
        what: &str,
        launch: impl Fn(u16, &Path) -> Command + Send + Sync + 'static,
    ) -> Self {
        let dir = std::env::temp_dir().join(crate::unique_name(name));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let mut server = Self {
            port,
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

    /// Whether it runs: started and not [`kill`](Server::kill)ed since.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn is_running(&self) -> bool {
        self.process.is_some()
    }

    /// Starts the server (again) on its port and directory; returns once it listens.
    ///
    /// # Panics
    /// When it cannot be started, or does not listen within 10 s: with the end of its log
    /// (`*.log` in its directory), if it wrote one.
    pub(crate) async fn spawn(&mut self) {
        let child = (self.launch)(self.port, &self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.what));
        self.process = Some(child);
        if !listens(self.port, Duration::from_secs(10)).await {
            let logs = std::fs::read_dir(&self.dir).into_iter().flatten().flatten();
            let log = logs
                .map(|entry| entry.path())
                .filter(|path| path.extension().is_some_and(|e| e == "log"))
                .filter_map(|path| std::fs::read_to_string(path).ok())
                .collect::<String>();
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "{} did not listen on {}; its log ends:\n{}",
                self.what,
                self.port,
                tail.join("\n")
            );
        }
    }

    /// `kill -9`: no shutdown, no last write.
    pub(crate) fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_below_the_ephemeral_range_with_their_companions_free() {
        let low = ephemeral_low();
        let ports = free_ports(6, 10_000);
        assert_eq!(ports.len(), 6);
        for &p in &ports {
            assert!(
                p >= FIRST_PORT && p + 10_000 < low,
                "{p} (bus {})",
                p + 10_000
            );
            assert!(std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok());
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 6);
    }
}
