//! A Redis Cluster of a test's own: three masters and three replicas on free loopback ports,
//! each `redis-server` a [`Server`] in a directory of its own, killed and removed when the guard
//! drops (a panicking test included).
//!
//! It speaks to each node over a plain connection, so it needs no cluster client; the test's
//! source and producer reach the cluster through [`LocalCluster::urls`].

use std::time::{Duration, Instant};

use inbox_redis_streams::redis::{self, aio::MultiplexedConnection, Client};
use inbox_testkit::eventually;

use super::{redis_cli, start_server};
use crate::process::{free_ports, Server};

/// One node of the cluster as `CLUSTER NODES` lists it.
#[derive(Debug, Clone)]
struct NodeLine {
    id: String,
    port: u16,
    master: bool,
    failed: bool,
    /// The master's ID, for a replica.
    master_id: Option<String>,
    /// Slot ranges, inclusive.
    slots: Vec<(u16, u16)>,
}

/// The cluster's nodes. `REDIS_SERVER` and `REDIS_CLI` name the binaries, default
/// `redis-server` and `redis-cli` on the `PATH`.
#[derive(Debug)]
pub struct LocalCluster {
    nodes: Vec<Server>,
}

/// What every node runs with: a cluster node, persisting to its append-only file, and a node
/// timeout of 2 s (a master silent this long is marked failed and its replica takes over).
const NODE: &[&str] = &[
    "--cluster-enabled",
    "yes",
    "--cluster-node-timeout",
    "2000",
    "--appendonly",
    "yes",
];

impl LocalCluster {
    /// Starts six nodes, joins them as three masters with one replica each
    /// (`redis-cli --cluster create … --cluster-replicas 1`), and returns once every node says
    /// `cluster_state:ok` and every master has its replica in sync.
    ///
    /// # Panics
    /// When a binary is missing or the cluster does not form within 30 s.
    pub async fn start() -> Self {
        let mut cluster = Self { nodes: Vec::new() };
        for port in free_ports(6, 10_000) {
            cluster.nodes.push(start_server(port, None, NODE).await);
        }
        let create = ["--cluster", "create"].map(String::from);
        let nodes = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()));
        let replicas = ["--cluster-replicas", "1", "--cluster-yes"].map(String::from);
        let out = redis_cli(create.into_iter().chain(nodes).chain(replicas)).await;
        crate::child::succeeded(&out, "redis-cli --cluster create");
        let ready = eventually(Duration::from_secs(30), || cluster.healthy()).await;
        assert!(
            ready,
            "the cluster did not reach cluster_state:ok with synced replicas"
        );
        cluster
    }

    /// `redis://127.0.0.1:<port>` of every node started, the killed ones included (a client
    /// must cope with a seed node that is gone).
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port()))
            .collect()
    }

    /// Every live node says `cluster_state:ok`, every slot's master is live, and each master
    /// has a replica in sync.
    async fn healthy(&self) -> bool {
        if !self.state_ok().await {
            return false;
        }
        let Some(nodes) = self.nodes_view().await else {
            return false;
        };
        for master in nodes.iter().filter(|n| n.master && !n.slots.is_empty()) {
            if master.failed || !self.live().contains(&master.port) {
                return false;
            }
            let info: Option<String> =
                ask(master.port, redis::cmd("INFO").arg("replication")).await;
            if !info.is_some_and(|i| i.contains("state=online")) {
                return false;
            }
        }
        true
    }

    /// Ports of the nodes not killed.
    fn live(&self) -> Vec<u16> {
        let live = self.nodes.iter().filter(|n| n.is_running());
        live.map(Server::port).collect()
    }

    /// `CLUSTER NODES` as a live node sees it.
    async fn nodes_view(&self) -> Option<Vec<NodeLine>> {
        for port in self.live() {
            if let Some(text) = ask::<String>(port, redis::cmd("CLUSTER").arg("NODES")).await {
                return Some(text.lines().filter_map(parse_node_line).collect());
            }
        }
        None
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub async fn slot(&self, key: &str) -> u16 {
        for port in self.live() {
            if let Some(slot) = ask(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)).await {
                return slot;
            }
        }
        panic!("no live node answers CLUSTER KEYSLOT")
    }

    /// The port of the live master serving `key`'s slot, as the cluster sees it now; `None`
    /// while no live master has it (between a master's death and its replica's promotion).
    pub async fn master_of(&self, key: &str) -> Option<u16> {
        let slot = self.slot(key).await;
        let nodes = self.nodes_view().await?;
        nodes
            .iter()
            .find(|n| {
                n.master
                    && !n.failed
                    && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
                    && self.live().contains(&n.port)
            })
            .map(|n| n.port)
    }

    /// A plain connection to the master serving `key`, for looking at the stream there.
    ///
    /// # Panics
    /// When no live master serves it.
    pub async fn master_conn(&self, key: &str) -> MultiplexedConnection {
        let port = self
            .master_of(key)
            .await
            .unwrap_or_else(|| panic!("no live master serves {key}"));
        connect(port)
            .await
            .unwrap_or_else(|| panic!("the master on port {port} does not answer"))
    }

    /// `kill -9` of the node on `port`: no shutdown, no last write to its replica.
    pub fn kill(&mut self, port: u16) {
        self.node(port).kill();
    }

    fn node(&mut self, port: u16) -> &mut Server {
        let node = self.nodes.iter_mut().find(|n| n.port() == port);
        node.unwrap_or_else(|| panic!("no node on port {port}"))
    }

    /// Starts the node on `port` again, on its directory and `nodes.conf` (a killed master comes
    /// back as a replica of the one that replaced it), and waits until the cluster is whole
    /// again: every master with a replica in sync. Returns how long that took.
    ///
    /// # Panics
    /// When the cluster is not whole again within 30 s.
    pub async fn restart(&mut self, port: u16) -> Duration {
        let started = Instant::now();
        self.kill(port);
        self.node(port).spawn().await;
        let whole = eventually(Duration::from_secs(30), || self.healthy()).await;
        assert!(whole, "the node on port {port} did not rejoin as a replica");
        started.elapsed()
    }

    /// Waits until a master other than `old` serves `key` and every live node says
    /// `cluster_state:ok`; returns its port and how long that took from `since`.
    pub async fn wait_for_new_master(
        &self,
        key: &str,
        old: u16,
        since: Instant,
        limit: Duration,
    ) -> Option<(u16, Duration)> {
        while since.elapsed() < limit {
            if let Some(port) = self.master_of(key).await {
                if port != old && self.state_ok().await {
                    return Some((port, since.elapsed()));
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Every live node says `cluster_state:ok`.
    async fn state_ok(&self) -> bool {
        for port in self.live() {
            let info: Option<String> = ask(port, redis::cmd("CLUSTER").arg("INFO")).await;
            if !info.is_some_and(|i| i.contains("cluster_state:ok")) {
                return false;
            }
        }
        true
    }

    /// A manual failover of the master serving `key`: its replica asks to take over
    /// (`CLUSTER FAILOVER`), which waits until the replica has every write. Returns the new
    /// master's port once the cluster agrees.
    ///
    /// # Panics
    /// When the master has no live replica, or the failover does not happen within 20 s.
    pub async fn fail_over(&self, key: &str) -> u16 {
        let old = self.master_of(key).await.expect("a master serves the key");
        let nodes = self.nodes_view().await.expect("CLUSTER NODES");
        let master = nodes.iter().find(|n| n.port == old).expect("the master");
        let replica = nodes
            .iter()
            .find(|n| n.master_id.as_deref() == Some(master.id.as_str()) && !n.failed)
            .unwrap_or_else(|| panic!("the master on port {old} has no replica"));
        let mut conn = connect(replica.port).await.expect("the replica answers");
        let _: String = redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .query_async(&mut conn)
            .await
            .expect("CLUSTER FAILOVER");
        let (port, _) = self
            .wait_for_new_master(key, old, Instant::now(), Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("the replica on port {} did not take over", replica.port));
        port
    }
}

impl LocalCluster {
    /// Moves `key`'s slot, with every key in it, from its master to another master, as
    /// `redis-cli --cluster reshard` does: `CLUSTER SETSLOT … IMPORTING` on the target,
    /// `MIGRATING` on the source, `MIGRATE` of the slot's keys, then `SETSLOT … NODE` on every
    /// master. Returns the new master's port once the cluster agrees.
    ///
    /// # Panics
    /// When a step fails or the cluster does not agree within 20 s.
    pub async fn migrate(&self, key: &str) -> u16 {
        let slot = self.slot(key).await;
        let from = self.master_of(key).await.expect("a master serves the key");
        let nodes = self.nodes_view().await.expect("CLUSTER NODES");
        let masters: Vec<&NodeLine> = nodes.iter().filter(|n| n.master && !n.failed).collect();
        let source = masters.iter().find(|n| n.port == from).expect("the master");
        let target = masters
            .iter()
            .find(|n| n.port != from && !n.slots.is_empty())
            .expect("another master");
        let mut to = connect(target.port).await.expect("the target answers");
        let mut src = connect(from).await.expect("the source answers");
        let setslot = |state: &'static str, id: &str| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(state).arg(id);
            cmd
        };
        let _: () = setslot("IMPORTING", &source.id)
            .query_async(&mut to)
            .await
            .expect("SETSLOT IMPORTING");
        let _: () = setslot("MIGRATING", &target.id)
            .query_async(&mut src)
            .await
            .expect("SETSLOT MIGRATING");
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query_async(&mut src)
                .await
                .expect("GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let _: () = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(target.port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query_async(&mut src)
                .await
                .expect("MIGRATE");
        }
        for master in &masters {
            let mut conn = connect(master.port).await.expect("a master answers");
            let _: () = setslot("NODE", &target.id)
                .query_async(&mut conn)
                .await
                .expect("SETSLOT NODE");
        }
        let (port, _) = self
            .wait_for_new_master(key, from, Instant::now(), Duration::from_secs(20))
            .await
            .expect("the cluster agrees on the slot's new master");
        port
    }
}

/// A plain connection to the node on `port`, if it answers.
async fn connect(port: u16) -> Option<MultiplexedConnection> {
    let client = Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let connect = client.get_multiplexed_async_connection();
    tokio::time::timeout(Duration::from_secs(2), connect)
        .await
        .ok()?
        .ok()
}

/// `cmd`'s answer from the node on `port`, if it answers and the command succeeds.
async fn ask<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Option<T> {
    cmd.query_async(&mut connect(port).await?).await.ok()
}

/// `<id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch> <link> <slot>…`.
fn parse_node_line(line: &str) -> Option<NodeLine> {
    let mut parts = line.split_whitespace();
    let id = parts.next()?.to_owned();
    let addr = parts.next()?;
    let port = addr.split('@').next()?.rsplit(':').next()?.parse().ok()?;
    let flags = parts.next()?;
    let master_id = parts.next()?;
    let slots = parts
        .skip(4)
        .filter(|s| !s.starts_with('['))
        .filter_map(|s| match s.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => s.parse().ok().map(|a| (a, a)),
        })
        .collect();
    Some(NodeLine {
        id,
        port,
        master: flags.split(',').any(|f| f == "master"),
        failed: flags.split(',').any(|f| f == "fail" || f == "fail?"),
        master_id: (master_id != "-").then(|| master_id.to_owned()),
        slots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lines_parse() {
        let line = "07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,hostname4 \
                    slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected";
        let n = parse_node_line(line).expect("parses");
        assert_eq!(n.port, 30004);
        assert!(!n.master);
        assert!(n.master_id.is_some());
        let line = "e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 \
                    myself,master - 0 0 1 connected 0-5460 5462 [5461->-abc]";
        let n = parse_node_line(line).expect("parses");
        assert!(n.master && !n.failed);
        assert_eq!(n.slots, [(0, 5460), (5462, 5462)]);
    }
}
