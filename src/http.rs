//! The HTTP/1.1 server both binaries run (router and worker), and deadline-bounded body
//! reads: a connection cap, a header-read timeout (slow-loris clients are cut off), a
//! write-stall timeout (clients that stop reading are cut off), accept errors backed off
//! instead of spun on, TCP_NODELAY, lingering closes (an answer given before the body was
//! read, such as a 413, reaches a client still uploading), and bodies collected under a
//! size cap and a total deadline.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Semaphore, watch};

pub mod budget;

/// The response body of every kvroute HTTP endpoint. A streamed answer that cannot end as
/// it should fails with [`BodyAborted`] ([`streamed`]).
pub type Body = BoxBody<Bytes, BodyAborted>;

/// A streamed answer that could not end as it should: hyper closes the connection without
/// the body's end, so the client sees a broken answer rather than a shorter one taken for
/// whole (OpenAI's clients read a clean end without `[DONE]` as the answer's end).
#[derive(Debug, thiserror::Error)]
#[error("the answer was cut off")]
pub struct BodyAborted;

/// A whole body of `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    use http_body_util::BodyExt;
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// Says that a [`streamed`] body's sender ended it as it should.
#[derive(Clone, Debug, Default)]
pub struct Ending(Arc<std::sync::atomic::AtomicBool>);

impl Ending {
    /// The body ends cleanly once the sender is gone.
    pub fn complete(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }

    fn is_complete(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A body of what arrives on `rx`, each item's bytes by `bytes` (the item goes, with what it
/// holds, once its frame is taken). It ends cleanly when the sender is gone having called
/// [`Ending::complete`], and fails with [`BodyAborted`] when it is gone without.
pub fn streamed<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
    ending: Ending,
    bytes: fn(T) -> Bytes,
) -> Body {
    use http_body_util::{BodyExt, StreamBody};
    let frames = futures_util::stream::unfold(Some((rx, ending)), move |state| async move {
        let (mut rx, ending) = state?;
        match rx.recv().await {
            Some(item) => Some((
                Ok(hyper::body::Frame::data(bytes(item))),
                Some((rx, ending)),
            )),
            None if ending.is_complete() => None,
            None => Some((Err(BodyAborted), None)),
        }
    });
    BodyExt::boxed(StreamBody::new(frames))
}

/// Limits of an HTTP server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Connections served at once; further clients wait in the kernel's accept queue.
    pub max_connections: usize,
    /// A connection must deliver a request's headers within this long of starting to wait
    /// for them (also closes keep-alive connections idle this long), ms.
    pub header_read_timeout_ms: u64,
    /// A request body must arrive whole within this long, ms.
    pub body_read_timeout_ms: u64,
    /// A connection whose client has read nothing of what it is sent for this long is
    /// closed, ms: its socket buffers are full and the answer cannot progress (a client that
    /// stopped reading would otherwise hold its connection slot for good).
    pub write_stall_timeout_ms: u64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            max_connections: 10_000,
            header_read_timeout_ms: 30_000,
            body_read_timeout_ms: 30_000,
            write_stall_timeout_ms: 30_000,
        }
    }
}

/// Why an HTTP server's settings cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HttpConfigError {
    /// A limit of zero would refuse every client.
    #[error("http.{field} must be at least 1")]
    Zero {
        /// The setting.
        field: &'static str,
    },
    /// More connections than a process can hold (a file descriptor each): meant as
    /// "unlimited", it would have failed the listener at start (a semaphore's limit) while
    /// the process stayed up and ready.
    #[error("http.max_connections must be at most {max} (a file descriptor each)")]
    TooManyConnections {
        /// The limit.
        max: usize,
    },
}

/// Most connections one listener may allow: 2^20, the largest open-files limit Linux allows
/// by default (`fs.nr_open`).
pub const MAX_CONNECTIONS: usize = 1 << 20;

impl HttpConfig {
    /// Checks that no limit is zero, and that the connections fit a process.
    pub fn validate(&self) -> Result<(), HttpConfigError> {
        if self.max_connections > MAX_CONNECTIONS {
            return Err(HttpConfigError::TooManyConnections {
                max: MAX_CONNECTIONS,
            });
        }
        let checks = [
            ("max_connections", self.max_connections as u64),
            ("header_read_timeout_ms", self.header_read_timeout_ms),
            ("body_read_timeout_ms", self.body_read_timeout_ms),
            ("write_stall_timeout_ms", self.write_stall_timeout_ms),
        ];
        match checks.into_iter().find(|(_, v)| *v == 0) {
            Some((field, _)) => Err(HttpConfigError::Zero { field }),
            None => Ok(()),
        }
    }
}

/// Longest pause after a failing `accept` (EMFILE, ENFILE, ENOBUFS): the loop backs off
/// from 5 ms, doubling, instead of spinning a core until descriptors free up.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Most bytes hyper buffers for a request head (its line and headers), 64 KiB.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// Serves HTTP/1.1 on `listener` with `handler` until `shutdown` turns true, then returns
/// once every connection accepted has closed: each finishes the request it is serving (a
/// stream to the last byte its client reads), an idle one at once. A caller draining waits
/// for this under its deadline; returning earlier, a process would exit with answers still
/// in its sockets. Each connection holds one of `max_connections` permits, taken before
/// `accept`, so a flood queues in the kernel instead of in memory. `name` labels its
/// connections in `kvroute_http_connections_open{listener}` (`api`, `admin`, `status`…).
pub async fn serve_http<F, Fut>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    config: HttpConfig,
    handler: F,
    mut shutdown: watch::Receiver<bool>,
) where
    F: Fn(hyper::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let header_timeout = Duration::from_millis(config.header_read_timeout_ms.max(1));
    let write_stall = Duration::from_millis(config.write_stall_timeout_ms.max(1));
    let mut backoff = Duration::ZERO;
    loop {
        let permit = tokio::select! {
            p = Arc::clone(&permits).acquire_owned() => p.expect("invariant: the semaphore is never closed"),
            _ = shutdown.changed() => break,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff = Duration::ZERO;
                stream
            }
            Err(e) => {
                backoff = (backoff * 2).clamp(Duration::from_millis(5), ACCEPT_BACKOFF_MAX);
                metrics::counter!("kvroute_http_accept_errors_total").increment(1);
                tracing::warn!(error = %e, backoff_ms = backoff.as_millis() as u64, "accept failed; backing off");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => break,
                }
                continue;
            }
        };
        configure(&stream);
        let handler = handler.clone();
        let mut closing = shutdown.clone();
        let open = OpenConnection::new(name);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = handler(req);
                async move { Ok::<_, Infallible>(response.await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                // A request head larger than this is refused (431) and the connection
                // closed: hyper's default lets one connection buffer ~400 KiB of headers,
                // gigabytes over the connection cap, for clients that never finish them.
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(TokioIo::new(ClientIo::new(stream, write_stall)), service);
            tokio::pin!(connection);
            // On shutdown a kept-alive connection must not take new requests: the request
            // in progress (its stream included) finishes, then the connection closes; an
            // idle one closes now. Otherwise pooled clients keep sending to a draining
            // process until the drain's deadline cuts everything.
            let stopping = async move {
                let _ = closing.wait_for(|stop| *stop).await;
            };
            let finished = tokio::select! {
                _ = connection.as_mut() => true,
                () = stopping => false,
            };
            if !finished {
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            }
            drop((open, permit));
        });
    }
    drop(listener);
    let all = u32::try_from(config.max_connections.max(1)).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
}

/// An open connection, counted in `kvroute_http_connections_open{listener}` while it
/// lives: the count goes down however the connection's task ends (a handler that panics
/// unwinds it).
struct OpenConnection(&'static str);

impl OpenConnection {
    fn new(listener: &'static str) -> OpenConnection {
        metrics::gauge!("kvroute_http_connections_open", "listener" => listener).increment(1.0);
        OpenConnection(listener)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        metrics::gauge!("kvroute_http_connections_open", "listener" => self.0).decrement(1.0);
    }
}

/// Longest a closing connection reads and discards what its client still sends.
const LINGER_MAX: Duration = Duration::from_secs(5);
/// A closing connection whose client sends nothing for this long is closed at once: longer
/// than a round trip on a slow link, where the client's next segment is still on its way
/// (nginx waits 5 s, `lingering_timeout`); an idle kept-alive client costs a drain this.
const LINGER_IDLE: Duration = Duration::from_secs(1);
/// Most bytes a closing connection discards.
const LINGER_MAX_BYTES: usize = 64 << 20;

/// A client connection's I/O.
///
/// Its writes fail with `TimedOut` once they have made no progress for `stall`: hyper has
/// no write timeout, and a write to a client that reads nothing waits for as long as the
/// peer's TCP stack acknowledges window probes.
///
/// It closes lingering: its shutdown sends FIN, then reads and drops what the client still
/// sends until the client closes too, goes quiet for `LINGER_IDLE`, or `LINGER_MAX` or
/// `LINGER_MAX_BYTES` is reached. A server that closes a socket with unread bytes in it
/// makes the kernel answer with a reset, and a reset discards what the client had not read
/// yet: a client still uploading a body refused with 413 (or any answer given before its
/// body was read) would see its connection reset instead of the answer.
struct ClientIo<S> {
    io: S,
    stall: Duration,
    /// Armed when a write finds the socket full; disarmed when one makes progress.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Set once the write half is shut: then the linger's deadlines, and the bytes
    /// discarded.
    closing: Option<Closing>,
}

struct Closing {
    until: Pin<Box<tokio::time::Sleep>>,
    quiet: Pin<Box<tokio::time::Sleep>>,
    discarded: usize,
}

impl<S> ClientIo<S> {
    fn new(io: S, stall: Duration) -> ClientIo<S> {
        ClientIo {
            io,
            stall,
            deadline: None,
            closing: None,
        }
    }

    /// What a write that returned `poll` means, the deadline considered.
    fn check<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.deadline = None;
            return poll;
        }
        let stall = self.stall;
        let deadline = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {stall:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ClientIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for ClientIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.check(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.check(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.check(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.closing.is_none() {
            let poll = Pin::new(&mut this.io).poll_shutdown(cx);
            std::task::ready!(this.check(cx, poll))?;
            this.closing = Some(Closing {
                until: Box::pin(tokio::time::sleep(LINGER_MAX)),
                quiet: Box::pin(tokio::time::sleep(LINGER_IDLE)),
                discarded: 0,
            });
        }
        let closing = this.closing.as_mut().expect("invariant: set above");
        let mut scratch = [0u8; 8192];
        loop {
            if closing.until.as_mut().poll(cx).is_ready() || closing.discarded >= LINGER_MAX_BYTES {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    closing.discarded += buf.filled().len();
                    let quiet = tokio::time::Instant::now() + LINGER_IDLE;
                    closing.quiet.as_mut().reset(quiet);
                }
                // The client closed too, or its connection failed: nothing to protect.
                Poll::Ready(_) => return Poll::Ready(Ok(())),
                Poll::Pending => {
                    return match closing.quiet.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Ok(())),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
    }
}

/// Runs `f` (CPU work such as tokenizing a request body) on the blocking pool once one of
/// `permits` is free, so that it never stalls the async threads; a caller that finds none
/// free within `wait` gets [`BlockingError::Busy`] (every thread taken by large prompts:
/// the router answers 429 instead of waiting without end, holding the request's in-flight
/// slot and its body). The blocking task holds the permit until `f` returns: a client that
/// leaves drops the caller's future, not work already started, which still counts until it
/// ends.
pub async fn run_blocking<T: Send + 'static>(
    permits: &Arc<Semaphore>,
    wait: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, BlockingError> {
    let permit = tokio::time::timeout(wait, Arc::clone(permits).acquire_owned())
        .await
        .map_err(|_| BlockingError::Busy { wait })?
        .expect("invariant: the semaphore is never closed");
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        f()
    })
    .await
    .map_err(BlockingError::Failed)
}

/// Why [`run_blocking`] did not run its work.
#[derive(Debug, thiserror::Error)]
pub enum BlockingError {
    /// No permit came free in time.
    #[error("every thread for this work stayed busy for {wait:?}; retry later")]
    Busy {
        /// How long it waited.
        wait: Duration,
    },
    /// The work panicked, or the runtime shut down under it.
    #[error("the work failed")]
    Failed(#[source] tokio::task::JoinError),
}

/// How long an idle connection to an engine is kept for the next request by default, ms:
/// under the 5 s keep-alive of the engines' servers (uvicorn's `timeout_keep_alive`: vLLM
/// passes `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 by default; SGLang keeps uvicorn's 5). An
/// engine that closes a connection as a request is sent on it fails the request
/// ("connection closed before message completed"); hyper-util keeps them 90 s.
pub const ENGINE_POOL_IDLE_MS: u64 = 4_000;

/// Longest wait for a tokenizer thread before a request is refused (429 by the router, 503
/// by kvroute-worker).
pub const TOKENIZER_WAIT: Duration = Duration::from_secs(10);

/// Socket options of every accepted connection: streamed chunks must not wait for Nagle's
/// algorithm (≈ 40 ms per first byte on a reused connection, with delayed ACKs), and TCP
/// keepalive notices a client whose host vanished (a laptop asleep, a NAT mapping dropped)
/// in about a minute: while it waits for a non-streamed answer nothing is written to it, so
/// without keepalive its request kept generating and held its booking until the answer's
/// deadline.
fn configure(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
    }
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "cannot set TCP keepalive");
    }
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Longer than the limit.
    #[error("body over {limit} bytes")]
    TooLarge {
        /// The limit, bytes.
        limit: usize,
    },
    /// Not complete within the deadline.
    #[error("body not complete within {ms} ms")]
    TimedOut {
        /// The deadline, ms.
        ms: u64,
    },
    /// The bodies held at once would pass their shared budget ([`budget::BodyBudget`]).
    #[error("request bodies in memory would pass the budget of {budget} bytes")]
    OverBudget {
        /// The budget, bytes.
        budget: usize,
    },
    /// The connection failed while reading it.
    #[error("reading the body failed: {0}")]
    Io(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Collects `body` whole, at most `limit` bytes, within `deadline`.
pub async fn collect_body<B>(body: B, limit: usize, deadline: Duration) -> Result<Bytes, BodyError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    budget::collect(body, limit, deadline, None)
        .await
        .map(|(bytes, _)| bytes)
}

#[cfg(test)]
mod tests;
