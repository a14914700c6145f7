//! The broker's application stopped and started again (`rabbitmqctl stop_app`, `start_app`): the
//! quorum queues survive, every client connection is closed.

use std::time::Duration;

use super::admin::rabbitmqctl;
use crate::Restart;

/// How long the application stays down.
const DOWN: Duration = Duration::from_secs(3);

/// The broker at `AMQP_URL`, restarted with `rabbitmqctl`; started again when dropped in the
/// middle of a restart, so a failing test does not leave it down for every test after it.
#[derive(Debug, Default)]
pub(super) struct App {
    down: bool,
}

impl Restart for App {
    fn restart(&mut self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            // Marked down before the stop: a stop that fails half-way is undone too.
            self.down = true;
            rabbitmqctl(&["stop_app"]).await;
            tokio::time::sleep(DOWN).await;
            rabbitmqctl(&["start_app"]).await;
            self.down = false;
        })
    }
}

impl Drop for App {
    fn drop(&mut self) {
        if self.down {
            // Blocking is fine here: the test is failing, and the broker must come back
            // whatever state the runtime is in.
            let status = std::process::Command::new("rabbitmqctl")
                .arg("start_app")
                .status();
            eprintln!("broker restart: start_app after a failure: {status:?}");
        }
    }
}
