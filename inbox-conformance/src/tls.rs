//! A throw-away certificate authority and server certificate, made at test time with the
//! `openssl` command, for servers the tests start with TLS only.

use std::fmt::Display;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use inbox_core::{MessageId, OutgoingMessage};

use crate::pg_cluster::run;

/// A CA and one server certificate it signed, as PEM files in a directory of their own.
#[derive(Debug, Clone)]
pub struct TestCa {
    /// The directory holding the files.
    pub dir: PathBuf,
    /// The CA certificate: what a client trusts.
    pub ca: PathBuf,
    /// The server certificate, valid for the names given to [`TestCa::new`].
    pub cert: PathBuf,
    /// The server's private key (mode 0600).
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA in `dir` (created, or emptied of earlier files) and a server certificate for
    /// `names` (each a DNS name, or an IP address as `IP:127.0.0.1`).
    ///
    /// # Errors
    /// When `openssl` is missing or fails.
    pub fn new(dir: &Path, names: &[&str]) -> Result<Self, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
        let (ca_key, ca, key, csr, cert, ext) = (
            file("ca.key"),
            file("ca.pem"),
            file("server.key"),
            file("server.csr"),
            file("server.pem"),
            file("server.ext"),
        );
        // Paths of the test's own directories: no spaces, so a line splits into the arguments.
        let openssl = |line: String| run("openssl", &line.split_whitespace().collect::<Vec<_>>());
        let ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
        let ca_name = crate::unique_name("inbox-test-ca");
        openssl(format!(
            "req -x509 {ec} -days 2 -subj /CN={ca_name} -keyout {ca_key} -out {ca}"
        ))?;
        openssl(format!(
            "req {ec} -subj /CN=inbox-test-server -keyout {key} -out {csr}"
        ))?;
        let alt_names: Vec<String> = names
            .iter()
            .map(|n| {
                if n.starts_with("IP:") {
                    (*n).to_owned()
                } else {
                    format!("DNS:{n}")
                }
            })
            .collect();
        let extensions = format!(
            "subjectAltName = {}\nextendedKeyUsage = serverAuth\n",
            alt_names.join(",")
        );
        std::fs::write(&ext, extensions).map_err(|e| format!("cannot write {ext}: {e}"))?;
        openssl(format!(
            "x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -days 2 \
             -extfile {ext} -out {cert}"
        ))?;
        Ok(Self {
            dir: dir.to_owned(),
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
        })
    }

    /// Gives the files to `user` (a server that refuses a key others can read), keeping the key
    /// readable by its owner only.
    ///
    /// # Errors
    /// When `chown` or `chmod` fails.
    pub fn give_to(&self, user: &str) -> Result<(), String> {
        let path = |p: &Path| p.to_string_lossy().into_owned();
        run("chown", &["-R", user, &path(&self.dir)])?;
        run("chmod", &["0600", &path(&self.key)])
    }
}

/// Credits the TLS tests send end to end: [`CREDITS`] wallet credits under fresh IDs, every
/// tenth twice (a resent copy), so a run applies [`CREDITS`] and skips a tenth as many.
pub fn credits_with_resent_copies() -> Vec<OutgoingMessage> {
    let mut batch = Vec::new();
    for i in 0..CREDITS {
        let credit = crate::wallet::CreditEvent::new(i % 7, 1).to_json();
        let message = OutgoingMessage::new(MessageId::generate(), credit);
        if i % 10 == 0 {
            batch.push(message.clone());
        }
        batch.push(message);
    }
    batch
}

/// How many distinct credits [`credits_with_resent_copies`] holds.
pub const CREDITS: i64 = 200;

/// The error `connecting` (to `what`) ends with, printed with how long it took.
///
/// # Panics
/// When it connects, or takes longer than `limit`: a refused connection must not hang.
pub async fn refused<T, E: Display>(
    what: &str,
    limit: Duration,
    connecting: impl Future<Output = Result<T, E>>,
) -> String {
    let started = Instant::now();
    let result = tokio::time::timeout(limit, connecting)
        .await
        .unwrap_or_else(|_| panic!("connecting to {what} hangs"));
    let Err(error) = result else {
        panic!("connected to {what}")
    };
    println!("{what}: refused in {:?}: {error}", started.elapsed());
    error.to_string()
}
