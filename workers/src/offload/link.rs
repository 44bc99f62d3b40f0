//! Timing of copies over one direction of the G1↔G2 link, as processor sharing: N transfers
//! in flight each progress at 1/N of the bandwidth.
//!
//! Rather than updating every transfer's remaining bytes on each arrival or completion
//! (O(N) each), the link keeps a *virtual service* level: the bytes any one transfer has been
//! served since the link was created. It grows at `bandwidth / N`; a transfer entering at
//! level `s` with `b` bytes finishes when the level reaches `s + b`. Finish levels sit in a
//! min-heap, so arrivals and completions cost O(log N).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Names one transfer on one link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TransferId(pub u64);

/// One direction of the link.
#[derive(Debug)]
pub struct Link {
    bytes_per_us: f64,
    /// Virtual service level (bytes) reached at time `at_us`.
    level: f64,
    at_us: f64,
    /// (finish level as f64 bits — non-negative floats order like their bits, id).
    active: BinaryHeap<Reverse<(u64, TransferId)>>,
    next_id: u64,
}

impl Link {
    /// A link of `gbps` GB/s (10⁹ bytes per second).
    pub fn new(gbps: f64) -> Self {
        Link {
            bytes_per_us: gbps * 1e3,
            level: 0.0,
            at_us: 0.0,
            active: BinaryHeap::new(),
            next_id: 0,
        }
    }

    /// Starts a transfer of `bytes` at `now_us` (not before the link's last update).
    pub fn start(&mut self, now_us: u64, bytes: u64) -> TransferId {
        self.progress_to(now_us as f64);
        let id = TransferId(self.next_id);
        self.next_id += 1;
        let finish = self.level + bytes.max(1) as f64;
        self.active.push(Reverse((finish.to_bits(), id)));
        id
    }

    /// Transfers in flight.
    pub fn in_flight(&self) -> usize {
        self.active.len()
    }

    /// When the next transfer completes, µs (rounded up), if any is in flight.
    pub fn next_completion_us(&self) -> Option<u64> {
        let Reverse((finish, _)) = self.active.peek()?;
        let remaining = (f64::from_bits(*finish) - self.level).max(0.0);
        let at = self.at_us + remaining * self.active.len() as f64 / self.bytes_per_us;
        Some(at.ceil() as u64)
    }

    /// Completes every transfer finished by `now_us`, appending `(id, finish time µs)` in
    /// completion order.
    pub fn advance(&mut self, now_us: u64, done: &mut Vec<(TransferId, u64)>) {
        let now = now_us as f64;
        while let Some(&Reverse((finish_bits, id))) = self.active.peek() {
            let finish = f64::from_bits(finish_bits);
            let n = self.active.len() as f64;
            let at = self.at_us + (finish - self.level).max(0.0) * n / self.bytes_per_us;
            if at > now {
                break;
            }
            self.level = self.level.max(finish);
            self.at_us = at;
            self.active.pop();
            done.push((id, (at.ceil() as u64).min(now_us)));
        }
        self.progress_to(now);
    }

    fn progress_to(&mut self, now: f64) {
        if now <= self.at_us {
            return;
        }
        if !self.active.is_empty() {
            self.level += (now - self.at_us) * self.bytes_per_us / self.active.len() as f64;
        }
        self.at_us = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_transfer_takes_bytes_over_bandwidth() {
        let mut link = Link::new(25.0); // 25,000 bytes per µs
        let id = link.start(0, 2_500_000);
        assert_eq!(link.next_completion_us(), Some(100));
        let mut done = Vec::new();
        link.advance(99, &mut done);
        assert!(done.is_empty());
        link.advance(100, &mut done);
        assert_eq!(done, vec![(id, 100)]);
        assert_eq!(link.in_flight(), 0);
    }

    #[test]
    fn concurrent_transfers_share_the_link() {
        let mut link = Link::new(1.0); // 1000 bytes per µs
        let a = link.start(0, 100_000); // alone: 100 µs
        let b = link.start(0, 50_000);
        // Both at 500 B/µs: b finishes at 100 µs; a then has 50,000 left alone: 150 µs.
        let mut done = Vec::new();
        link.advance(1000, &mut done);
        assert_eq!(done, vec![(b, 100), (a, 150)]);
    }

    #[test]
    fn a_late_arrival_slows_the_first() {
        let mut link = Link::new(1.0);
        let a = link.start(0, 100_000);
        let b = link.start(50, 100_000); // a has 50,000 left, then shares
        let mut done = Vec::new();
        link.advance(10_000, &mut done);
        // a: 50,000 at 500 B/µs → 150; b: 50,000 served by 150, 50,000 alone → 200.
        assert_eq!(done, vec![(a, 150), (b, 200)]);
    }
}
