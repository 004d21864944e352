//! A TCP proxy for fault tests, placed between a client (worker, leader,
//! relay) and PostgreSQL or a broker. It fails the way networks do:
//!
//! - [`Proxy::freeze`]: stops forwarding in both directions but keeps every
//!   socket open (a half-open network, a partition, a hung peer): nothing is
//!   refused or reset, bytes just stop arriving. New connections are accepted
//!   and held. [`Proxy::thaw`] resumes forwarding, buffered bytes included.
//! - [`Proxy::hold_answers`]: forwards what clients send but holds what the
//!   server answers (a statement that commits while its answer is lost);
//!   [`Proxy::thaw`] lets the answers through.
//! - [`Proxy::cut`]: drops every connection and refuses new ones;
//!   [`Proxy::restore`] listens again on the same port.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub struct Proxy {
    pub port: u16,
    target: SocketAddr,
    stop: CancellationToken,
    frozen: watch::Sender<bool>,
    /// Answers (server to client) held, requests forwarded.
    answers: watch::Sender<bool>,
    /// Client connections whose sockets are still open.
    live: Arc<AtomicUsize>,
}

/// Counts a connection as live until its task ends and drops its sockets.
struct Live(Arc<AtomicUsize>);

impl Live {
    fn new(live: &Arc<AtomicUsize>) -> Live {
        live.fetch_add(1, Ordering::SeqCst);
        Live(live.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = CancellationToken::new();
        let (frozen, _) = watch::channel(false);
        let (answers, _) = watch::channel(false);
        let live = Arc::new(AtomicUsize::new(0));
        tokio::spawn(serve(
            listener,
            target,
            stop.clone(),
            [frozen.subscribe(), answers.subscribe()],
            live.clone(),
        ));
        Proxy {
            port,
            target,
            stop,
            frozen,
            answers,
            live,
        }
    }

    /// A proxy in front of the local PostgreSQL (127.0.0.1:5432).
    pub async fn postgres() -> Proxy {
        Proxy::start("127.0.0.1:5432".parse().unwrap()).await
    }

    /// `url` (a `postgres://` URL naming 127.0.0.1:5432 or localhost:5432)
    /// rewritten to go through this proxy.
    pub fn postgres_url(&self, url: &str) -> String {
        let through = format!("127.0.0.1:{}", self.port);
        url.replace("127.0.0.1:5432", &through)
            .replace("localhost:5432", &through)
    }

    /// Stops forwarding; sockets stay open (a half-open network).
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Forwards requests but holds the server's answers until [`Proxy::thaw`]
    /// (new connections are held too: their handshake is an answer).
    pub fn hold_answers(&self) {
        self.answers.send_replace(true);
    }

    /// Resumes forwarding, bytes held during the freeze included.
    pub fn thaw(&self) {
        self.frozen.send_replace(false);
        self.answers.send_replace(false);
    }

    /// The peer "goes away": connections drop, new ones are refused.
    pub fn cut(&mut self) {
        self.stop.cancel();
    }

    /// Waits until every connection a [`Proxy::cut`] dropped is closed on
    /// the client's side too (the forwarding tasks notice the cut a moment
    /// later): from then on, no request gets through.
    pub async fn closed(&self) {
        let live = self.live.clone();
        super::eventually(
            "the cut connections to close",
            Duration::from_secs(5),
            || {
                let live = live.clone();
                async move { live.load(Ordering::SeqCst) == 0 }
            },
        )
        .await;
    }

    /// Listens again on the same port (and thaws).
    pub async fn restore(&mut self) {
        let listener = TcpListener::bind(("127.0.0.1", self.port)).await.unwrap();
        self.stop = CancellationToken::new();
        self.thaw();
        tokio::spawn(serve(
            listener,
            self.target,
            self.stop.clone(),
            [self.frozen.subscribe(), self.answers.subscribe()],
            self.live.clone(),
        ));
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn serve(
    listener: TcpListener,
    target: SocketAddr,
    stop: CancellationToken,
    [frozen, answers]: [watch::Receiver<bool>; 2],
    live: Arc<AtomicUsize>,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((inbound, _)) = accepted else {
            continue;
        };
        let stop = stop.clone();
        let mut frozen = frozen.clone();
        let answers = answers.clone();
        let live = Live::new(&live);
        tokio::spawn(async move {
            let _live = live;
            if !thawed(&mut frozen, &stop).await {
                return;
            }
            let Ok(outbound) = TcpStream::connect(target).await else {
                return;
            };
            let (in_read, in_write) = inbound.into_split();
            let (out_read, out_write) = outbound.into_split();
            tokio::join!(
                pump(in_read, out_write, vec![frozen.clone()], stop.clone()),
                pump(out_read, in_write, vec![frozen, answers], stop),
            );
        });
    }
}

/// Waits while frozen; `false` once the proxy is cut.
async fn thawed(frozen: &mut watch::Receiver<bool>, stop: &CancellationToken) -> bool {
    loop {
        if stop.is_cancelled() {
            return false;
        }
        if !*frozen.borrow_and_update() {
            return true;
        }
        tokio::select! {
            _ = stop.cancelled() => return false,
            changed = frozen.changed() => if changed.is_err() { return false },
        }
    }
}

/// Waits until none of `holds` holds; `false` once the proxy is cut.
async fn all_thawed(holds: &mut [watch::Receiver<bool>], stop: &CancellationToken) -> bool {
    loop {
        for hold in holds.iter_mut() {
            if !thawed(hold, stop).await {
                return false;
            }
        }
        if holds.iter().all(|h| !*h.borrow()) {
            return true;
        }
    }
}

/// Copies one direction; holds bytes (and stops reading) while frozen, so
/// the sender's window fills as on a real half-open path.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut frozen: Vec<watch::Receiver<bool>>,
    stop: CancellationToken,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if !all_thawed(&mut frozen, &stop).await {
            return;
        }
        let n = tokio::select! {
            _ = stop.cancelled() => return,
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => { let _ = to.shutdown().await; return; }
                Ok(n) => n,
            },
        };
        if !all_thawed(&mut frozen, &stop).await {
            return;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            written = to.write_all(&buf[..n]) => if written.is_err() { return },
        }
    }
}
