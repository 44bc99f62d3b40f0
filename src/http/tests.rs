use std::time::Duration;

use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

async fn server(config: HttpConfig) -> (std::net::SocketAddr, watch::Sender<bool>) {
    serving(config, |_req| async {
        Response::new(super::full(Bytes::from_static(b"ok")))
    })
    .await
}

/// A server on a free loopback port answering with `handler`; its address, and what stops
/// it.
async fn serving<F, Fut>(
    config: HttpConfig,
    handler: F,
) -> (std::net::SocketAddr, watch::Sender<bool>)
where
    F: Fn(hyper::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = watch::channel(false);
    tokio::spawn(serve_http("test", listener, config, handler, rx));
    (addr, stop)
}

/// Reads until the server closes the connection; what it sent.
async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A client that sends half a request and stops (slow-loris) is cut off after the header
/// timeout. The clock is paused: the timeout elapses without a wall-clock wait.
#[tokio::test(start_paused = true)]
async fn a_half_sent_request_is_cut_off_at_the_header_timeout() {
    let (addr, _stop) = server(HttpConfig {
        header_read_timeout_ms: 5_000,
        ..HttpConfig::default()
    })
    .await;
    let mut loris = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        loris.push(s);
    }
    for s in &mut loris {
        // EOF (or a 408 then EOF): the server hung up on it.
        let got = tokio::time::timeout(Duration::from_secs(60), read_to_close(s))
            .await
            .expect("the server never closed a half-sent request");
        assert!(got.is_empty() || got.starts_with("HTTP/1.1 408"), "{got}");
    }
    // A whole request is still served.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    assert!(read_to_close(&mut s).await.starts_with("HTTP/1.1 200"));
}

/// A request head larger than `MAX_HEAD_BYTES` is refused and its connection closed at
/// once, not at the header timeout (two minutes here): a client never finishing its
/// headers holds 64 KiB at most.
#[tokio::test]
async fn a_request_head_past_its_cap_is_refused() {
    let (addr, _stop) = server(HttpConfig {
        header_read_timeout_ms: 120_000,
        ..HttpConfig::default()
    })
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let header = format!("x-pad: {}\r\n", "a".repeat(1000));
    // 100 KiB of headers, never ended; the server may close before all of it is sent.
    for _ in 0..100 {
        if s.write_all(header.as_bytes()).await.is_err() {
            break;
        }
    }
    // A 431 then EOF, or a reset (the server closed with unread bytes): either way closed.
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the server kept buffering an endless request head"
    );
    // A request head under the cap is served.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "GET / HTTP/1.1\r\nhost: x\r\n{}connection: close\r\n\r\n",
        header.repeat(30)
    );
    s.write_all(head.as_bytes()).await.unwrap();
    assert!(read_to_close(&mut s).await.starts_with("HTTP/1.1 200"));
}

/// Past `max_connections`, further clients wait in the accept queue until one leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_for_a_slot() {
    let (addr, _stop) = server(HttpConfig {
        max_connections: 2,
        header_read_timeout_ms: 3_600_000,
        ..HttpConfig::default()
    })
    .await;
    let mut first = TcpStream::connect(addr).await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    // Both served: they answer.
    for s in [&mut first, &mut second] {
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
    }
    let mut third = TcpStream::connect(addr).await.unwrap();
    third
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 12];
    // Not served while two connections hold the slots.
    let early = tokio::time::timeout(Duration::from_millis(300), third.read_exact(&mut buf)).await;
    assert!(
        early.is_err(),
        "a third connection was served beyond the cap of 2"
    );
    drop(first);
    tokio::time::timeout(Duration::from_secs(30), third.read_exact(&mut buf))
        .await
        .expect("the third connection got no slot after one closed")
        .unwrap();
    assert_eq!(&buf, b"HTTP/1.1 200");
}

/// A body that stops arriving fails at the deadline; one over the cap fails at once.
#[tokio::test(start_paused = true)]
async fn bodies_have_a_deadline_and_a_size_cap() {
    let never = StreamBody::new(futures_util::stream::pending::<
        Result<Frame<Bytes>, BodyAborted>,
    >());
    let r = collect_body(never, 1024, Duration::from_secs(5)).await;
    assert!(matches!(r, Err(BodyError::TimedOut { ms: 5000 })), "{r:?}");
    let big = Full::new(Bytes::from(vec![0u8; 2048]));
    let r = collect_body(big, 1024, Duration::from_secs(5)).await;
    assert!(
        matches!(r, Err(BodyError::TooLarge { limit: 1024 })),
        "{r:?}"
    );
    let ok = collect_body(
        Full::new(Bytes::from_static(b"hi")),
        1024,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(ok.unwrap(), Bytes::from_static(b"hi"));
}

/// An answer given before the request's body was read (a 413 for a body over the cap)
/// reaches a client that is still uploading it: the server closes lingering, reading and
/// dropping the rest of the body, where a plain close with unread bytes resets the
/// connection and the reset discards the answer before the client reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_before_the_body_reaches_a_client_still_uploading() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, rx) = watch::channel(false);
    tokio::spawn(serve_http(
        "test",
        listener,
        HttpConfig::default(),
        |_req: hyper::Request<Incoming>| async {
            let mut refused = Response::new(super::full(Bytes::from_static(b"too large")));
            *refused.status_mut() = hyper::StatusCode::PAYLOAD_TOO_LARGE;
            refused
        },
        rx,
    ));
    let body = vec![b'x'; 8 << 20];
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // The whole body goes out before the client reads: with a plain close the server's
    // reset arrives first, and this write fails or the read below does.
    let sent = tokio::time::timeout(Duration::from_secs(60), s.write_all(&body))
        .await
        .expect("the server neither read nor refused the body");
    assert!(sent.is_ok(), "the upload was cut: {sent:?}");
    let answer = tokio::time::timeout(Duration::from_secs(60), read_to_close(&mut s))
        .await
        .expect("the server never closed");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer:?}");
    assert!(answer.ends_with("too large"), "{answer:?}");
}

#[test]
fn zero_limits_are_refused() {
    let c = HttpConfig {
        max_connections: 0,
        ..HttpConfig::default()
    };
    assert_eq!(
        c.validate(),
        Err(HttpConfigError::Zero {
            field: "max_connections"
        })
    );
    assert_eq!(HttpConfig::default().validate(), Ok(()));
}

/// Accepted connections have TCP_NODELAY (the first-byte latency it saves is measured by
/// the router-overhead bench, not asserted here).
#[tokio::test]
async fn accepted_connections_have_nodelay() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (server, _) = listener.accept().await.unwrap();
    assert!(!server.nodelay().unwrap());
    configure(&server);
    assert!(server.nodelay().unwrap());
    drop(client);
}

/// A client that stops reading cannot hold its connection slot: once the answer has made
/// no progress for the write-stall timeout the connection is closed, and the next client
/// is served. The clock is paused: the timeout elapses without a wall-clock wait.
#[tokio::test(start_paused = true)]
async fn a_client_that_stops_reading_is_cut_off_and_frees_its_slot() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, rx) = watch::channel(false);
    let big = Bytes::from(vec![b'x'; 64 << 20]);
    tokio::spawn(serve_http(
        "test",
        listener,
        HttpConfig {
            max_connections: 1,
            write_stall_timeout_ms: 5_000,
            ..HttpConfig::default()
        },
        move |req: hyper::Request<Incoming>| {
            let big = big.clone();
            async move {
                let body = if req.uri().path() == "/big" {
                    big
                } else {
                    Bytes::from_static(b"ok")
                };
                Response::new(super::full(body))
            }
        },
        rx,
    ));
    // Asks for 64 MiB and reads none of it: the socket buffers fill and the write stalls.
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled
        .write_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    // The only slot is the stalled client's until the server gives up on it.
    let mut next = TcpStream::connect(addr).await.unwrap();
    next.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(600), read_to_close(&mut next))
        .await
        .expect("the stalled client kept the only connection slot");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(stalled);
}

/// A client that leaves while its body is being tokenized drops the request's future, not
/// the work on the blocking pool: that work keeps its permit until it ends, so clients
/// that connect, send a large body and leave cannot run more than the permits at once.
#[tokio::test]
async fn tokenizing_keeps_its_permit_after_the_client_left() {
    let permits = Arc::new(Semaphore::new(1));
    let (started_tx, started) = std::sync::mpsc::channel::<()>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let call = tokio::spawn({
        let permits = Arc::clone(&permits);
        async move {
            run_blocking(&permits, Duration::from_secs(60), move || {
                started_tx.send(()).unwrap();
                go_rx.recv().unwrap();
            })
            .await
        }
    });
    tokio::task::spawn_blocking(move || started.recv().unwrap())
        .await
        .unwrap();
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert_eq!(
        permits.available_permits(),
        0,
        "the permit went back while the work still ran"
    );
    go.send(()).unwrap();
    // Returns once the work has ended and given its permit back.
    drop(permits.acquire().await.unwrap());
}

/// Reads until `end` has arrived (a kept-alive response does not close).
async fn read_until(s: &mut TcpStream, end: &str) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&out).contains(end) {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before {end:?}: {}",
            String::from_utf8_lossy(&out)
        );
        out.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A streamed answer whose sender goes without ending it as it should reaches the client
/// without the chunked body's end (its client sees a broken answer, not a whole one); one
/// ended as it should ends with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_cut_off_has_no_clean_end() {
    let (addr, _stop) = serving(
        HttpConfig::default(),
        move |req: hyper::Request<Incoming>| async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(2);
            let ending = Ending::default();
            let body = streamed(rx, ending.clone(), |b| b);
            let whole = req.uri().path() == "/whole";
            tokio::spawn(async move {
                tx.send(Bytes::from_static(b"data: 1\n\n")).await.unwrap();
                if whole {
                    tx.send(Bytes::from_static(b"data: [DONE]\n\n"))
                        .await
                        .unwrap();
                    ending.complete();
                }
            });
            Response::new(body)
        },
    )
    .await;
    for (path, whole) in [("/whole", true), ("/cut", false)] {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(30), read_to_close(&mut c))
            .await
            .expect("the connection stayed open");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // (What was queued before the cut may or may not have been written out.)
        assert!(!whole || answer.contains("data: 1"), "{answer}");
        assert_eq!(answer.ends_with("0\r\n\r\n"), whole, "{path}: {answer:?}");
    }
}

/// On shutdown a kept-alive connection takes no new request: an idle one closes at once,
/// one whose response is still streaming finishes it and then closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_kept_alive_connections_once_their_request_is_done() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = watch::channel(false);
    let release = Arc::new(tokio::sync::Notify::new());
    let released = Arc::clone(&release);
    let server = tokio::spawn(serve_http(
        "test",
        listener,
        HttpConfig::default(),
        move |req: hyper::Request<Incoming>| {
            let released = Arc::clone(&released);
            async move {
                if req.uri().path() != "/stream" {
                    return Response::new(super::full(Bytes::from_static(b"ok")));
                }
                let chunks = futures_util::stream::unfold(0, move |i| {
                    let released = Arc::clone(&released);
                    async move {
                        match i {
                            0 => Some((Bytes::from_static(b"first;"), 1)),
                            1 => {
                                released.notified().await;
                                Some((Bytes::from_static(b"last;"), 2))
                            }
                            _ => None,
                        }
                    }
                });
                let body = StreamBody::new(futures_util::StreamExt::map(chunks, |b| {
                    Ok::<_, super::BodyAborted>(Frame::data(b))
                }));
                Response::new(BodyExt::boxed(body))
            }
        },
        rx,
    ));
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    read_until(&mut idle, "ok").await;
    let mut busy = TcpStream::connect(addr).await.unwrap();
    busy.write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    read_until(&mut busy, "first;").await;
    stop.send(true).unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(30), read_to_close(&mut idle))
        .await
        .expect("an idle kept-alive connection stayed open after shutdown");
    assert_eq!(closed, "");
    // The server is not done while a connection still serves its response (checked once
    // the idle connection's close shows it has heard the shutdown).
    assert!(
        !server.is_finished(),
        "returned with a stream still being served"
    );
    release.notify_one();
    let rest = tokio::time::timeout(Duration::from_secs(30), read_to_close(&mut busy))
        .await
        .expect("the streaming connection stayed open after its response");
    assert!(rest.contains("last;"), "{rest}");
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("the server did not return once every connection closed")
        .unwrap();
}

/// With every permit held, a caller waits at most its `wait` and is told the pool is busy;
/// the work is not run. (Paused clock: the wait elapses at once.)
#[tokio::test(start_paused = true)]
async fn a_caller_finding_every_permit_taken_gives_up_after_its_wait() {
    let permits = Arc::new(Semaphore::new(1));
    let held = Arc::clone(&permits).acquire_owned().await.unwrap();
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r = run_blocking(&permits, Duration::from_secs(10), {
        let ran = Arc::clone(&ran);
        move || ran.store(true, std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    assert!(
        matches!(r, Err(BlockingError::Busy { wait }) if wait == Duration::from_secs(10)),
        "{r:?}"
    );
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    drop(held);
    assert_eq!(
        run_blocking(&permits, Duration::from_secs(10), || 7)
            .await
            .unwrap(),
        7
    );
}

/// Accepted connections keep TCP alive: a client whose host vanished while it waited for a
/// non-streamed answer (nothing written to it meanwhile) is noticed, not waited on until the
/// answer's deadline.
#[tokio::test]
async fn accepted_connections_keep_tcp_alive() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap());
    let (accepted, _client) = tokio::join!(listener.accept(), client);
    let (accepted, _) = accepted.unwrap();
    configure(&accepted);
    let socket = socket2::SockRef::from(&accepted);
    assert!(socket.keepalive().unwrap());
    assert_eq!(
        socket.tcp_keepalive_time().unwrap(),
        Duration::from_secs(30)
    );
    assert!(socket.tcp_nodelay().unwrap());
}
