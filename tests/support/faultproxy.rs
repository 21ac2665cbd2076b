//! A fault proxy in front of a TCP server (the S3 store): pass, down, slow or blackholed,
//! switchable while clients use it.
//!
//! - `Pass`: bytes go through.
//! - `Down`: the listening socket is closed (new connections are refused) and open connections
//!   are cut; on leaving `Down` it listens again on the same port.
//! - `Slow(d)`: every chunk, each way, is held `d` before it is forwarded.
//! - `Blackhole`: connections are accepted and read, nothing is forwarded either way, nothing
//!   answers. When the mode leaves `Blackhole`, connections that lost bytes are cut (their
//!   request or response is gone; a real partition would leave them to the client's timeout,
//!   which for object_store is 30 s: longer than a schedule).
//! - `RefuseFrom(id)`: connections whose first HTTP request carries `X-Server-From: <id in hex>`
//!   (etcd's peer traffic names its sender so) are cut, open ones included; others pass. With
//!   a proxy in front of every etcd member's peer port, one member can be cut off from the
//!   others while they still talk to each other.
//! - `LoseAnswers`: requests reach the server, which performs them; the first byte of its answer
//!   is dropped and the connection cut, so the client sees an error for a request the server
//!   committed (an S3 PUT or a multipart completion that happened, reported as failed).
//! - `Late(d)`: requests pass at once; every chunk of the server's answer is held `d` before it
//!   is forwarded. With `d` past the client's deadline the server completes and the client has
//!   given up (its abandoned connection is cut once it closes it).
//! - `Status(code)`: nothing reaches the server; every request is read (its body too, as far as
//!   `Content-Length` says) and answered with `code` and an S3 error body (503 `SlowDown`, 500
//!   `InternalError`, as S3 throttling and its internal errors answer). Connections open when the
//!   mode is set are cut (a request on them is lost, as at any switch); new ones are answered.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// How the proxy treats traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    Pass,
    Down,
    Slow(Duration),
    Blackhole,
    RefuseFrom(u64),
    LoseAnswers,
    Late(Duration),
    Status(u16),
}

/// A running proxy; stops on drop.
pub struct FaultProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<FaultMode>,
    _stop: DropGuard,
    /// What the faults did: answers lost after the server performed the request, answers held
    /// late.
    pub counts: Arc<Counts>,
}

/// What [`FaultMode::LoseAnswers`] and [`FaultMode::Late`] did to traffic.
#[derive(Debug, Default)]
pub struct Counts {
    /// Connections cut at the first byte of the server's answer.
    pub lost: AtomicU64,
    /// Answer chunks held late.
    pub late: AtomicU64,
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

impl FaultProxy {
    /// Forwards an ephemeral loopback port to `target`, in `Pass` mode.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        FaultProxy::spawn(target)
    }

    /// [`FaultProxy::start`] from synchronous code inside the runtime (binding does not wait).
    pub fn spawn(target: SocketAddr) -> FaultProxy {
        let listener = listen(([127, 0, 0, 1], 0).into()).expect("bind the fault proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, _) = watch::channel(FaultMode::Pass);
        let stop = CancellationToken::new();
        let counts = Arc::new(Counts::default());
        tokio::spawn(accept(
            listener,
            addr,
            target,
            mode.subscribe(),
            stop.clone(),
            counts.clone(),
        ));
        FaultProxy {
            addr,
            mode,
            _stop: stop.drop_guard(),
            counts,
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Switches the mode for new and open connections.
    pub fn set(&self, mode: FaultMode) {
        self.mode.send_replace(mode);
    }

    /// The current mode.
    pub fn mode(&self) -> FaultMode {
        *self.mode.borrow()
    }
}

async fn accept(
    listener: TcpListener,
    addr: SocketAddr,
    target: SocketAddr,
    mut mode: watch::Receiver<FaultMode>,
    stop: CancellationToken,
    counts: Arc<Counts>,
) {
    let mut listener = Some(listener);
    loop {
        let down = *mode.borrow_and_update() == FaultMode::Down;
        if down {
            listener = None;
        } else if listener.is_none() {
            // The port was ours a moment ago; the kernel may take a moment to let it go.
            for _ in 0..250 {
                match listen(addr) {
                    Ok(l) => {
                        listener = Some(l);
                        break;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            assert!(
                listener.is_some(),
                "fault proxy cannot listen on {addr} again"
            );
        }
        let accepted = async {
            match &listener {
                Some(l) => l.accept().await.ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            r = mode.changed() => if r.is_err() { return },
            c = accepted => if let Some((client, _)) = c {
                tokio::spawn(connection(client, target, mode.clone(), stop.clone(), counts.clone()));
            },
        }
    }
}

async fn connection(
    client: TcpStream,
    target: SocketAddr,
    mode: watch::Receiver<FaultMode>,
    stop: CancellationToken,
    counts: Arc<Counts>,
) {
    // Blackholed when it arrives: read and drop until the client goes or the mode changes (then
    // cut: what the client sent is lost).
    let mut client = client;
    if *mode.borrow() == FaultMode::Blackhole {
        let mut m = mode.clone();
        let mut sink = vec![0u8; 16 * 1024];
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = m.changed() => return,
                n = client.read(&mut sink) => if matches!(n, Ok(0) | Err(_)) { return },
            }
        }
    }
    if *mode.borrow() == FaultMode::Down {
        return;
    }
    let (head, from) = request_head(&mut client).await;
    if matches!(*mode.borrow(), FaultMode::RefuseFrom(id) if Some(id) == from) {
        return;
    }
    let status = match *mode.borrow() {
        FaultMode::Status(code) => Some(code),
        _ => None,
    };
    if let Some(code) = status {
        answer_status(client, &head, code).await;
        return;
    }
    let Ok(Ok(mut upstream)) =
        tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(target)).await
    else {
        return;
    };
    if upstream.write_all(&head).await.is_err() {
        return;
    }
    let tainted = Arc::new(AtomicBool::new(false));
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = pump(cr, uw, mode.clone(), tainted.clone(), from, None) => {}
        _ = pump(ur, cw, mode.clone(), tainted.clone(), from, Some(&counts)) => {}
    }
}

/// The first bytes the client sends, up to the end of an HTTP request head (or what arrives
/// within a moment, for a client that waits to be spoken to), and the sender an etcd peer
/// request names in `X-Server-From`.
async fn request_head(client: &mut TcpStream) -> (Vec<u8>, Option<u64>) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while head.len() < 16 * 1024 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_millis(200), client.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => head.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    let from = String::from_utf8_lossy(&head).lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("x-server-from")
            .then(|| u64::from_str_radix(v.trim(), 16).ok())
            .flatten()
    });
    (head, from)
}

/// Answers the request whose head is `head` with `code` and an S3 error body, without the
/// server: its body is read first (up to `Content-Length`, within a moment), so that the client,
/// still sending, is not cut before it reads the answer; then the connection is closed.
async fn answer_status(mut client: TcpStream, head: &[u8], code: u16) {
    let end = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(head.len(), |p| p + 4);
    let text = String::from_utf8_lossy(&head[..end]);
    let length: usize = text
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0);
    let mut left = length.saturating_sub(head.len() - end);
    let mut buf = vec![0u8; 64 * 1024];
    while left > 0 {
        match tokio::time::timeout(Duration::from_secs(2), client.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n),
            _ => break,
        }
    }
    let (reason, s3_code, message) = match code {
        503 => ("Slow Down", "SlowDown", "Please reduce your request rate."),
        _ => (
            "Internal Server Error",
            "InternalError",
            "We encountered an internal error. Please try again.",
        ),
    };
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{s3_code}</Code>\
         <Message>{message}</Message></Error>"
    );
    let answer = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = client.write_all(answer.as_bytes()).await;
    let _ = client.shutdown().await;
}

/// Forwards one direction according to the mode (`answers`: the server-to-client one, counted
/// there); returns when the connection must end.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<FaultMode>,
    tainted: Arc<AtomicBool>,
    sender: Option<u64>,
    answers: Option<&Counts>,
) {
    let refused = |m: FaultMode| matches!(m, FaultMode::RefuseFrom(id) if Some(id) == sender);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            c = mode.changed() => {
                if c.is_err() {
                    return;
                }
                let m = *mode.borrow_and_update();
                if m == FaultMode::Down
                    || matches!(m, FaultMode::Status(_))
                    || refused(m)
                    || (tainted.load(Ordering::SeqCst) && m != FaultMode::Blackhole)
                {
                    return;
                }
                continue;
            }
        };
        let m = *mode.borrow_and_update();
        match m {
            m if refused(m) => return,
            FaultMode::Pass | FaultMode::RefuseFrom(_) => {}
            // The server has answered, so it has performed the request: the answer goes nowhere.
            FaultMode::LoseAnswers => {
                if let Some(c) = answers {
                    c.lost.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
            FaultMode::Late(d) => {
                if let Some(c) = answers {
                    c.late.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(d).await;
                }
            }
            FaultMode::Slow(d) => tokio::time::sleep(d).await,
            FaultMode::Blackhole => {
                tainted.store(true, Ordering::SeqCst);
                continue;
            }
            FaultMode::Down | FaultMode::Status(_) => return,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
