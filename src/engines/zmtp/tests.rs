use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;

use super::*;

const T: Duration = Duration::from_secs(10);

fn b(s: &[u8]) -> Bytes {
    Bytes::copy_from_slice(s)
}

#[tokio::test]
async fn sub_gets_what_matches_its_subscription() {
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", pubs.port());
    let mut sub = Connection::connect(&endpoint, "SUB", T).await.unwrap();
    assert_eq!(sub.peer_type(), "PUB");
    sub.subscribe(b"kv").await.unwrap();
    let big = vec![7u8; 100_000];
    // The subscription reaches the publisher asynchronously: publish until one arrives.
    let first = loop {
        pubs.publish(vec![b(b"other"), b(b"x")]);
        pubs.publish(vec![b(b"kv@1"), b(&1u64.to_be_bytes()), b(&big)]);
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            break m.unwrap();
        }
    };
    assert_eq!(first[0], b(b"kv@1"));
    assert_eq!(first[2].len(), 100_000);
}

#[tokio::test]
async fn dealer_and_router_exchange_multipart_messages() {
    let handler: RouterHandler = Arc::new(|req: Vec<Bytes>| {
        vec![
            req.clone(),
            vec![b(b""), b(&u64::MAX.to_be_bytes()), b(b"")],
        ]
    });
    let router = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", router.port());
    let mut dealer = Connection::connect(&endpoint, "DEALER", T).await.unwrap();
    assert_eq!(dealer.peer_type(), "ROUTER");
    dealer.send(&[b"", &5u64.to_be_bytes()]).await.unwrap();
    assert_eq!(
        dealer.recv().await.unwrap(),
        vec![b(b""), b(&5u64.to_be_bytes())]
    );
    assert_eq!(dealer.recv().await.unwrap()[1], b(&[0xff; 8]));
}

/// A socket pair libzmq would not serve (the event and replay ports swapped) is refused at
/// the handshake, naming what the endpoint is.
#[tokio::test]
async fn sockets_that_cannot_pair_are_refused() {
    let handler: RouterHandler = Arc::new(|_| Vec::new());
    let router = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let at_router = format!("tcp://127.0.0.1:{}", router.port());
    let at_pub = format!("tcp://127.0.0.1:{}", pubs.port());
    for (endpoint, ours, theirs) in [(&at_router, "SUB", "ROUTER"), (&at_pub, "DEALER", "PUB")] {
        match Connection::connect(endpoint, ours, T).await {
            Err(ZmtpError::Protocol(m)) => assert!(m.contains(theirs), "{m}"),
            other => panic!(
                "{ours} to a {theirs}: {:?}",
                other.map(|c| c.peer_type().to_owned())
            ),
        }
    }
    assert!(Connection::connect(&at_pub, "SUB", T).await.is_ok());
    assert!(Connection::connect(&at_router, "DEALER", T).await.is_ok());
}

#[tokio::test]
async fn a_peer_that_is_not_zmtp_or_lies_about_sizes_is_refused() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        // First: an HTTP server's answer.
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(&[b'H'; 64]).await.unwrap();
        // Second: a valid handshake, then a frame claiming 1 TiB.
        let (s, _) = listener.accept().await.unwrap();
        let mut c = Connection::handshake(s, "PUB", T).await.unwrap();
        c.writer.write_all(&[LONG]).await.unwrap();
        c.writer
            .write_all(&(1u64 << 40).to_be_bytes())
            .await
            .unwrap();
        c.writer.flush().await.unwrap();
        tokio::time::sleep(T).await;
    });
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let err = Connection::connect(&endpoint, "SUB", T).await.unwrap_err();
    assert!(err.to_string().contains("signature"), "{err}");
    let mut c = Connection::connect(&endpoint, "SUB", T).await.unwrap();
    let err = c.recv().await.unwrap_err();
    assert!(err.to_string().contains("over the"), "{err}");
    server.abort();
}

/// A frame is read as its bytes arrive, in pieces, whatever its size; a message's frames
/// together are bounded too (each one under the frame limit, sixteen of them were 256 MiB).
/// A data frame over its limit is read past: the message is refused and the next one reads
/// whole.
#[tokio::test]
async fn large_frames_arrive_whole_and_a_message_s_bytes_are_bounded() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let big: Vec<u8> = (0..3 * FIRST_READ + 7).map(|i| (i % 251) as u8).collect();
    let sent = big.clone();
    let server = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let mut c = Connection::handshake(s, "PUB", T).await.unwrap();
        // A topic, then the big frame in small writes.
        let mut out = Vec::new();
        frame_header(MORE, 5, &mut out);
        out.extend_from_slice(b"topic");
        frame_header(0, sent.len(), &mut out);
        out.extend_from_slice(&sent);
        for piece in out.chunks(1000) {
            c.writer.write_all(piece).await.unwrap();
            c.writer.flush().await.unwrap();
        }
        // Then a message of frames each under the frame limit, over the message's.
        let half = vec![0u8; MAX_FRAME / 2 + 1];
        for more in [MORE, MORE, 0] {
            let mut out = Vec::new();
            frame_header(more, half.len(), &mut out);
            c.writer.write_all(&out).await.unwrap();
            c.writer.write_all(&half).await.unwrap();
        }
        c.send(&[b"after"]).await.unwrap();
        c.writer.flush().await.unwrap();
        tokio::time::sleep(T).await;
    });
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let mut c = Connection::connect(&endpoint, "SUB", T).await.unwrap();
    let frames = c.recv().await.unwrap();
    assert_eq!(frames.len(), 2);
    assert_eq!(&frames[0][..], b"topic");
    assert_eq!(&frames[1][..], &big[..]);
    let err = c.recv().await.unwrap_err();
    assert!(err.to_string().contains("over the"), "{err}");
    let ZmtpError::Oversized { frames, frame, .. } = err else {
        panic!("{err}")
    };
    assert_eq!((frames.len(), frame), (3, 2));
    assert!(frames[2].is_empty());
    assert_eq!(&c.recv().await.unwrap()[0][..], b"after");
    server.abort();
}

#[test]
fn endpoints_are_tcp_host_port() {
    assert_eq!(tcp_address("tcp://10.0.0.1:5557").unwrap(), "10.0.0.1:5557");
    assert_eq!(tcp_address("tcp://*:5557").unwrap(), "127.0.0.1:5557");
    assert_eq!(tcp_address("tcp://[::1]:5557").unwrap(), "[::1]:5557");
    for bad in [
        "ipc:///tmp/x",
        "tcp://host",
        "tcp://:5",
        "tcp://h:99999",
        "5557",
    ] {
        assert!(tcp_address(bad).is_err(), "{bad}");
    }
}
