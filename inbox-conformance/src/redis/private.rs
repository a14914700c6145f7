//! A `redis-server` of a scenario's own, which it may restart: every write is persisted to its
//! append-only file, so the stream and its group come back with it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use inbox_redis_streams::redis::{self, Client};
use inbox_testkit::eventually;

use crate::Restart;

/// Killed when dropped (a panicking test included), its directory removed. `REDIS_SERVER`
/// names the binary, default `redis-server` on the `PATH`.
#[derive(Debug)]
pub(super) struct PrivateRedis {
    port: u16,
    dir: PathBuf,
    process: Option<Child>,
}

impl PrivateRedis {
    pub(super) async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let dir = std::env::temp_dir().join(crate::unique_name("inbox-redis"));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let mut server = Self {
            port,
            dir,
            process: None,
        };
        server.spawn().await;
        server
    }

    pub(super) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn client(&self) -> Client {
        Client::open(self.url()).expect("the server's URL")
    }

    /// Starts the server on its port and directory and waits for it to answer.
    async fn spawn(&mut self) {
        let server = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&server)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--save", ""])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {server}: {e}; install Redis or set REDIS_SERVER")
            });
        self.process = Some(child);
        let client = self.client();
        let up = eventually(Duration::from_secs(10), || async {
            let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                return false;
            };
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .is_ok()
        })
        .await;
        assert!(
            up,
            "the private redis-server did not answer on {}",
            self.port
        );
    }
}

impl Restart for PrivateRedis {
    /// `SHUTDOWN` (Redis closes every client and exits, its append-only file complete), 2 s
    /// down, then the same server again.
    fn restart(&mut self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let mut conn = self
                .client()
                .get_multiplexed_async_connection()
                .await
                .expect("the private redis-server");
            let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN").query_async(&mut conn).await;
            let process = self.process.as_mut().expect("the server runs");
            let exited = eventually(Duration::from_secs(10), || {
                let done = matches!(process.try_wait(), Ok(Some(_)));
                async move { done }
            })
            .await;
            assert!(exited, "redis-server did not exit after SHUTDOWN");
            self.process = None;
            tokio::time::sleep(Duration::from_secs(2)).await;
            self.spawn().await;
        })
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
