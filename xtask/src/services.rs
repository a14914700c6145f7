//! Bringing up the services the tests and the demo talk to.
//!
//! Each address comes from the same environment variable the code reads, with the same local
//! default. Only a service whose address is on this machine and not listening is installed and
//! started; a remote address is only checked.

use std::fs::File;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

type Result<T = (), E = String> = std::result::Result<T, E>;

/// Installs what is missing and starts what is not running. Building Tansu is by far the longest
/// install (several minutes of compiling), so it starts first, in the background, and `beside` (a
/// cargo command such as the workspace build) runs next to it and the other installs.
pub(crate) fn up(beside: Option<&[&str]>) -> Result {
    let tansu = tansu_build()?;
    let beside = beside.map(crate::Background::cargo).transpose()?;
    test_tools()?;
    python_clients()?;
    postgres()?;
    pgbouncer()?;
    pgbouncer_prepared()?;
    mariadb()?;
    redis()?;
    nats()?;
    rabbitmq()?;
    sqs()?;
    if let Some(beside) = beside {
        beside.wait()?;
    }
    if let Some(tansu) = tansu {
        tansu.wait()?;
    }
    kafka()
}

/// cargo-nextest, which `cargo xtask test` runs the tests with: installed from crates.io when
/// missing (machines of this project's kind ship it).
pub(crate) fn nextest() -> Result {
    if quiet("cargo", &["nextest", "--version"]) {
        return Ok(());
    }
    run("cargo", &["install", "cargo-nextest", "--locked"])
}

/// What the tests use beside the services: `openssl` makes their throw-away certificate
/// authorities, `socat` serves TLS in front of their own Kafka broker (Tansu has none), and
/// `promtool` (in Debian's `prometheus` package) checks and unit-tests the alert rules.
fn test_tools() -> Result {
    let missing: Vec<&str> = [
        ("openssl", "openssl"),
        ("socat", "socat"),
        ("promtool", "prometheus"),
    ]
    .into_iter()
    .filter(|(tool, _)| !have(tool))
    .map(|(_, package)| package)
    .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let prometheus_before = listening("127.0.0.1", PROMETHEUS_PORT);
    apt_install(&missing)?;
    if missing.contains(&"prometheus") && !prometheus_before {
        no_prometheus_server()?;
    }
    Ok(())
}

/// The port of the server Debian's `prometheus` package runs.
const PROMETHEUS_PORT: u16 = 9090;

/// Only `promtool` is wanted from the `prometheus` package, but its install starts and enables
/// the server where an init system lets it (under systemd; a container's `policy-rc.d` refuses):
/// that server is stopped and disabled again. A server that listened before the install is not
/// the package's doing and is left alone.
fn no_prometheus_server() -> Result {
    if Path::new("/run/systemd/system").is_dir() {
        run("systemctl", &["disable", "--now", "--quiet", "prometheus"])?;
    } else if quiet("invoke-rc.d", &["prometheus", "status"]) {
        run("invoke-rc.d", &["prometheus", "stop"])?;
        run("update-rc.d", &["prometheus", "disable"])?;
    }
    // The server binds a moment after its start; give it that moment before looking.
    sleep(Duration::from_secs(1));
    if listening("127.0.0.1", PROMETHEUS_PORT) {
        return Err(format!(
            "a Prometheus server listens on 127.0.0.1:{PROMETHEUS_PORT} since the prometheus \
             package (for promtool) was installed; stop it (`systemctl disable --now prometheus` \
             or `invoke-rc.d prometheus stop`)"
        ));
    }
    Ok(())
}

/// Each broker's standard Python client (confluent-kafka, pika, boto3, redis-py), which the
/// foreign-ID tests publish with, in the virtual environment `inbox_conformance::python` uses:
/// `INBOX_PYTHON_CLIENTS`, else `~/.cache/inbox/python-clients` (under `XDG_CACHE_HOME` when
/// set). It holds a copy of `inbox-conformance/python/requirements.txt`; a changed list installs
/// again.
fn python_clients() -> Result {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let requirements = root.join("inbox-conformance/python/requirements.txt");
    let wanted = std::fs::read_to_string(&requirements)
        .map_err(|e| format!("cannot read {}: {e}", requirements.display()))?;
    let dir = match std::env::var_os("INBOX_PYTHON_CLIENTS").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .ok_or("neither INBOX_PYTHON_CLIENTS, XDG_CACHE_HOME nor HOME is set")?
            .join("inbox/python-clients"),
    };
    let stamp = dir.join("requirements.txt");
    let python = dir.join("bin/python");
    if python.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(());
    }
    if !quiet("python3", &["-m", "venv", "--help"]) {
        apt_install(&["python3-venv"])?;
    }
    let text = |p: &Path| p.to_str().map(str::to_owned).ok_or("a path is not UTF-8");
    eprintln!(
        "services: installing the Python clients into {}",
        dir.display()
    );
    run("python3", &["-m", "venv", &text(&dir)?])?;
    run(
        &text(&python)?,
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
            &text(&requirements)?,
        ],
    )?;
    std::fs::write(&stamp, wanted).map_err(|e| format!("cannot write {}: {e}", stamp.display()))
}

/// The Kafka-protocol broker the demo talks to.
pub(crate) enum DemoKafka {
    /// One listens already, or Tansu is installed and was started.
    Ready,
    /// None listens on the local default address and Tansu is not built: the demo runs on
    /// librdkafka's mock cluster instead of waiting for Tansu to compile.
    Mock,
}

/// Brings up the demo's services, with `beside` (the evidence tool's build) running next to the
/// installs. Unlike [`up`], it does not build Tansu when it is missing.
pub(crate) fn up_for_demo(beside: &[&str]) -> Result<DemoKafka> {
    let beside = crate::Background::cargo(beside)?;
    postgres()?;
    redis()?;
    rabbitmq()?;
    sqs()?;
    beside.wait()?;
    if tansu_build_needed()? {
        Ok(DemoKafka::Mock)
    } else {
        kafka().map(|()| DemoKafka::Ready)
    }
}

/// `host:port` of a URL such as `scheme://user:pass@host:port/path`.
fn host_port(url: &str, default_port: u16) -> (String, u16) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split(['/', '?']).next().unwrap_or(rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(']') || host.starts_with('[') => {
            (host.to_owned(), port.parse().unwrap_or(default_port))
        }
        _ => (rest.to_owned(), default_port),
    }
}

fn listening(host: &str, port: u16) -> bool {
    let Ok(addrs) = (host, port).to_socket_addrs() else {
        return false;
    };
    addrs
        .into_iter()
        .any(|a: SocketAddr| TcpStream::connect_timeout(&a, Duration::from_millis(500)).is_ok())
}

fn is_local(host: &str) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1" | "[::1]")
}

fn wait_for(name: &str, host: &str, port: u16, limit: Duration) -> Result {
    let start = Instant::now();
    while start.elapsed() < limit {
        if listening(host, port) {
            eprintln!("services: {name} is up on {host}:{port}");
            return Ok(());
        }
        sleep(Duration::from_millis(250));
    }
    Err(format!(
        "{name} did not start listening on {host}:{port} within {limit:?}"
    ))
}

/// Whether a service must be started: false when it listens already (reused) and an error when
/// it is remote and down.
fn needs_start(name: &str, var: &str, host: &str, port: u16) -> Result<bool> {
    if listening(host, port) {
        eprintln!("services: {name} already listens on {host}:{port}; reusing it");
        return Ok(false);
    }
    if !is_local(host) {
        return Err(format!(
            "{name} at {host}:{port} (from {var}) does not answer, and it is not on this machine"
        ));
    }
    Ok(true)
}

fn run(program: &str, args: &[&str]) -> Result {
    let status = Command::new(program)
        .args(args)
        .status()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{program} {} failed ({status})", args.join(" ")))
    }
}

fn quiet(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn have(program: &str) -> bool {
    which(program).is_some()
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn apt_install(packages: &[&str]) -> Result {
    static UPDATED: std::sync::Once = std::sync::Once::new();
    UPDATED.call_once(|| {
        eprintln!("services: apt-get update");
        let _ = quiet("apt-get", &["update", "-qq"]);
    });
    eprintln!("services: installing {}", packages.join(" "));
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend_from_slice(packages);
    succeed(
        Command::new("apt-get")
            .args(&args)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        &format!("apt-get install {}", packages.join(" ")),
    )
}

/// Runs `command`, its output discarded; `what` names it in the error.
fn succeed(command: &mut Command, what: &str) -> Result {
    let status = command
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// Starts `program` in its own session, detached from this process, logging to `/tmp/<name>.log`.
fn spawn_detached(name: &str, program: &PathBuf, args: &[&str]) -> Result {
    let log_path = std::env::temp_dir().join(format!("inbox-{name}.log"));
    let log = File::create(&log_path)
        .map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    Command::new("setsid")
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))?;
    eprintln!("services: started {name} (log: {})", log_path.display());
    Ok(())
}

fn postgres() -> Result {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/inbox".into());
    let (host, port) = host_port(&url, 5432);
    if needs_start("PostgreSQL", "DATABASE_URL", &host, port)? {
        if !have("pg_ctlcluster") {
            apt_install(&["postgresql"])?;
        }
        let clusters = Command::new("pg_lsclusters")
            .arg("--no-header")
            .output()
            .map_err(|e| format!("cannot run pg_lsclusters: {e}"))?;
        let listing = String::from_utf8_lossy(&clusters.stdout);
        let cluster = listing
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() > 2 && f[2] == port.to_string())
            .ok_or_else(|| format!("no PostgreSQL cluster on port {port}: {listing}"))?;
        run("pg_ctlcluster", &[cluster[0], cluster[1], "start"])?;
        wait_for("PostgreSQL", &host, port, Duration::from_secs(30))?;
    }
    if quiet("psql", &[&url, "-qAtc", "SELECT 1"]) {
        return Ok(());
    }
    if !is_local(&host) {
        return Err(format!(
            "PostgreSQL at {host}:{port} refuses DATABASE_URL {url}"
        ));
    }
    // The local default: give the postgres role the default password and create the database.
    eprintln!("services: setting up the local database for {url}");
    let database = url
        .rsplit('/')
        .next()
        .unwrap_or("inbox")
        .split('?')
        .next()
        .unwrap_or("inbox");
    let as_postgres = |sql: &str| {
        quiet(
            "su",
            &["postgres", "-c", &format!("psql -p {port} -qc \"{sql}\"")],
        )
    };
    as_postgres("ALTER USER postgres PASSWORD 'postgres'");
    as_postgres(&format!("CREATE DATABASE {database}"));
    if quiet("psql", &[&url, "-qAtc", "SELECT 1"]) {
        Ok(())
    } else {
        Err(format!("cannot connect to {url} after setting it up"))
    }
}

/// PgBouncer in transaction mode in front of the test PostgreSQL (`INBOX_PGBOUNCER_URL`), for
/// `inbox-postgres/tests/it/pgbouncer.rs`: Debian's, with a configuration of its own (in
/// `<temp>/inbox-pgbouncer`) that signs in with `DATABASE_URL`'s credentials and passes sqlx's
/// `extra_float_digits` startup parameter over.
fn pgbouncer() -> Result {
    let url = std::env::var("INBOX_PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:6432/inbox".into());
    let (host, port) = host_port(&url, 6432);
    if !needs_start("PgBouncer", "INBOX_PGBOUNCER_URL", &host, port)? {
        return Ok(());
    }
    if !have("pgbouncer") {
        apt_install(&["pgbouncer"])?;
    }
    let server = which("pgbouncer").ok_or("pgbouncer is not on PATH after installing")?;
    let dir = std::env::temp_dir().join("inbox-pgbouncer");
    start_pgbouncer(
        "PgBouncer",
        "pgbouncer",
        &dir,
        &host,
        port,
        &[server.display().to_string()],
        "",
    )
}

/// A PgBouncer that carries prepared statements from one server session to the next (1.21 and
/// later, `max_prepared_statements`) at `INBOX_PGBOUNCER_PREPARED_URL`, for the same tests:
/// Debian trixie's 1.24 package, with trixie's C library beside it (it needs glibc 2.38, which
/// bookworm lacks), unpacked into `<temp>/inbox-pgbouncer-prepared` from Debian's archive and
/// run through that library's own loader. Nothing is installed on the system.
fn pgbouncer_prepared() -> Result {
    let url = std::env::var("INBOX_PGBOUNCER_PREPARED_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:6433/inbox".into());
    let (host, port) = host_port(&url, 6433);
    if !needs_start(
        "PgBouncer 1.24",
        "INBOX_PGBOUNCER_PREPARED_URL",
        &host,
        port,
    )? {
        return Ok(());
    }
    let dir = std::env::temp_dir().join("inbox-pgbouncer-prepared");
    let root = dir.join("root");
    let binary = root.join("usr/sbin/pgbouncer");
    if !binary.exists() {
        unpack_from_trixie(&dir, &root, &["pgbouncer", "libc6"])?;
    }
    let loader = root.join("usr/lib64/ld-linux-x86-64.so.2");
    let libraries = format!(
        "{}:/lib/x86_64-linux-gnu",
        root.join("usr/lib/x86_64-linux-gnu").display()
    );
    let launch = [
        loader.display().to_string(),
        "--library-path".into(),
        libraries,
        binary.display().to_string(),
    ];
    start_pgbouncer(
        "PgBouncer 1.24",
        "pgbouncer-prepared",
        &dir,
        &host,
        port,
        &launch,
        "max_prepared_statements = 200\n",
    )
}

/// Downloads `packages` from Debian trixie (a package list of its own in `dir`, the system's
/// sources untouched) and unpacks them into `root`.
fn unpack_from_trixie(dir: &Path, root: &Path, packages: &[&str]) -> Result {
    eprintln!(
        "services: fetching Debian trixie's {} into {}",
        packages.join(" "),
        dir.display()
    );
    let lists = dir.join("lists");
    std::fs::create_dir_all(lists.join("partial"))
        .map_err(|e| format!("cannot create {}: {e}", lists.display()))?;
    let sources = dir.join("trixie.list");
    std::fs::write(&sources, "deb http://deb.debian.org/debian trixie main\n")
        .map_err(|e| format!("cannot write {}: {e}", sources.display()))?;
    let options = [
        format!("Dir::Etc::sourcelist={}", sources.display()),
        "Dir::Etc::sourceparts=/dev/null".into(),
        // The download lands in a root-owned directory; apt's own user could not write it.
        "APT::Sandbox::User=root".into(),
        format!("Dir::State::Lists={}", lists.display()),
    ];
    let apt = |action: &[&str]| {
        let mut command = Command::new("apt-get");
        command.current_dir(dir).arg("-qq");
        for option in &options {
            command.args(["-o", option]);
        }
        let what = format!("apt-get {} (Debian trixie)", action.join(" "));
        succeed(command.args(action), &what)
    };
    apt(&["update"])?;
    apt(&[&["download"], packages].concat())?;
    for package in packages {
        let deb = std::fs::read_dir(dir)
            .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .find(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| {
                        name.starts_with(&format!("{package}_")) && name.ends_with(".deb")
                    })
            })
            .ok_or_else(|| {
                format!(
                    "apt-get download {package} left no .deb in {}",
                    dir.display()
                )
            })?;
        run(
            "dpkg",
            &[
                "-x",
                &deb.display().to_string(),
                &root.display().to_string(),
            ],
        )?;
    }
    Ok(())
}

/// Configures and starts a PgBouncer, `launch` being its command line without the
/// configuration, in `dir`, in front of `DATABASE_URL`'s server; `extra` adds settings, and
/// `process` names its log (`<temp>/inbox-<process>.log`).
fn start_pgbouncer(
    name: &str,
    process: &str,
    dir: &Path,
    host: &str,
    port: u16,
    launch: &[String],
    extra: &str,
) -> Result {
    let upstream = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/inbox".into());
    let (db_host, db_port) = host_port(&upstream, 5432);
    let (user, password, _) = url_credentials(&upstream);
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let userlist = dir.join("userlist.txt");
    let config = dir.join("pgbouncer.ini");
    let write = |path: &Path, text: String| {
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    write(&userlist, format!("\"{user}\" \"{password}\"\n"))?;
    // Few server sessions and short-lived idle ones: the tests' pools share them, as an
    // application's do.
    write(
        &config,
        format!(
            "[databases]\n* = host={db_host} port={db_port}\n\n[pgbouncer]\n\
             listen_addr = {host}\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = md5\nauth_file = {}\npool_mode = transaction\n\
             default_pool_size = 20\nmax_client_conn = 500\nserver_idle_timeout = 10\n\
             ignore_startup_parameters = extra_float_digits\n{extra}",
            userlist.display()
        ),
    )?;
    let mut args: Vec<String> = launch[1..].to_vec();
    // PgBouncer does not run as root: as the database's own user then.
    if quiet("sh", &["-c", "[ \"$(id -u)\" = 0 ]"]) {
        run("chown", &["-R", "postgres", &dir.display().to_string()])?;
        args.extend(["-u".into(), "postgres".into()]);
    }
    args.push(config.display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    spawn_detached(process, &PathBuf::from(&launch[0]), &args)?;
    wait_for(name, host, port, Duration::from_secs(20))
}

/// MariaDB for the MySQL store's tests: the database and user of `INBOX_MYSQL_URL`, allowed to
/// create and drop the databases the tests make (`<database>_*`).
fn mariadb() -> Result {
    let url = std::env::var("INBOX_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://inbox:inbox@127.0.0.1:3306/inbox".into());
    let (host, port) = host_port(&url, 3306);
    if needs_start("MariaDB", "INBOX_MYSQL_URL", &host, port)? {
        if !have("mariadbd") {
            apt_install(&["mariadb-server"])?;
        }
        let server = which("mariadbd").ok_or("mariadbd is not on PATH after installing")?;
        // No init system here: the server in its own session, as the packages' service would
        // run it (as `mysql`, its socket in /run/mysqld).
        run(
            "install",
            &["-d", "-o", "mysql", "-g", "mysql", "/run/mysqld"],
        )?;
        let port_text = format!("--port={port}");
        spawn_detached(
            "mariadb",
            &server,
            &["--user=mysql", "--bind-address=127.0.0.1", &port_text],
        )?;
        wait_for("MariaDB", &host, port, Duration::from_secs(60))?;
    }
    let (user, password, database) = url_credentials(&url);
    if quiet(
        "mariadb",
        &[
            "-h",
            &host,
            "-P",
            &port.to_string(),
            "-u",
            &user,
            &format!("-p{password}"),
            "-e",
            "SELECT 1",
            &database,
        ],
    ) {
        return Ok(());
    }
    if !is_local(&host) {
        return Err(format!(
            "MariaDB at {host}:{port} refuses INBOX_MYSQL_URL {url}"
        ));
    }
    // The local default: root signs in over the socket (Debian's `unix_socket` plugin).
    eprintln!("services: setting up the local database for {url}");
    let sql = format!(
        "CREATE DATABASE IF NOT EXISTS `{database}`; \
         CREATE USER IF NOT EXISTS '{user}'@'localhost' IDENTIFIED BY '{password}'; \
         CREATE USER IF NOT EXISTS '{user}'@'127.0.0.1' IDENTIFIED BY '{password}'; \
         GRANT ALL PRIVILEGES ON `{database}`.* TO '{user}'@'localhost', '{user}'@'127.0.0.1'; \
         GRANT ALL PRIVILEGES ON `{database}\\_%`.* TO '{user}'@'localhost', '{user}'@'127.0.0.1';"
    );
    run("mariadb", &["-u", "root", "-e", &sql])
}

/// User, password and database of a `mysql://` or `postgres://user:password@host:port/database`
/// URL.
fn url_credentials(url: &str) -> (String, String, String) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (auth, location) = rest.rsplit_once('@').unwrap_or(("root:", rest));
    let (user, password) = auth.split_once(':').unwrap_or((auth, ""));
    let database = location
        .split_once('/')
        .map_or("inbox", |(_, d)| d.split('?').next().unwrap_or("inbox"));
    (user.to_owned(), password.to_owned(), database.to_owned())
}

fn redis() -> Result {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let (host, port) = host_port(&url, 6379);
    if needs_start("Redis", "REDIS_URL", &host, port)? {
        if !have("redis-server") {
            apt_install(&["redis-server"])?;
        }
        let port_text = port.to_string();
        run(
            "redis-server",
            &[
                "--daemonize",
                "yes",
                "--port",
                &port_text,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
        )?;
        wait_for("Redis", &host, port, Duration::from_secs(20))?;
    }
    Ok(())
}

/// NATS with JetStream at `NATS_URL`: Debian's `nats-server` (2.9), started with JetStream on
/// (`-js`) and its store in `<temp>/inbox-nats`. A server that listens already is reused as it
/// is (it needs JetStream on).
fn nats() -> Result {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let first = url.split(',').next().unwrap_or(&url);
    let (host, port) = host_port(first, 4222);
    if !needs_start("NATS", "NATS_URL", &host, port)? {
        return Ok(());
    }
    if which("nats-server").is_none() && !Path::new("/usr/sbin/nats-server").is_file() {
        apt_install(&["nats-server"])?;
        no_packaged_nats_server(&host, port)?;
    }
    let server = which("nats-server")
        .or_else(|| Some(PathBuf::from("/usr/sbin/nats-server")).filter(|p| p.is_file()))
        .ok_or("nats-server is not on PATH after installing")?;
    let store = std::env::temp_dir().join("inbox-nats");
    std::fs::create_dir_all(&store)
        .map_err(|e| format!("cannot create {}: {e}", store.display()))?;
    let store_text = store.display().to_string();
    let port_text = port.to_string();
    spawn_detached(
        "nats-server",
        &server,
        &["-js", "-sd", &store_text, "-a", &host, "-p", &port_text],
    )?;
    wait_for("NATS", &host, port, Duration::from_secs(20))
}

/// The `nats-server` package starts and enables its own server (without JetStream) where an
/// init system lets it: that one is stopped and disabled again, so the one started here, with
/// JetStream, can take the port. Only called right after the install, when nothing listened.
fn no_packaged_nats_server(host: &str, port: u16) -> Result {
    if Path::new("/run/systemd/system").is_dir() {
        run("systemctl", &["disable", "--now", "--quiet", "nats-server"])?;
    } else if quiet("invoke-rc.d", &["nats-server", "status"]) {
        run("invoke-rc.d", &["nats-server", "stop"])?;
        run("update-rc.d", &["nats-server", "disable"])?;
    }
    sleep(Duration::from_secs(1));
    if listening(host, port) {
        return Err(format!(
            "a NATS server listens on {host}:{port} since the nats-server package was installed, \
             without JetStream; stop it (`systemctl disable --now nats-server`)"
        ));
    }
    Ok(())
}

fn rabbitmq() -> Result {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let (host, port) = host_port(&url, 5672);
    if needs_start("RabbitMQ", "AMQP_URL", &host, port)? {
        if !have("rabbitmq-server") {
            apt_install(&["rabbitmq-server"])?;
        }
        run("rabbitmq-server", &["-detached"])?;
        wait_for("RabbitMQ", &host, port, Duration::from_secs(90))?;
        run("rabbitmqctl", &["await_startup"])?;
    }
    Ok(())
}

/// Where `KAFKA_BROKERS` points first.
fn kafka_address() -> (String, u16) {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let first = brokers.split(',').next().unwrap_or(&brokers);
    host_port(first, 9092)
}

/// Whether Kafka must be started here and Tansu is not built yet.
fn tansu_build_needed() -> Result<bool> {
    let (host, port) = kafka_address();
    if listening(&host, port) {
        return Ok(false);
    }
    if !is_local(&host) {
        // `kafka` reports it.
        return Ok(false);
    }
    Ok(which("tansu").is_none())
}

/// Starts `cargo install tansu` in the background when Kafka must be started here and Tansu is
/// missing. Only the features the project uses: `dynostore`, for its in-memory storage engine.
fn tansu_build() -> Result<Option<crate::Background>> {
    if !tansu_build_needed()? {
        return Ok(None);
    }
    let log = std::env::temp_dir().join("inbox-tansu-build.log");
    eprintln!(
        "services: building the Tansu broker in the background (cargo install, the longest step \
         of a first run; log: {})",
        log.display()
    );
    crate::Background::cargo_logged(
        &["install", "tansu", "--locked", "--features", "dynostore"],
        &log,
    )
    .map(Some)
}

fn kafka() -> Result {
    let (host, port) = kafka_address();
    if needs_start("Kafka", "KAFKA_BROKERS", &host, port)? {
        let tansu = which("tansu").ok_or("tansu is not installed, on PATH or in ~/.cargo/bin")?;
        let listener = format!("tcp://{host}:{port}");
        spawn_detached(
            "tansu",
            &tansu,
            &TANSU_ARGS
                .iter()
                .map(|a| a.replace("{listener}", &listener))
                .collect::<Vec<_>>()
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        )?;
        wait_for("Kafka (Tansu)", &host, port, Duration::from_secs(30))?;
    }
    Ok(())
}

/// How Tansu is started: in-memory storage, listening and advertised on the Kafka address.
const TANSU_ARGS: &[&str] = &[
    "broker",
    "--storage-engine",
    "memory://tansu/",
    "--listener-url",
    "{listener}",
    "--advertised-listener-url",
    "{listener}",
];

fn sqs() -> Result {
    let url =
        std::env::var("AWS_ENDPOINT_URL_SQS").unwrap_or_else(|_| "http://127.0.0.1:4566".into());
    let (host, port) = host_port(&url, 4566);
    if needs_start("SQS (moto)", "AWS_ENDPOINT_URL_SQS", &host, port)? {
        if !quiet("python3", &["-c", "import moto.server"]) {
            // The version the launcher below was written against.
            run(
                "python3",
                &["-m", "pip", "install", "--quiet", "moto[server]==5.2.1"],
            )?;
        }
        let python = which("python3").ok_or("python3 is not on PATH")?;
        // moto's server through a launcher that keeps its SQS sends and receives from scanning
        // the whole queue several times per message (see the file).
        let launcher = Path::new(env!("CARGO_MANIFEST_DIR")).join("moto_server.py");
        let launcher = launcher.to_str().ok_or("the xtask path is not UTF-8")?;
        let port_text = port.to_string();
        spawn_detached("moto", &python, &[launcher, "-H", &host, "-p", &port_text])?;
        wait_for("SQS (moto)", &host, port, Duration::from_secs(30))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn mysql_urls_give_their_credentials() {
        assert_eq!(
            super::url_credentials("mysql://inbox:secret@127.0.0.1:3306/inbox?ssl-mode=disabled"),
            ("inbox".into(), "secret".into(), "inbox".into())
        );
    }

    #[test]
    fn addresses_come_out_of_urls() {
        assert_eq!(
            host_port("postgres://u:p@127.0.0.1:5433/inbox", 5432),
            ("127.0.0.1".into(), 5433)
        );
        assert_eq!(
            host_port("amqp://guest:guest@localhost:5672/%2f", 1),
            ("localhost".into(), 5672)
        );
        assert_eq!(
            host_port("redis://127.0.0.1", 6379),
            ("127.0.0.1".into(), 6379)
        );
        assert_eq!(host_port("127.0.0.1:9092", 1), ("127.0.0.1".into(), 9092));
        assert_eq!(
            host_port("http://127.0.0.1:4566", 1),
            ("127.0.0.1".into(), 4566)
        );
    }
}
