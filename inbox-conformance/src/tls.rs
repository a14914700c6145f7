//! A throw-away certificate authority and server certificate, made at test time with the
//! `openssl` command, for servers the tests start with TLS only.

use std::path::{Path, PathBuf};

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
