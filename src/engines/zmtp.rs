//! The part of ZMTP 3.0 (rfc.zeromq.org/spec/23, NULL mechanism, TCP) that engines' KV
//! events need: a SUB and a DEALER that connect to an engine's PUB and ROUTER, and a PUB and a
//! ROUTER that bind, for the test engine. Every read is bounded in size and every wait has a
//! deadline, which a general ZMQ binding does not promise. Interoperates with libzmq (tested
//! against pyzmq).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Largest frame accepted: an engine batch at its limit plus room.
pub const MAX_FRAME: usize = super::wire::MAX_PAYLOAD_BYTES + 4096;
/// Most frames in one message (engine messages have four at most).
const MAX_FRAMES: usize = 16;
/// Largest command accepted (READY with its properties, PING).
const MAX_COMMAND: usize = 4096;
/// Most bytes of one message, all its frames: one frame at its limit beside small ones
/// (an engine's topic and sequence frames are a few bytes each).
const MAX_MESSAGE: usize = MAX_FRAME + 4096;
/// Largest data frame read past when it is over its limit (the connection stays in step and
/// the message is reported, [`ZmtpError::Oversized`]); a larger claim ends the connection.
const MAX_SKIP: u64 = 1 << 30;
/// What a frame's buffer starts at: it grows as the bytes arrive, so a header alone (9
/// bytes declaring 16 MiB) reserves no more than this.
const FIRST_READ: usize = 64 << 10;

/// Why a ZMTP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The endpoint is not `tcp://HOST:PORT`.
    #[error("endpoint {0:?} is not tcp://HOST:PORT (ipc and inproc are not supported)")]
    Endpoint(String),
    /// Connecting, reading or writing failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer took longer than the deadline.
    #[error("no answer from the peer within {0:?}")]
    Timeout(Duration),
    /// The peer broke the protocol (or is not ZMTP 3).
    #[error("protocol: {0}")]
    Protocol(String),
    /// A message with a data frame over its limit: the frame's bytes were read past (it is
    /// empty in `frames`, the message's other frames are whole), so the connection is still
    /// in step and the next `recv` reads the next message.
    #[error("a frame of {bytes} bytes is over the {limit}-byte limit (read past)")]
    Oversized {
        /// The message's frames, the oversized one empty.
        frames: Vec<Bytes>,
        /// Which frame was over (the first if several were).
        frame: usize,
        /// The oversized frame's length.
        bytes: u64,
        /// The limit it was over.
        limit: usize,
    },
    /// Not asked: it left the last requests unanswered, and rests this long more.
    #[error("not asked: it left its last requests unanswered (asked again in {0:?})")]
    Resting(Duration),
}

fn protocol<T>(what: impl Into<String>) -> Result<T, ZmtpError> {
    Err(ZmtpError::Protocol(what.into()))
}

/// `host:port` of a `tcp://host:port` endpoint; `*` (a bind-all address, as engines are
/// configured) means this host.
pub fn tcp_address(endpoint: &str) -> Result<String, ZmtpError> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| ZmtpError::Endpoint(endpoint.to_owned()))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| ZmtpError::Endpoint(endpoint.to_owned()))?;
    if port.parse::<u16>().is_err() || host.is_empty() {
        return Err(ZmtpError::Endpoint(endpoint.to_owned()));
    }
    let host = if host == "*" { "127.0.0.1" } else { host };
    Ok(format!("{host}:{port}"))
}

/// A greeting: signature, version 3.0, NULL mechanism, as-server, filler.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = Vec::new();
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    body
}

/// Frame flags.
const MORE: u8 = 1;
const LONG: u8 = 2;
const COMMAND: u8 = 4;

fn frame_header(flags: u8, len: usize, out: &mut Vec<u8>) {
    if len > 255 {
        out.push(flags | LONG);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(len as u8);
    }
}

/// One side of an established ZMTP connection.
#[derive(Debug)]
pub struct Connection {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// The peer's `Socket-Type`.
    peer_type: String,
}

/// A frame or a command as read off the wire.
enum Unit {
    /// A data frame; `over` is its length and the limit it was over when its bytes were
    /// read past (its body empty).
    Frame {
        more: bool,
        body: Bytes,
        over: Option<(u64, usize)>,
    },
    Command(Bytes),
}

impl Connection {
    /// Connects to `endpoint` as `socket_type` (`SUB`, `DEALER`) within `deadline`.
    pub async fn connect(
        endpoint: &str,
        socket_type: &str,
        deadline: Duration,
    ) -> Result<Connection, ZmtpError> {
        let address = tcp_address(endpoint)?;
        let stream = tokio::time::timeout(deadline, TcpStream::connect(&address))
            .await
            .map_err(|_| ZmtpError::Timeout(deadline))??;
        // A peer whose host died (no FIN, no RST) is noticed in about 30 s: a silent engine
        // is not a dead one, so silence alone cannot tell.
        socket2::SockRef::from(&stream).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(15))
                .with_interval(Duration::from_secs(5))
                .with_retries(3),
        )?;
        let c = Connection::handshake(stream, socket_type, deadline).await?;
        // libzmq greets any peer, then closes a pair it cannot serve: refused here, a
        // misconfigured endpoint (the event and replay ports swapped) is an error that
        // backs off, not a connection that closes as soon as it opens, again and again.
        let fits: &[&str] = match socket_type {
            "SUB" => &["PUB", "XPUB"],
            "DEALER" => &["ROUTER", "DEALER", "REP"],
            _ => return Ok(c),
        };
        if !fits.contains(&c.peer_type.as_str()) {
            return protocol(format!(
                "{endpoint} is a {} socket, where a {socket_type} needs one of {}",
                c.peer_type,
                fits.join(", ")
            ));
        }
        Ok(c)
    }

    /// Greets and exchanges READY on an open stream (either side) within `deadline`.
    pub async fn handshake(
        stream: TcpStream,
        socket_type: &str,
        deadline: Duration,
    ) -> Result<Connection, ZmtpError> {
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        let mut c = Connection {
            reader: BufReader::with_capacity(64 * 1024, r),
            writer: w,
            peer_type: String::new(),
        };
        tokio::time::timeout(deadline, c.greet(socket_type))
            .await
            .map_err(|_| ZmtpError::Timeout(deadline))??;
        Ok(c)
    }

    async fn greet(&mut self, socket_type: &str) -> Result<(), ZmtpError> {
        self.writer.write_all(&greeting()).await?;
        let mut peer = [0u8; 64];
        self.reader.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] != 0x7f {
            return protocol("the peer's greeting has no ZMTP signature");
        }
        if peer[10] < 3 {
            return protocol(format!("the peer speaks ZMTP {}, not 3", peer[10]));
        }
        if &peer[12..16] != b"NULL" || peer[16..32].iter().any(|b| *b != 0) {
            return protocol("the peer asks for a security mechanism other than NULL");
        }
        let mut out = Vec::new();
        let body = ready(socket_type);
        frame_header(COMMAND, body.len(), &mut out);
        out.extend_from_slice(&body);
        self.writer.write_all(&out).await?;
        match self.read_unit(MAX_COMMAND).await? {
            Unit::Command(body) => self.peer_type = parse_ready(&body)?,
            Unit::Frame { .. } => return protocol("the peer sent a message before READY"),
        }
        Ok(())
    }

    /// The peer's socket type (`PUB`, `ROUTER`, `SUB`, `DEALER`…).
    pub fn peer_type(&self) -> &str {
        &self.peer_type
    }

    /// The next frame or command; a frame at most `room` bytes (what its message has left).
    async fn read_unit(&mut self, room: usize) -> Result<Unit, ZmtpError> {
        let flags = self.reader.read_u8().await?;
        let len = if flags & LONG != 0 {
            self.reader.read_u64().await?
        } else {
            u64::from(self.reader.read_u8().await?)
        };
        let limit = if flags & COMMAND != 0 {
            MAX_COMMAND
        } else {
            MAX_FRAME.min(room)
        };
        if len > limit as u64 {
            if flags & COMMAND != 0 || len > MAX_SKIP {
                return protocol(format!(
                    "a frame of {len} bytes is over the {limit}-byte limit"
                ));
            }
            // A data frame that fits the stream but not the limit: read past it, a piece at
            // a time, so that the peer's next message is read from its start.
            let skipped =
                tokio::io::copy(&mut (&mut self.reader).take(len), &mut tokio::io::sink()).await?;
            if skipped < len {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            return Ok(Unit::Frame {
                more: flags & MORE != 0,
                body: Bytes::new(),
                over: Some((len, limit)),
            });
        }
        // Read as it arrives: the buffer grows with the bytes, not with the claim.
        let len = len as usize;
        let mut body = BytesMut::with_capacity(len.min(FIRST_READ));
        while body.len() < len {
            if body.capacity() == body.len() {
                body.reserve((len - body.len()).min(body.len().max(FIRST_READ)));
            }
            let want = (len - body.len()).min(body.capacity() - body.len());
            let read = (&mut self.reader)
                .take(want as u64)
                .read_buf(&mut body)
                .await?;
            if read == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
        }
        let body = body.freeze();
        Ok(if flags & COMMAND != 0 {
            Unit::Command(body)
        } else {
            Unit::Frame {
                more: flags & MORE != 0,
                body,
                over: None,
            }
        })
    }

    /// The next message (all its frames). Commands in between are handled: PING is answered,
    /// the rest ignored. Waits as long as the peer is silent: callers put a deadline on it
    /// where silence is a fault. A message with a frame over its limit is
    /// [`ZmtpError::Oversized`], after which the connection can be read on.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        let mut room = MAX_MESSAGE;
        let mut oversized = None;
        loop {
            match self.read_unit(room).await? {
                Unit::Command(body) => self.command(&body).await?,
                Unit::Frame { more, body, over } => {
                    if frames.len() == MAX_FRAMES {
                        return protocol(format!("a message of more than {MAX_FRAMES} frames"));
                    }
                    room -= body.len();
                    oversized =
                        oversized.or(over.map(|(bytes, limit)| (frames.len(), bytes, limit)));
                    frames.push(body);
                    if !more {
                        return match oversized {
                            None => Ok(frames),
                            Some((frame, bytes, limit)) => Err(ZmtpError::Oversized {
                                frames,
                                frame,
                                bytes,
                                limit,
                            }),
                        };
                    }
                }
            }
        }
    }

    async fn command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let name = command_name(body)?;
        if name == b"PING" {
            // PING: ttl (2 bytes) then a context the PONG echoes.
            let context = body.get(1 + name.len() + 2..).unwrap_or(&[]);
            let mut pong = vec![4];
            pong.extend_from_slice(b"PONG");
            pong.extend_from_slice(context);
            let mut out = Vec::new();
            frame_header(COMMAND, pong.len(), &mut out);
            out.extend_from_slice(&pong);
            self.writer.write_all(&out).await?;
        }
        Ok(())
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            frame_header(more, f.len(), &mut out);
            out.extend_from_slice(f);
        }
        self.writer.write_all(&out).await?;
        Ok(())
    }

    /// As a SUB: subscribes to messages whose first frame starts with `prefix` (the ZMTP 3.0
    /// form, a message `0x01 prefix`, which libzmq accepts from a 3.0 peer).
    pub async fn subscribe(&mut self, prefix: &[u8]) -> Result<(), ZmtpError> {
        let mut m = Vec::with_capacity(prefix.len() + 1);
        m.push(1);
        m.extend_from_slice(prefix);
        self.send(&[&m]).await
    }
}

fn command_name(body: &[u8]) -> Result<&[u8], ZmtpError> {
    let n = *body
        .first()
        .ok_or_else(|| ZmtpError::Protocol("empty command".into()))? as usize;
    body.get(1..1 + n)
        .ok_or_else(|| ZmtpError::Protocol("command name longer than the command".into()))
}

fn parse_ready(body: &[u8]) -> Result<String, ZmtpError> {
    if command_name(body)? != b"READY" {
        return protocol("the peer's first command is not READY");
    }
    let mut rest = &body[6..];
    while !rest.is_empty() {
        let n = rest[0] as usize;
        let name = rest
            .get(1..1 + n)
            .ok_or_else(|| ZmtpError::Protocol("READY property name cut".into()))?;
        let len_at = 1 + n;
        let len = rest
            .get(len_at..len_at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| ZmtpError::Protocol("READY property length cut".into()))?;
        let value = rest
            .get(len_at + 4..len_at + 4 + len)
            .ok_or_else(|| ZmtpError::Protocol("READY property value cut".into()))?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Ok(String::from_utf8_lossy(value).into_owned());
        }
        rest = &rest[len_at + 4 + len..];
    }
    protocol("READY without a Socket-Type")
}

// ---- binding sides (the test engine) -------------------------------------------------------

/// A PUB socket bound to a TCP port: every connected SUB gets the messages whose first frame
/// starts with one of its subscriptions. A subscriber that falls behind loses messages (as
/// libzmq's high-water mark drops them); it sees the gap in the sequence numbers.
#[derive(Debug)]
pub struct PubSocket {
    tx: tokio::sync::broadcast::Sender<std::sync::Arc<Vec<Bytes>>>,
    port: u16,
    accept: tokio::task::JoinHandle<()>,
    /// Connections accepted so far.
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Messages a slow subscriber may fall behind before it loses some.
const PUB_QUEUE: usize = 4096;

impl PubSocket {
    /// Binds `host:port` (port 0: any free port).
    pub async fn bind(host: &str, port: u16) -> Result<PubSocket, ZmtpError> {
        let listener = tokio::net::TcpListener::bind((host, port)).await?;
        let port = listener.local_addr()?.port();
        let (tx, _) = tokio::sync::broadcast::channel(PUB_QUEUE);
        let sender = tx.clone();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = std::sync::Arc::clone(&accepted);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::spawn(serve_subscriber(stream, sender.subscribe()));
            }
        });
        Ok(PubSocket {
            tx,
            port,
            accept,
            accepted,
        })
    }

    /// Connections accepted so far (each subscription is one).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sends a message to every subscriber whose subscription matches.
    pub fn publish(&self, frames: Vec<Bytes>) {
        // No subscriber: dropped, as a PUB does.
        let _ = self.tx.send(std::sync::Arc::new(frames));
    }
}

impl Drop for PubSocket {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn serve_subscriber(
    stream: TcpStream,
    mut rx: tokio::sync::broadcast::Receiver<std::sync::Arc<Vec<Bytes>>>,
) {
    const DEADLINE: Duration = Duration::from_secs(5);
    let Ok(mut c) = Connection::handshake(stream, "PUB", DEADLINE).await else {
        return;
    };
    // A SUB subscribes right after the handshake; later subscriptions are not read.
    let mut prefixes: Vec<Bytes> = Vec::new();
    while prefixes.is_empty() {
        match tokio::time::timeout(DEADLINE, c.recv()).await {
            Ok(Ok(m)) => {
                if let Some(f) = m.first().filter(|f| f.first() == Some(&1)) {
                    prefixes.push(f.slice(1..));
                }
            }
            _ => return,
        }
    }
    loop {
        let m = match rx.recv().await {
            Ok(m) => m,
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        };
        let topic = m.first().map(|f| &f[..]).unwrap_or(&[]);
        if !prefixes.iter().any(|p| topic.starts_with(p)) {
            continue;
        }
        let frames: Vec<&[u8]> = m.iter().map(|f| &f[..]).collect();
        let sent = tokio::time::timeout(DEADLINE, c.send(&frames)).await;
        if !matches!(sent, Ok(Ok(()))) {
            return;
        }
    }
}

/// Answers one request of a ROUTER socket: the request's frames (without the peer identity
/// a ROUTER adds), and the messages to send back.
pub type RouterHandler = std::sync::Arc<dyn Fn(Vec<Bytes>) -> Vec<Vec<Bytes>> + Send + Sync>;

/// A ROUTER socket bound to a TCP port, answering each DEALER's requests with `handler`.
#[derive(Debug)]
pub struct RouterSocket {
    port: u16,
    accept: tokio::task::JoinHandle<()>,
}

impl RouterSocket {
    /// Binds `host:port` (port 0: any free port).
    pub async fn bind(
        host: &str,
        port: u16,
        handler: RouterHandler,
    ) -> Result<RouterSocket, ZmtpError> {
        let listener = tokio::net::TcpListener::bind((host, port)).await?;
        let port = listener.local_addr()?.port();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let handler = std::sync::Arc::clone(&handler);
                tokio::spawn(async move {
                    const DEADLINE: Duration = Duration::from_secs(30);
                    let Ok(mut c) = Connection::handshake(stream, "ROUTER", DEADLINE).await else {
                        return;
                    };
                    while let Ok(Ok(request)) = tokio::time::timeout(DEADLINE, c.recv()).await {
                        for reply in handler(request) {
                            let frames: Vec<&[u8]> = reply.iter().map(|f| &f[..]).collect();
                            if !matches!(
                                tokio::time::timeout(DEADLINE, c.send(&frames)).await,
                                Ok(Ok(()))
                            ) {
                                return;
                            }
                        }
                    }
                });
            }
        });
        Ok(RouterSocket { port, accept })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for RouterSocket {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

#[cfg(test)]
mod tests;
