//! A TCP proxy on loopback that can refuse, cut or black-hole connections: the network faults
//! between a consumer and its database or broker, on demand.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forwards bytes both ways.
    Pass,
    /// Closes new connections at once and cuts the open ones: a server that went away.
    Refuse,
    /// Accepts connections and holds them open, forwarding nothing either way: a partition, or
    /// a peer that hangs. Open connections stop moving bytes too.
    Blackhole,
}

/// A proxy from a loopback port to `upstream`, stopped when its last clone is dropped.
///
/// Point the client at [`FaultProxy::addr`], then switch modes while it runs. Switching to
/// [`ProxyMode::Refuse`] or [`FaultProxy::cut`] closes every open connection, including one in
/// the middle of a request (a `COMMIT` whose outcome the client never learns).
#[derive(Debug, Clone)]
pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<ProxyMode>,
    cuts: watch::Sender<u64>,
    upstream: watch::Sender<SocketAddr>,
    _accept: Arc<Accepting>,
}

/// The accepting task, stopped (and every connection closed) when the last clone goes.
#[derive(Debug)]
struct Accepting(JoinHandle<()>, watch::Sender<ProxyMode>);

impl Drop for Accepting {
    fn drop(&mut self) {
        self.0.abort();
        self.1.send_replace(ProxyMode::Refuse);
    }
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(ProxyMode::Pass);
        let (cuts, _) = watch::channel(0u64);
        let (upstream, _) = watch::channel(upstream);
        let state = Arc::new((mode.clone(), cuts.clone(), upstream.clone()));
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (mode, cuts, upstream) = &*state;
                let upstream = *upstream.borrow();
                tokio::spawn(serve(client, upstream, mode.subscribe(), cuts.subscribe()));
            }
        });
        Ok(Self {
            addr,
            _accept: Arc::new(Accepting(accept, mode.clone())),
            mode,
            cuts,
            upstream,
        })
    }

    /// A proxy in front of `host:port`, the first address the name resolves to.
    ///
    /// # Panics
    /// When the name does not resolve or no loopback port can be bound.
    pub async fn in_front_of(host: &str, port: u16) -> Self {
        let resolved = tokio::net::lookup_host((host, port)).await.ok();
        let upstream = resolved
            .and_then(|mut addrs| addrs.next())
            .unwrap_or_else(|| panic!("{host}:{port} does not resolve"));
        Self::start(upstream).await.expect("the proxy")
    }

    /// A proxy in front of the server `url` names (`scheme://[user@]host[:port][/…]`, on
    /// `default_port` where it names no port), and `url` pointed at the proxy, its user, path and
    /// query kept.
    ///
    /// # Errors
    /// When `url` has no such shape (an IPv6 literal included), its host resolves to no address
    /// or no loopback port can be bound.
    pub async fn in_front_of_url(url: &str, default_port: u16) -> Result<(Self, String), String> {
        let bad = || format!("{url}: expected scheme://[user@]host[:port][/…]");
        let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
        let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
        let (user, host_port) = match authority.rsplit_once('@') {
            Some((user, host_port)) => (format!("{user}@"), host_port),
            None => (String::new(), authority),
        };
        if host_port.is_empty() || host_port.starts_with('[') {
            return Err(bad());
        }
        let host_port = match host_port.rsplit_once(':') {
            Some((_, port)) if port.parse::<u16>().is_ok() => host_port.to_owned(),
            _ => format!("{host_port}:{default_port}"),
        };
        let resolved = tokio::net::lookup_host(&host_port).await;
        let upstream = resolved.ok().and_then(|mut addrs| addrs.next());
        let upstream = upstream.ok_or_else(|| format!("{host_port} resolves to no address"))?;
        let proxy = Self::start(upstream).await.map_err(|e| e.to_string())?;
        let through = format!("{scheme}://{user}{}{tail}", proxy.addr());
        Ok((proxy, through))
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Switches mode for new and open connections.
    pub fn set_mode(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }

    /// Closes every open connection; new ones are served as the mode says.
    pub fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }

    /// Forwards new connections to `upstream` from now on and cuts the open ones: a failover
    /// behind one address (a virtual IP, a DNS name, a connection pooler moving to the new
    /// primary).
    pub fn redirect(&self, upstream: SocketAddr) {
        self.upstream.send_replace(upstream);
        self.cut();
    }
}

async fn serve(
    mut client: TcpStream,
    upstream: SocketAddr,
    mut mode: watch::Receiver<ProxyMode>,
    mut cuts: watch::Receiver<u64>,
) {
    cuts.mark_unchanged();
    let current = *mode.borrow_and_update();
    match current {
        ProxyMode::Refuse => return,
        ProxyMode::Blackhole => {
            hold(&mut client, &mut mode, &mut cuts).await;
            return;
        }
        ProxyMode::Pass => {}
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    {
        let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
        tokio::pin!(copy);
        loop {
            let changed = tokio::select! {
                _ = &mut copy => return,
                _ = cuts.changed() => return,
                changed = mode.changed() => changed.is_ok(),
            };
            if !changed {
                return;
            }
            match *mode.borrow_and_update() {
                ProxyMode::Pass => {}
                ProxyMode::Refuse => return,
                ProxyMode::Blackhole => break,
            }
        }
    }
    // Bytes stop moving; the connection stays open until a cut or Refuse, and is not trusted
    // again after Pass: a black-holed connection is dead to its client.
    hold(&mut client, &mut mode, &mut cuts).await;
}

/// Swallows what the client sends until the proxy cuts or refuses.
async fn hold(
    client: &mut TcpStream,
    mode: &mut watch::Receiver<ProxyMode>,
    cuts: &mut watch::Receiver<u64>,
) {
    let mut sink = [0u8; 4096];
    loop {
        tokio::select! {
            read = client.read(&mut sink) => {
                if matches!(read, Ok(0) | Err(_)) {
                    return;
                }
            }
            _ = cuts.changed() => return,
            changed = mode.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
        if *mode.borrow_and_update() == ProxyMode::Refuse {
            return;
        }
    }
}
