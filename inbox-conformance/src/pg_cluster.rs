//! A PostgreSQL cluster of a test's own, for what the shared server must not see: a restart,
//! TLS only, a standby. Made with Debian's `pg_createcluster` when missing (user `postgres`,
//! password `postgres`, database `inbox`), given the test's settings each time, started when
//! stopped, and stopped again on drop if the test started it. Without root and Debian's cluster
//! tools (a managed database, another OS) [`PgCluster::up`] says why, and the test skips.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

/// A cluster of the test's own (see the module docs).
#[derive(Debug)]
pub struct PgCluster {
    version: String,
    name: String,
    port: u16,
    started_here: bool,
}

/// What a test asks of its cluster.
#[derive(Debug, Default, Clone)]
pub struct ClusterSettings {
    /// `postgresql.conf` lines (`name = value`), written to the cluster's `conf.d`.
    pub conf: Vec<String>,
    /// The whole `pg_hba.conf`, or `None` for Debian's.
    pub hba: Option<String>,
}

impl PgCluster {
    /// The cluster `name` on the port in the environment variable `port_var` (or
    /// `default_port`), created, configured with `settings` and started as needed; `Err` says
    /// why it cannot be done here.
    ///
    /// # Errors
    /// Without root or Debian's cluster tools, or when the cluster listens on another port.
    pub fn up(
        name: &str,
        port_var: &str,
        default_port: u16,
        settings: &ClusterSettings,
    ) -> Result<Self, String> {
        let port = port_of(port_var, default_port);
        let clusters = clusters()?;
        let version = clusters
            .first()
            .map(|f| f[0].to_owned())
            .ok_or("pg_lsclusters lists no cluster to take the version from")?;
        let mut cluster = Self {
            version,
            name: name.to_owned(),
            port,
            started_here: false,
        };
        match clusters.iter().find(|f| f[1] == name) {
            Some(f) if f[2] != port.to_string() => {
                return Err(format!(
                    "cluster {name} listens on {}, not {port_var}={port}",
                    f[2]
                ))
            }
            Some(f) => {
                cluster.configure(settings)?;
                if f[3] == "online" {
                    cluster.ctl("reload")?;
                } else {
                    cluster.ctl("start")?;
                    cluster.started_here = true;
                }
            }
            None => {
                let port = port.to_string();
                run(
                    "pg_createcluster",
                    &[&cluster.version, name, "--port", &port, "--start"],
                )?;
                cluster.started_here = true;
                for sql in [
                    "ALTER USER postgres PASSWORD 'postgres'",
                    "CREATE DATABASE inbox",
                ] {
                    cluster.psql(sql)?;
                }
                cluster.configure(settings)?;
                cluster.ctl("reload")?;
            }
        }
        Ok(cluster)
    }

    /// [`PgCluster::up`] on a new cluster: one of that name left by an earlier run is dropped
    /// first, data and all.
    ///
    /// # Errors
    /// As [`PgCluster::up`], or when the old cluster cannot be dropped.
    pub fn fresh(
        name: &str,
        port_var: &str,
        default_port: u16,
        settings: &ClusterSettings,
    ) -> Result<Self, String> {
        drop_cluster(name)?;
        Self::up(name, port_var, default_port, settings)
    }

    /// A new streaming standby of `primary` (dropped first if it exists), copied with
    /// `pg_basebackup` and connecting as `application_name` `name` (what
    /// `synchronous_standby_names` names), started. It reaches the primary at `primary_port`
    /// on loopback: the primary's own port, or a proxy's in front of it, to slow or cut the
    /// replication link.
    ///
    /// # Errors
    /// When a step fails.
    pub fn standby_of(
        primary: &PgCluster,
        primary_port: u16,
        name: &str,
        port_var: &str,
        default_port: u16,
    ) -> Result<Self, String> {
        drop_cluster(name)?;
        let port = port_of(port_var, default_port);
        let version = primary.version.clone();
        run(
            "pg_createcluster",
            &[&version, name, "--port", &port.to_string()],
        )?;
        let data = format!("/var/lib/postgresql/{version}/{name}");
        std::fs::remove_dir_all(&data).map_err(|e| format!("cannot empty {data}: {e}"))?;
        let conninfo = format!(
            "host=127.0.0.1 port={primary_port} user=postgres password=postgres \
             application_name={name}"
        );
        let copy = format!("pg_basebackup -d '{conninfo}' -D {data} -R -X stream -c fast");
        run("su", &["postgres", "-c", &copy])?;
        let standby = Self {
            version,
            name: name.to_owned(),
            port,
            started_here: true,
        };
        standby.ctl("start")?;
        Ok(standby)
    }

    /// Stops the server at once, as a crash would (`immediate` mode: no checkpoint, sessions
    /// dropped, the next start recovers from the WAL).
    ///
    /// # Panics
    /// When `pg_ctlcluster` fails.
    pub fn crash(&self) {
        self.ctl_with(&["--mode", "immediate"], "stop")
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Promotes a standby to primary.
    ///
    /// # Panics
    /// When `pg_ctlcluster` fails.
    pub fn promote(&self) {
        self.ctl("promote").unwrap_or_else(|e| panic!("{e}"));
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres:postgres@<host>:<port>/inbox`, then `query` after a `?` if any.
    pub fn url(&self, host: &str, query: &str) -> String {
        let mut url = format!("postgres://postgres:postgres@{host}:{}/inbox", self.port);
        if !query.is_empty() {
            let _ = write!(url, "?{query}");
        }
        url
    }

    /// Restarts the server: fast shutdown (sessions terminated, transactions rolled back), start.
    ///
    /// # Panics
    /// When `pg_ctlcluster` fails.
    pub fn restart(&self) {
        self.ctl_with(&["--mode", "fast"], "restart")
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// The directory holding the cluster's configuration.
    fn config_dir(&self) -> PathBuf {
        PathBuf::from(format!("/etc/postgresql/{}/{}", self.version, self.name))
    }

    fn configure(&self, settings: &ClusterSettings) -> Result<(), String> {
        let dir = self.config_dir();
        let conf = dir.join("conf.d").join("inbox-test.conf");
        std::fs::write(&conf, settings.conf.join("\n") + "\n")
            .map_err(|e| format!("cannot write {}: {e}", conf.display()))?;
        if let Some(hba) = &settings.hba {
            let path = dir.join("pg_hba.conf");
            std::fs::write(&path, hba)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        }
        Ok(())
    }

    fn psql(&self, sql: &str) -> Result<(), String> {
        let command = format!("psql -p {} -qc \"{sql}\"", self.port);
        run("su", &["postgres", "-c", &command])
    }

    fn ctl(&self, action: &str) -> Result<(), String> {
        self.ctl_with(&[], action)
    }

    fn ctl_with(&self, options: &[&str], action: &str) -> Result<(), String> {
        let mut args = options.to_vec();
        args.extend([self.version.as_str(), self.name.as_str(), action]);
        run("pg_ctlcluster", &args)
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.started_here {
            let _ = self.ctl("stop");
        }
    }
}

/// The port in the environment variable `port_var`, or `default_port`.
fn port_of(port_var: &str, default_port: u16) -> u16 {
    let port = std::env::var(port_var).ok().and_then(|p| p.parse().ok());
    port.unwrap_or(default_port)
}

/// The clusters `pg_lsclusters` lists, each as its fields (version, name, port, status, ...);
/// `Err` without root or Debian's cluster tools.
fn clusters() -> Result<Vec<Vec<String>>, String> {
    if output("id", &["-u"])?.trim() != "0" {
        return Err("needs root to run pg_createcluster and pg_ctlcluster".into());
    }
    let listing = output("pg_lsclusters", &["--no-header"])?;
    let fields = listing
        .lines()
        .map(|l| l.split_whitespace().map(str::to_owned));
    Ok(fields.map(Vec::from_iter).filter(|f| f.len() > 3).collect())
}

/// Drops the cluster `name` of each version `pg_lsclusters` lists, if it exists.
fn drop_cluster(name: &str) -> Result<(), String> {
    for fields in clusters()? {
        if fields[1] == name {
            run("pg_dropcluster", &["--stop", &fields[0], name])?;
            // pg_dropcluster leaves the files it did not make (the tests' settings in conf.d),
            // which a new cluster of the name would pick up.
            let config = format!("/etc/postgresql/{}/{name}", fields[0]);
            if std::path::Path::new(&config).exists() {
                std::fs::remove_dir_all(&config)
                    .map_err(|e| format!("cannot remove {config}: {e}"))?;
            }
        }
    }
    Ok(())
}

pub(crate) fn output(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn run(program: &str, args: &[&str]) -> Result<(), String> {
    output(program, args).map(drop)
}
