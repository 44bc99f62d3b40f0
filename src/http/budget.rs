//! One budget for the request bodies a process holds in memory at once. The size cap bounds
//! one body and the in-flight cap bounds how many there are, but their product is far past a
//! router's memory (4,096 × 8 MiB = 32 GiB against the chart's 2 GiB limit): a burst of long
//! prompts would get the router OOM-killed, cutting every stream it serves. Each body
//! reserves what it has read as it arrives, in [`GRAIN`] steps, and keeps the reservation for
//! as long as the request holds the body; a body that finds the budget spent is refused (the
//! caller answers 429), not waited for. Streamed answers reserve what they relay, from the
//! worker's bytes held for an event's end until the client's connection takes them
//! (`ingress::proxy`), and wait for room instead.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::BodyError;

/// Reservations grow in steps of 1 KiB (the budget counts in these units): small enough
/// that thousands of short prompts reserve about what they hold.
pub const GRAIN: usize = 1 << 10;

/// How often a reservation waiting for room looks again.
pub const RESERVE_POLL: Duration = Duration::from_millis(20);

/// Bytes of request bodies that may be held at once, shared by every request.
#[derive(Clone, Debug)]
pub struct BodyBudget {
    grains: Arc<Semaphore>,
    bytes: usize,
}

/// Part of a [`BodyBudget`] held by one body: released on drop.
#[derive(Debug, Default)]
pub struct Reservation {
    permit: Option<OwnedSemaphorePermit>,
}

impl Reservation {
    /// Bytes reserved.
    pub fn bytes(&self) -> usize {
        self.permit.as_ref().map_or(0, |p| p.num_permits() * GRAIN)
    }

    /// Keeps what covers `keep` bytes and hands over the rest: a relay's held-back bytes
    /// pass their share to the whole events they complete, without giving it back to the
    /// budget in between.
    pub fn split_off(&mut self, keep: usize) -> Reservation {
        let keep = keep.div_ceil(GRAIN);
        let permit = self.permit.as_mut().and_then(|p| {
            let rest = p.num_permits().saturating_sub(keep);
            p.split(rest).filter(|split| split.num_permits() > 0)
        });
        Reservation { permit }
    }
}

impl BodyBudget {
    /// A budget of `bytes` (rounded up to a whole grain; at most what a `usize` counts in
    /// whole grains: `usize::MAX`, meant as no limit, made 2^54 grains, whose bytes
    /// overflowed in [`BodyBudget::in_use`], a panic at every metrics scrape in a debug
    /// build and 1.8e19 bytes held in a release one).
    pub fn new(bytes: usize) -> BodyBudget {
        let most = Semaphore::MAX_PERMITS.min(usize::MAX / GRAIN);
        let grains = bytes.div_ceil(GRAIN).clamp(1, most);
        BodyBudget {
            grains: Arc::new(Semaphore::new(grains)),
            bytes: grains * GRAIN,
        }
    }

    /// The budget, bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> usize {
        self.bytes - self.grains.available_permits() * GRAIN
    }

    /// A reservation of `bytes`, waiting up to `wait` ([`BodyBudget::grow_until`]); `None`
    /// if the budget has not had the room by then. The tests' shorthand.
    #[cfg(test)]
    pub async fn reserve(&self, bytes: usize, wait: Duration) -> Option<Reservation> {
        let mut held = Reservation::default();
        self.grow_until(&mut held, bytes, tokio::time::Instant::now() + wait)
            .await
            .then_some(held)
    }

    /// Grows `held` to cover `bytes`, waiting for room until `deadline`; false, and `held`
    /// unchanged, if the budget has not had the room by then, or never could (more than
    /// the whole budget). Streams reserve so what they relay: a client reading slowly makes
    /// the relay wait, not the router's memory grow. A waiter looks again every
    /// [`RESERVE_POLL`] rather than queueing: the semaphore's queue is first come first
    /// served, and one large event waiting in it would hold up every stream's small ones.
    pub async fn grow_until(
        &self,
        held: &mut Reservation,
        bytes: usize,
        deadline: tokio::time::Instant,
    ) -> bool {
        if bytes.div_ceil(GRAIN) > self.bytes / GRAIN {
            return false;
        }
        loop {
            if self.cover(held, bytes) {
                return true;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return false;
            }
            tokio::time::sleep_until(deadline.min(now + RESERVE_POLL)).await;
        }
    }

    /// Grows `held` to cover `bytes`; false, and `held` unchanged, if the budget has not
    /// that much left.
    pub fn cover(&self, held: &mut Reservation, bytes: usize) -> bool {
        let want = bytes.div_ceil(GRAIN);
        let have = held
            .permit
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits);
        if want <= have {
            return true;
        }
        let Ok(more) = u32::try_from(want - have) else {
            return false;
        };
        let Ok(permit) = Arc::clone(&self.grains).try_acquire_many_owned(more) else {
            return false;
        };
        match &mut held.permit {
            Some(p) => p.merge(permit),
            None => held.permit = Some(permit),
        }
        true
    }
}

/// Collects `body` whole, at most `limit` bytes, within `deadline`, reserving what it reads
/// from `budget`: the body and its reservation, which the caller keeps while it holds the
/// body. [`BodyError::OverBudget`] once the budget cannot cover what has arrived.
pub async fn collect_within<B>(
    body: B,
    limit: usize,
    deadline: Duration,
    budget: &BodyBudget,
) -> Result<(Bytes, Reservation), BodyError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    collect(body, limit, deadline, Some(budget)).await
}

/// The one body-reading loop: [`collect_within`], and `collect_body` without a budget. A
/// body whose announced length is over `limit` is refused before anything is read.
pub(super) async fn collect<B>(
    body: B,
    limit: usize,
    deadline: Duration,
    budget: Option<&BodyBudget>,
) -> Result<(Bytes, Reservation), BodyError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(BodyError::TooLarge { limit });
    }
    // An exact length announced (Content-Length) is as far as the buffer grows: doubling
    // past it would reserve up to twice the body.
    let hint = body.size_hint();
    let most = hint.exact().map_or(limit, |n| (n as usize).min(limit));
    let read = async {
        let mut held = Reservation::default();
        // Every frame is copied into one buffer as it arrives, and the buffer's whole
        // capacity is reserved. A frame kept as it came is a slice of the connection's read
        // buffer, which hyper replaces (8 KiB at least) before its next read: a body sent in
        // pieces of a grain held 8 KiB for each (eight times what was reserved, an audit
        // found), and of one-byte pieces a 32-byte handle per byte.
        let mut all: Vec<u8> = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| BodyError::Io(e.into()))?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            let needed = all.len().saturating_add(data.len());
            if needed > limit {
                return Err(BodyError::TooLarge { limit });
            }
            if needed > all.capacity() {
                // Doubling (a copy per doubling), up to what was announced; reserved before
                // it is allocated (allocated first, a body about to be refused held up to
                // `limit` the budget never counted), and topped up if the allocation came
                // larger.
                let grown = (2 * all.capacity()).max(GRAIN).min(most).max(needed);
                let over = |budget: &BodyBudget| BodyError::OverBudget {
                    budget: budget.bytes(),
                };
                if let Some(budget) = budget
                    && !budget.cover(&mut held, grown)
                {
                    return Err(over(budget));
                }
                all.reserve_exact(grown - all.len());
                if let Some(budget) = budget
                    && !budget.cover(&mut held, all.capacity())
                {
                    return Err(over(budget));
                }
            }
            all.extend_from_slice(&data);
        }
        Ok((Bytes::from(all), held))
    };
    tokio::time::timeout(deadline, read)
        .await
        .unwrap_or(Err(BodyError::TimedOut {
            ms: deadline.as_millis() as u64,
        }))
}

/// Largest slice of a held answer handed to hyper at once.
pub const HELD_SLICE: usize = 64 << 10;

/// A whole answer (a non-streamed completion, a merged batch) that keeps its share of the
/// budget until the client's connection has taken all but its last slice. hyper takes the
/// next slice only once its write buffer has room, so what the budget does not count is
/// at most what that buffer holds (about 400 KiB). Handed over in one frame, the answer was
/// taken at once, the body dropped with its reservation, and the bytes sat in hyper's
/// write queue uncounted for as long as the client read slowly (an audit found).
#[derive(Debug)]
pub struct HeldBody {
    rest: Bytes,
    held: Option<Reservation>,
}

impl HeldBody {
    /// `bytes`, holding `held` until the last slice is taken.
    pub fn new(bytes: Bytes, held: Reservation) -> HeldBody {
        HeldBody {
            rest: bytes,
            held: Some(held),
        }
    }
}

impl hyper::body::Body for HeldBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        if self.rest.is_empty() {
            self.held = None;
            return std::task::Poll::Ready(None);
        }
        let n = self.rest.len().min(HELD_SLICE);
        let slice = self.rest.split_to(n);
        if self.rest.is_empty() {
            self.held = None;
        }
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(slice))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.rest.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    fn body(chunks: &[usize]) -> impl hyper::body::Body<Data = Bytes, Error = std::io::Error> {
        let frames: Vec<Result<hyper::body::Frame<Bytes>, std::io::Error>> = chunks
            .iter()
            .map(|&n| Ok(hyper::body::Frame::data(Bytes::from(vec![b'x'; n]))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn bodies_hold_their_share_until_dropped() {
        let budget = BodyBudget::new(4 * GRAIN);
        let second = Duration::from_secs(1);
        let (a, held_a) = collect_within(body(&[GRAIN, GRAIN / 2]), 1 << 20, second, &budget)
            .await
            .unwrap();
        assert_eq!(a.len(), GRAIN + GRAIN / 2);
        assert_eq!(held_a.bytes(), 2 * GRAIN);
        assert_eq!(budget.in_use(), 2 * GRAIN);
        // Three more grains do not fit beside the first body's two; nothing stays reserved.
        let r = collect_within(body(&[GRAIN, GRAIN, GRAIN]), 1 << 20, second, &budget).await;
        assert!(
            matches!(r, Err(BodyError::OverBudget { budget: b }) if b == 4 * GRAIN),
            "{r:?}"
        );
        assert_eq!(budget.in_use(), 2 * GRAIN);
        drop(held_a);
        assert_eq!(budget.in_use(), 0);
        let (c, held_c) = collect_within(body(&[GRAIN, GRAIN, GRAIN]), 1 << 20, second, &budget)
            .await
            .unwrap();
        // Its buffer doubled to four grains (no length was announced), all of them reserved.
        assert_eq!((c.len(), held_c.bytes()), (3 * GRAIN, 4 * GRAIN));
        drop(held_c);
        // With its length announced, the buffer grows to that length and no further.
        let announced = Full::new(Bytes::from(vec![b'x'; 3 * GRAIN]));
        let (d, held_d) = collect_within(announced, 1 << 20, second, &budget)
            .await
            .unwrap();
        assert_eq!((d.len(), held_d.bytes()), (3 * GRAIN, 3 * GRAIN));
    }

    /// A held answer goes out in slices and keeps its reservation until the last is taken:
    /// hyper drops a body at its end, so one handed over whole gave its share back before
    /// a byte of it reached the client.
    #[tokio::test]
    async fn a_held_answer_keeps_its_share_until_its_last_slice_is_taken() {
        use hyper::body::Body as _;
        let budget = BodyBudget::new(4 << 20);
        let answer = Bytes::from(vec![b'x'; (1 << 20) + 5]);
        let mut held = Reservation::default();
        assert!(budget.cover(&mut held, answer.len()));
        let mut body = std::pin::pin!(HeldBody::new(answer, held));
        assert_eq!(body.size_hint().exact(), Some((1 << 20) + 5));
        let mut taken = 0;
        while let Some(frame) = body.frame().await {
            let slice = frame.unwrap().into_data().unwrap();
            assert!(slice.len() <= HELD_SLICE);
            taken += slice.len();
            if taken < (1 << 20) + 5 {
                assert!(!body.is_end_stream(), "ended with bytes left");
                assert!(budget.in_use() > 1 << 20, "given back with bytes left");
            }
        }
        assert_eq!(taken, (1 << 20) + 5);
        assert_eq!(budget.in_use(), 0);
    }

    /// A reservation waits for room, up to its wait; one larger than the whole budget is
    /// refused at once; an empty one holds nothing.
    #[tokio::test(start_paused = true)]
    async fn reservations_wait_for_room_within_their_wait() {
        let budget = BodyBudget::new(2 * GRAIN);
        let second = Duration::from_secs(1);
        let first = budget.reserve(2 * GRAIN, second).await.unwrap();
        assert_eq!(budget.in_use(), 2 * GRAIN);
        assert!(
            budget.reserve(1, second).await.is_none(),
            "no room within the wait"
        );
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(GRAIN, second).await.map(|r| r.bytes()) }
        });
        tokio::time::sleep(second / 2).await;
        drop(first);
        assert_eq!(waiting.await.unwrap(), Some(GRAIN));
        let before = tokio::time::Instant::now();
        assert!(budget.reserve(3 * GRAIN, second).await.is_none());
        assert_eq!(
            before,
            tokio::time::Instant::now(),
            "refused without waiting"
        );
        assert_eq!(budget.reserve(0, second).await.unwrap().bytes(), 0);
        assert_eq!(budget.in_use(), 0);
        // A large reservation waiting does not hold up a small one that fits now.
        let one = budget.reserve(GRAIN, second).await.unwrap();
        let large = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(2 * GRAIN, second).await.is_some() }
        });
        tokio::task::yield_now().await;
        let small = budget.reserve(GRAIN, Duration::ZERO).await;
        assert!(
            small.is_some(),
            "a small reservation queued behind a large one"
        );
        drop((one, small));
        assert!(
            large.await.unwrap(),
            "the large one gets the room once it is free"
        );
    }

    /// A budget of `usize::MAX` (meant as no limit) counts what it holds without
    /// overflowing: its bytes overflowed, a panic at every metrics scrape in a debug build.
    #[test]
    fn a_budget_of_usize_max_counts_without_overflow() {
        let budget = BodyBudget::new(usize::MAX);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.bytes() > usize::MAX - GRAIN);
    }

    #[tokio::test]
    async fn the_size_cap_and_an_empty_body_still_hold() {
        let budget = BodyBudget::new(1 << 20);
        let second = Duration::from_secs(1);
        let r = collect_within(body(&[600, 600]), 1000, second, &budget).await;
        assert!(
            matches!(r, Err(BodyError::TooLarge { limit: 1000 })),
            "{r:?}"
        );
        assert_eq!(budget.in_use(), 0);
        let (empty, held) = collect_within(Full::new(Bytes::new()), 1000, second, &budget)
            .await
            .unwrap();
        assert!(empty.is_empty());
        assert_eq!(held.bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_ends_times_out_and_gives_its_share_back() {
        let budget = BodyBudget::new(1 << 20);
        use futures_util::StreamExt;
        let first: Result<hyper::body::Frame<Bytes>, std::io::Error> = Ok(
            hyper::body::Frame::data(Bytes::from_static(b"{\"prompt\":")),
        );
        let trickle = StreamBody::new(
            futures_util::stream::iter([first]).chain(futures_util::stream::pending()),
        );
        let r = collect_within(trickle, 1 << 20, Duration::from_secs(30), &budget).await;
        assert!(
            matches!(r, Err(BodyError::TimedOut { ms: 30_000 })),
            "{r:?}"
        );
        assert_eq!(budget.in_use(), 0);
    }

    /// A body of many small frames (a chunked body of one-byte chunks, or of pieces of a
    /// little over a grain) is copied as it arrives: no frame, nor the read buffer behind
    /// it, is kept while the rest arrives, and what is held is what is reserved.
    #[tokio::test]
    async fn a_body_of_tiny_frames_keeps_none_of_them() {
        tiny_frames_are_copied(1).await;
    }

    /// Frames of a grain and more, each sliced from a read buffer of its own (8 KiB, as
    /// hyper's), were kept as they came: each held its whole read buffer, eight times what
    /// the budget counted.
    #[tokio::test]
    async fn a_body_of_frames_a_little_over_a_grain_keeps_none_of_them() {
        tiny_frames_are_copied(GRAIN + 76).await;
    }

    async fn tiny_frames_are_copied(frame: usize) {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        /// A read buffer, counted in `.1` while any frame sliced from it lives.
        struct ReadBuffer(Vec<u8>, Arc<AtomicUsize>);
        impl AsRef<[u8]> for ReadBuffer {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }
        impl Drop for ReadBuffer {
            fn drop(&mut self) {
                self.1.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let live = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let frames_n = (20_000 / frame).max(200);
        let total = frames_n * frame;
        // Each frame is read (and its buffer made) only when the collector asks for it.
        let frames = futures_util::stream::iter((0..frames_n).map({
            let (live, peak) = (Arc::clone(&live), Arc::clone(&peak));
            move |i| {
                let now = live.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                let fill = vec![b'a' + (i % 26) as u8; 8192];
                let buffer = Bytes::from_owner(ReadBuffer(fill, Arc::clone(&live)));
                Ok::<_, std::io::Error>(hyper::body::Frame::data(buffer.slice(0..frame)))
            }
        }));
        let budget = BodyBudget::new(4 << 20);
        let (bytes, held) = collect_within(
            StreamBody::new(frames),
            4 << 20,
            Duration::from_secs(1),
            &budget,
        )
        .await
        .unwrap();
        assert_eq!(bytes.len(), total);
        assert!(
            bytes
                .iter()
                .enumerate()
                .all(|(i, b)| *b == b'a' + (i / frame % 26) as u8)
        );
        assert_eq!(live.load(Ordering::SeqCst), 0);
        let peak = peak.load(Ordering::SeqCst);
        assert!(peak <= 2, "{peak} read buffers held at once");
        // Reserved: the buffer, at most twice the body.
        assert!(
            held.bytes() >= total && held.bytes() <= 2 * total + GRAIN,
            "{} reserved for {total}",
            held.bytes()
        );
    }
}
