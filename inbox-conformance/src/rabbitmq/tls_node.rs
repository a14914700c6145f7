//! A RabbitMQ node of the test's own that takes TLS only: a second node beside the shared broker
//! (`inbox_tls@localhost`, its own data directory, no plugins), listening with `amqps` alone on a
//! free port, with a certificate from a [`TestCa`]. Started as the `rabbitmq` user, which holds
//! the Erlang cookie; stopped on drop.

use std::path::Path;
use std::time::Duration;

use crate::pg_cluster::run;
use crate::process::{free_ports, listens};
use crate::tls::TestCa;
use crate::unique_name;

/// The node; stopped on drop.
#[derive(Debug)]
pub struct TlsNode {
    name: String,
    port: u16,
}

impl TlsNode {
    /// Starts a node serving `amqps` only on a free port with `ca`'s server certificate, and
    /// waits until it listens.
    ///
    /// # Errors
    /// Without root, the `rabbitmq` user or RabbitMQ's scripts (`cargo xtask services` installs
    /// them), or when the node does not listen within 60 s.
    pub async fn start(ca: &TestCa) -> Result<Self, String> {
        let [port, dist_port] = free_ports(2, 0)[..] else {
            unreachable!("free_ports returns as many as asked")
        };
        let dir = ca.dir.join(unique_name("rabbitmq"));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let path = |p: &Path| p.display().to_string();
        let conf = dir.join("rabbitmq.conf");
        let settings = format!(
            "listeners.tcp = none\n\
             listeners.ssl.default = {port}\n\
             ssl_options.cacertfile = {}\n\
             ssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\n\
             ssl_options.verify = verify_none\n\
             ssl_options.fail_if_no_peer_cert = false\n",
            path(&ca.ca),
            path(&ca.cert),
            path(&ca.key),
        );
        std::fs::write(&conf, settings).map_err(|e| format!("cannot write {conf:?}: {e}"))?;
        let plugins = dir.join("enabled_plugins");
        std::fs::write(&plugins, "[].\n").map_err(|e| format!("cannot write {plugins:?}: {e}"))?;
        ca.give_to("rabbitmq")?;
        let name = format!("{}@localhost", unique_name("inbox_tls"));
        let start = format!(
            "env RABBITMQ_NODENAME={name} RABBITMQ_DIST_PORT={dist_port} \
             RABBITMQ_CONFIG_FILE={conf} RABBITMQ_ENABLED_PLUGINS_FILE={plugins} \
             RABBITMQ_MNESIA_BASE={dir}/mnesia RABBITMQ_LOG_BASE={dir}/log \
             /usr/lib/rabbitmq/bin/rabbitmq-server -detached",
            conf = path(&conf),
            plugins = path(&plugins),
            dir = path(&dir),
        );
        run("su", &["rabbitmq", "-s", "/bin/sh", "-c", &start])?;
        let node = Self { name, port };
        if !listens(port, Duration::from_secs(60)).await {
            return Err(format!("the TLS node did not listen on {port} within 60 s"));
        }
        Ok(node)
    }

    /// The port of its `amqps` listener.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for TlsNode {
    fn drop(&mut self) {
        let stop = format!("rabbitmqctl -n {} stop", self.name);
        let _ = run("su", &["rabbitmq", "-s", "/bin/sh", "-c", &stop]);
    }
}
