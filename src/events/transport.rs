//! The transport seam: subjects and byte payloads, over NATS (`async-nats`, core subjects)
//! or in-process (tokio channels, for `kvroute up` and tests). Everything above it speaks
//! subjects as DESIGN §5 lays them out; only this module knows which wire carries them.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

/// One message.
#[derive(Clone, Debug)]
pub struct Message {
    /// The subject it was published on.
    pub subject: String,
    /// Where the publisher wants answers, if anywhere.
    pub reply: Option<String>,
    /// The payload.
    pub payload: Bytes,
}

/// A transport failure.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Publishing failed (NATS connection lost and its buffer full, or closed).
    #[error("publish to {subject} failed: {reason}")]
    Publish {
        /// The subject.
        subject: String,
        /// What the client said.
        reason: String,
    },
    /// Subscribing failed.
    #[error("subscribe to {subject} failed: {reason}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// What the client said.
        reason: String,
    },
    /// Connecting to NATS failed.
    #[error("cannot connect to NATS at {url}: {reason}")]
    Connect {
        /// The server URL.
        url: String,
        /// What the client said.
        reason: String,
    },
}

/// Credentials a server URL carried: `nats://user:password@host` or `nats://token@host`.
#[derive(Debug, PartialEq, Eq)]
enum UrlCredentials {
    UserPassword(String, String),
    Token(String),
}

/// The servers of `urls` (comma-separated), with the credentials they carry taken out of
/// them: async-nats does not send a URL's credentials, and its debug logs print each
/// server's URL whole. The credentials come back for the connection's options (settings
/// given apart win over them); URLs that carry different ones are refused, as one set goes
/// to every server.
fn servers(urls: &str) -> Result<(Vec<async_nats::ServerAddr>, Option<UrlCredentials>), String> {
    let mut servers = Vec::new();
    let mut credentials = None;
    for u in urls.split(',') {
        let addr: async_nats::ServerAddr = u
            .trim()
            .parse()
            .map_err(|e| format!("not a NATS URL: {e}"))?;
        if addr.is_websocket() {
            // Built without the client's websocket support, it would dial the port as plain
            // NATS and wait forever for a greeting that never comes.
            return Err(format!(
                "{}: websocket URLs are not supported; use nats:// or tls:// (the server's client port)",
                crate::auth::redact_credentials(u.trim())
            ));
        }
        if !addr.has_user_pass() && addr.password().is_none() {
            servers.push(addr);
            continue;
        }
        let mut url = addr.into_inner();
        let user = crate::ingress::percent_decoded(url.username()).into_owned();
        let found = match url.password() {
            Some(p) => {
                UrlCredentials::UserPassword(user, crate::ingress::percent_decoded(p).into_owned())
            }
            None => UrlCredentials::Token(user),
        };
        // One set is sent to every server (the client's options are shared).
        match &credentials {
            Some(set) if *set != found => {
                return Err("the server URLs carry different credentials; give one set".into());
            }
            _ => credentials = Some(found),
        }
        let stripped = url.set_username("").is_ok() && url.set_password(None).is_ok();
        if !stripped {
            return Err("a server URL's credentials cannot be taken out of it".into());
        }
        servers.push(
            async_nats::ServerAddr::from_url(url).map_err(|e| format!("not a NATS URL: {e}"))?,
        );
    }
    Ok((servers, credentials))
}

/// NATS or in-process. Cheap to clone.
#[derive(Clone, Debug)]
pub enum Transport {
    /// A NATS client.
    Nats(NatsTransport),
    /// An in-process bus.
    Local(LocalBus),
}

/// A NATS client, the count of its reconnections, whether it is connected now and the
/// messages it dropped for a subscription whose queue was full.
#[derive(Clone, Debug)]
pub struct NatsTransport {
    /// The client.
    pub client: async_nats::Client,
    reconnects: watch::Receiver<u64>,
    connected: watch::Receiver<bool>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
}

/// Keeps `link` (up or down) and `reconnects` (connections after the first) as the client's
/// own state and connection count say, on each connection event (`wake`) and every second.
/// async-nats hands its events over a queue of 128 that drops what does not fit, and a burst
/// of slow-consumer events (one per message dropped) fills it: taken from the events, a lost
/// `Disconnected` left the router trusting silence through an outage (every lease expired)
/// and a lost `Connected` left it deaf for good. Ends when nobody reads the link.
async fn follow_link(
    client: async_nats::Client,
    link: Arc<watch::Sender<bool>>,
    reconnects: Arc<watch::Sender<u64>>,
    wake: Arc<tokio::sync::Notify>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = link.closed() => return,
            // The client says what happened before it sets its state: read it a moment
            // later (else the tick after would correct it, up to a second late).
            _ = wake.notified() => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            _ = tick.tick() => {}
        }
        let up = client.connection_state() == async_nats::connection::State::Connected;
        let was = link.send_replace(up);
        if was != up {
            metrics::gauge!("kvroute_nats_connected").set(if up { 1.0 } else { 0.0 });
            if !up {
                tracing::warn!("NATS connection lost; reconnecting");
            }
        }
        // The first connection is no reconnection.
        let after_first = client
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(1);
        reconnects.send_if_modified(|n| {
            let more = after_first > *n;
            *n = (*n).max(after_first);
            more
        });
    }
}

/// Warnings of messages dropped for a full subscription queue, all connections together.
static SLOW_CONSUMER_LOG: crate::process::LogEvery =
    crate::process::LogEvery::new(std::time::Duration::from_secs(10));

/// A subscription; `next` yields messages until the transport closes.
#[derive(Debug)]
pub enum Subscription {
    /// NATS.
    Nats(async_nats::Subscriber),
    /// In-process.
    Local(mpsc::Receiver<Message>),
}

impl Transport {
    /// Connects to NATS at `url` (several servers: comma-separated) with `auth`; the client
    /// reconnects by itself after outages, to any of the servers.
    pub async fn connect_nats(
        url: &str,
        name: &str,
        auth: &crate::auth::NatsAuth,
    ) -> Result<Transport, TransportError> {
        let (tx, reconnects) = watch::channel(0u64);
        let tx = Arc::new(tx);
        let (link, connected) = watch::channel(true);
        let link = Arc::new(link);
        let wake = Arc::new(tokio::sync::Notify::new());
        let woken = Arc::clone(&wake);
        let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let dropped_here = Arc::clone(&dropped);
        let connect_error = |reason: String| TransportError::Connect {
            url: crate::auth::redact_credentials(url),
            reason,
        };
        let (servers, in_url) = servers(url).map_err(connect_error)?;
        let mut options = match (&auth.nats_user, &auth.nats_password, &auth.nats_token) {
            (Some(user), Some(password), _) => async_nats::ConnectOptions::with_user_and_password(
                user.clone(),
                password.expose().to_owned(),
            ),
            (_, _, Some(token)) => {
                async_nats::ConnectOptions::with_token(token.expose().to_owned())
            }
            _ => match in_url {
                _ if auth.nats_nkey_seed_file.is_some() || auth.nats_creds_file.is_some() => {
                    async_nats::ConnectOptions::new()
                }
                Some(UrlCredentials::UserPassword(user, password)) => {
                    async_nats::ConnectOptions::with_user_and_password(user, password)
                }
                Some(UrlCredentials::Token(token)) => async_nats::ConnectOptions::with_token(token),
                None => async_nats::ConnectOptions::new(),
            },
        };
        if let Some(path) = &auth.nats_nkey_seed_file {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| connect_error(format!("nkey seed file {}: {e}", path.display())))?;
            options = options.nkey(seed.trim().to_owned());
        }
        if let Some(path) = &auth.nats_creds_file {
            let creds = std::fs::read_to_string(path)
                .map_err(|e| connect_error(format!("creds file {}: {e}", path.display())))?;
            options = options
                .credentials(&creds)
                .map_err(|e| connect_error(format!("creds file {}: {e}", path.display())))?;
        }
        if auth.tls() {
            options = options.require_tls(true);
        }
        if let Some(ca) = &auth.nats_tls_ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&auth.nats_tls_cert_file, &auth.nats_tls_key_file) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        let options = options
            .name(name)
            .subscription_capacity(SUBSCRIPTION_QUEUE)
            .event_callback(move |event| {
                let (wake, dropped) = (Arc::clone(&woken), Arc::clone(&dropped_here));
                async move {
                    match event {
                        // Read from the client's own state ([`follow_link`]).
                        async_nats::Event::Connected | async_nats::Event::Disconnected => {
                            wake.notify_one();
                        }
                        async_nats::Event::ServerError(e) => {
                            tracing::warn!(error = %e, "NATS server error")
                        }
                        // The client dropped a message: the subscription's queue was full
                        // (its reader behind by SUBSCRIPTION_QUEUE messages). One event per
                        // message, as long as the client's event queue has room.
                        async_nats::Event::SlowConsumer(sid) => {
                            dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            metrics::counter!("kvroute_nats_slow_consumer_total").increment(1);
                            if SLOW_CONSUMER_LOG.due() {
                                tracing::warn!(
                                    subscription = sid,
                                    queue = SUBSCRIPTION_QUEUE,
                                    "NATS client dropped messages: a subscription's reader is behind by its whole queue"
                                );
                            }
                        }
                        other => tracing::debug!(event = %other, "NATS event"),
                    }
                }
            })
            .connection_timeout(std::time::Duration::from_secs(5));
        // Retry while the server is unreachable (it may be starting beside us); give up at
        // once on what retrying cannot fix: refused credentials, TLS, a malformed URL.
        let mut backoff = std::time::Duration::from_millis(100);
        let client = loop {
            match options.clone().connect(servers.clone()).await {
                Ok(client) => break client,
                Err(e) => {
                    use async_nats::ConnectErrorKind as K;
                    match e.kind() {
                        // A TLS handshake refused either way (no client certificate, an
                        // unknown issuer) surfaces as an I/O error: retrying cannot fix it.
                        K::Io if tls_refused(&e) => {
                            return Err(connect_error(format!("TLS: {e}")));
                        }
                        K::Io | K::TimedOut | K::Dns => {
                            tracing::warn!(error = %e, url = %crate::auth::redact_credentials(url), "cannot reach NATS yet; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
                        }
                        _ => return Err(connect_error(e.to_string())),
                    }
                }
            }
        };
        metrics::gauge!("kvroute_nats_connected").set(1.0);
        tokio::spawn(follow_link(client.clone(), link, tx, wake));
        Ok(Transport::Nats(NatsTransport {
            client,
            reconnects,
            connected,
            dropped,
        }))
    }

    /// Publishes `payload` on `subject`, with a reply subject if given.
    pub async fn publish(
        &self,
        subject: &str,
        reply: Option<&str>,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        match self {
            Transport::Nats(NatsTransport { client, .. }) => {
                let result = match reply {
                    Some(r) => {
                        client
                            .publish_with_reply(subject.to_owned(), r.to_owned(), payload)
                            .await
                    }
                    None => client.publish(subject.to_owned(), payload).await,
                };
                result.map_err(|e| TransportError::Publish {
                    subject: subject.to_owned(),
                    reason: e.to_string(),
                })
            }
            Transport::Local(bus) => {
                #[cfg(test)]
                bus.held.until_released().await;
                bus.publish(Message {
                    subject: subject.to_owned(),
                    reply: reply.map(str::to_owned),
                    payload,
                });
                Ok(())
            }
        }
    }

    /// Subscribes to `subject` (NATS wildcards `*` and `>` allowed).
    pub async fn subscribe(&self, subject: &str) -> Result<Subscription, TransportError> {
        match self {
            Transport::Nats(NatsTransport { client, .. }) => client
                .subscribe(subject.to_owned())
                .await
                .map(Subscription::Nats)
                .map_err(|e| TransportError::Subscribe {
                    subject: subject.to_owned(),
                    reason: e.to_string(),
                }),
            Transport::Local(bus) => Ok(Subscription::Local(bus.subscribe(subject))),
        }
    }

    /// Messages dropped so far because a subscription's queue was full (for NATS, those
    /// the client said it dropped).
    pub fn dropped(&self) -> u64 {
        match self {
            Transport::Nats(NatsTransport { dropped, .. }) => {
                dropped.load(std::sync::atomic::Ordering::Relaxed)
            }
            Transport::Local(bus) => bus.dropped(),
        }
    }

    /// A fresh subject for replies.
    pub fn new_inbox(&self) -> String {
        match self {
            Transport::Nats(NatsTransport { client, .. }) => client.new_inbox(),
            Transport::Local(bus) => bus.new_inbox(),
        }
    }

    /// Largest payload one message may carry.
    pub fn max_payload(&self) -> usize {
        match self {
            // The client's copy, updated at each reconnect (one atomic read; the server's
            // whole INFO was cloned for it at every publish).
            Transport::Nats(NatsTransport { client, .. }) => client.max_payload().max(4096),
            #[cfg(test)]
            Transport::Local(bus) => {
                match bus.max_payload.load(std::sync::atomic::Ordering::Relaxed) {
                    0 => 1 << 20,
                    set => set,
                }
            }
            #[cfg(not(test))]
            Transport::Local(_) => 1 << 20,
        }
    }

    /// Waits until everything published so far has reached the server.
    pub async fn flush(&self) {
        if let Transport::Nats(NatsTransport { client, .. }) = self {
            let _ = client.flush().await;
        }
    }

    /// Waits (up to 10 s) until the server has processed everything sent so far,
    /// subscriptions included, retrying while the connection is still being established.
    pub async fn synced(&self) {
        if let Transport::Nats(NatsTransport { client, .. }) = self {
            // Each flush is bounded too: while the client is disconnected, a flush is
            // answered only after it reconnects, which may be never.
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
            while !matches!(
                tokio::time::timeout_at(deadline, client.flush()).await,
                Ok(Ok(())) | Err(_)
            ) {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }

    /// The NATS client, if this is NATS.
    pub fn nats_client(&self) -> Option<&async_nats::Client> {
        match self {
            Transport::Nats(n) => Some(&n.client),
            Transport::Local(_) => None,
        }
    }

    /// Changes on every reconnection after an outage (NATS only): events published during
    /// the outage may be lost, so streams must resync rather than assume nothing was.
    pub fn reconnects(&self) -> Option<watch::Receiver<u64>> {
        match self {
            Transport::Nats(n) => Some(n.reconnects.clone()),
            Transport::Local(_) => None,
        }
    }

    /// Whether the connection is up now (an in-process bus always is). While it is down the
    /// router hears nobody, so silence then is no sign of a worker's death.
    pub fn is_connected(&self) -> bool {
        match self {
            Transport::Nats(n) => *n.connected.borrow(),
            Transport::Local(_) => true,
        }
    }
}

impl Subscription {
    /// The next message, or `None` once the subscription ends.
    pub async fn next(&mut self) -> Option<Message> {
        match self {
            Subscription::Nats(sub) => {
                use futures_util::StreamExt;
                sub.next().await.map(|m| Message {
                    subject: m.subject.to_string(),
                    reply: m.reply.map(|r| r.to_string()),
                    payload: m.payload,
                })
            }
            Subscription::Local(rx) => rx.recv().await,
        }
    }
}

/// Whether a connection error is a TLS handshake failure (rustls reports those as I/O
/// errors of kind `InvalidData`), as opposed to a server that is not reachable yet.
fn tls_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::InvalidData
        {
            return true;
        }
        cause = c.source();
    }
    let text = e.to_string();
    ["certificate", "fatal alert", "handshake"]
        .iter()
        .any(|w| text.contains(w))
}

/// Most messages a subscription holds that its reader has not taken: the NATS client's
/// queue per subscription (set, though it is async-nats's default) and the local bus's.
/// Beyond it, messages are dropped (a NATS slow consumer).
pub const SUBSCRIPTION_QUEUE: usize = 65_536;
const LOCAL_QUEUE: usize = SUBSCRIPTION_QUEUE;

/// An in-process message bus with NATS subject matching.
#[derive(Clone, Debug, Default)]
pub struct LocalBus {
    inner: Arc<Mutex<LocalInner>>,
    /// A fault for tests: publishes wait while it is held (a server that takes nothing).
    #[cfg(test)]
    pub(crate) held: Hold,
    /// For tests: the `max_payload` the bus says it has (none: 1 MiB), as a NATS server
    /// restarted with another would.
    #[cfg(test)]
    pub(crate) max_payload: Arc<std::sync::atomic::AtomicUsize>,
}

/// A fault for tests: while held, [`Hold::until_released`] waits (a server that takes no
/// writes); releasing wakes every waiter. Counts the writes that found it held.
#[cfg(test)]
#[derive(Clone, Debug, Default)]
pub(crate) struct Hold {
    state: Arc<Mutex<Option<Arc<tokio::sync::Notify>>>>,
    held_writes: Arc<std::sync::atomic::AtomicU64>,
}

#[cfg(test)]
impl Hold {
    /// Holds or releases.
    pub(crate) fn set(&self, held: bool) {
        let mut state = self.state.lock();
        match (held, state.take()) {
            (true, None) => *state = Some(Arc::default()),
            (false, Some(release)) => release.notify_waiters(),
            (_, kept) => *state = kept,
        }
    }

    /// Returns at once unless held; else when released. The wait is taken under the lock
    /// that `set` takes, so a release cannot slip between looking and waiting.
    pub(crate) async fn until_released(&self) {
        let released = {
            let state = self.state.lock();
            state.as_ref().map(|release| {
                self.held_writes
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut released = Box::pin(Arc::clone(release).notified_owned());
                released.as_mut().enable();
                released
            })
        };
        if let Some(released) = released {
            released.await;
        }
    }

    /// Writes that found it held.
    pub(crate) fn held_writes(&self) -> u64 {
        self.held_writes.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[derive(Debug, Default)]
struct LocalInner {
    subscribers: Vec<(Vec<String>, mpsc::Sender<Message>)>,
    next_inbox: u64,
    dropped: u64,
}

impl LocalBus {
    /// An empty bus.
    pub fn new() -> Self {
        LocalBus::default()
    }

    fn publish(&self, message: Message) {
        let mut inner = self.inner.lock();
        let tokens: Vec<&str> = message.subject.split('.').collect();
        inner.subscribers.retain(|(_, tx)| !tx.is_closed());
        let mut dropped = 0;
        for (pattern, tx) in &inner.subscribers {
            if matches(pattern, &tokens) && tx.try_send(message.clone()).is_err() {
                dropped += 1;
            }
        }
        inner.dropped += dropped;
    }

    fn subscribe(&self, subject: &str) -> mpsc::Receiver<Message> {
        let (tx, rx) = mpsc::channel(LOCAL_QUEUE);
        let pattern = subject.split('.').map(str::to_owned).collect();
        self.inner.lock().subscribers.push((pattern, tx));
        rx
    }

    fn new_inbox(&self) -> String {
        let mut inner = self.inner.lock();
        inner.next_inbox += 1;
        format!("_INBOX.local.{}", inner.next_inbox)
    }

    /// Messages dropped because a subscriber's queue was full.
    pub fn dropped(&self) -> u64 {
        self.inner.lock().dropped
    }

    /// Subscriptions still open to subjects that start with `prefix`.
    #[cfg(test)]
    pub(crate) fn open_subscriptions(&self, prefix: &str) -> usize {
        let inner = self.inner.lock();
        inner
            .subscribers
            .iter()
            .filter(|(pattern, tx)| !tx.is_closed() && pattern.join(".").starts_with(prefix))
            .count()
    }
}

/// NATS subject matching: `*` matches one token, a trailing `>` one or more.
fn matches(pattern: &[String], subject: &[&str]) -> bool {
    for (i, p) in pattern.iter().enumerate() {
        match p.as_str() {
            ">" => return subject.len() > i,
            "*" if i < subject.len() => {}
            token if subject.get(i) == Some(&token) => {}
            _ => return false,
        }
    }
    pattern.len() == subject.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, s: &str) -> bool {
        let pattern: Vec<String> = p.split('.').map(str::to_owned).collect();
        matches(&pattern, &s.split('.').collect::<Vec<_>>())
    }

    /// Credentials come out of server URLs (decoded), which keep their hosts; the first
    /// server's are used; URLs without any are kept as they are.
    #[test]
    fn credentials_are_taken_out_of_server_urls() {
        let (parsed, found) =
            servers("nats://kv%40route:p%3Aw@a:4222, nats://kv%40route:p%3Aw@b:4223,c:4224")
                .unwrap();
        assert_eq!(
            found,
            Some(UrlCredentials::UserPassword(
                "kv@route".into(),
                "p:w".into()
            ))
        );
        let shown: Vec<String> = parsed.iter().map(|s| format!("{s:?}")).collect();
        assert!(
            shown
                .iter()
                .all(|s| !s.contains("route") && !s.contains("p%3Aw") && !s.contains("other")),
            "{shown:?}"
        );
        let hosts: Vec<(&str, u16)> = parsed.iter().map(|s| (s.host(), s.port())).collect();
        assert_eq!(hosts, [("a", 4222), ("b", 4223), ("c", 4224)]);
        let ws = servers("nats://a:4222,wss://user:pw@b:443").unwrap_err();
        assert!(ws.contains("websocket") && !ws.contains("pw"), "{ws}");
        let (_, token) = servers("tls://s3cret@a:4222").unwrap();
        assert_eq!(token, Some(UrlCredentials::Token("s3cret".into())));
        assert_eq!(servers("nats://a:4222").unwrap().1, None);
        assert!(servers("nats://u:x@a:4222,nats://v:y@b:4222").is_err());
        let (parsed, found) = servers("nats://:s3cret@a:4222").unwrap();
        assert_eq!(
            found,
            Some(UrlCredentials::UserPassword(String::new(), "s3cret".into()))
        );
        assert!(!format!("{parsed:?}").contains("s3cret"));
        assert!(servers("nats://a:4222,:::").is_err());
    }

    #[test]
    fn subject_matching_follows_nats() {
        assert!(m("a.b", "a.b"));
        assert!(!m("a.b", "a.b.c"));
        assert!(m("a.*.c", "a.x.c"));
        assert!(!m("a.*", "a"));
        assert!(m("a.>", "a.b.c"));
        assert!(!m("a.>", "a"));
    }

    #[tokio::test]
    async fn local_bus_delivers_to_matching_subscribers() {
        let t = Transport::Local(LocalBus::new());
        let mut all = t.subscribe("kv.events.>").await.unwrap();
        let mut one = t.subscribe("kv.events.7").await.unwrap();
        t.publish("kv.events.7", Some("r"), Bytes::from_static(b"x"))
            .await
            .unwrap();
        t.publish("kv.events.8", None, Bytes::from_static(b"y"))
            .await
            .unwrap();
        assert_eq!(all.next().await.unwrap().payload, Bytes::from_static(b"x"));
        assert_eq!(all.next().await.unwrap().subject, "kv.events.8");
        let got = one.next().await.unwrap();
        assert_eq!(
            (got.subject.as_str(), got.reply.as_deref()),
            ("kv.events.7", Some("r"))
        );
    }
}
