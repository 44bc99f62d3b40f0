//! A tier's evictable blocks in eviction order: lowest (priority, slot) first.
//!
//! Priorities almost always arrive rising. A block enters the order when its last user
//! releases it, with the tier's clock at that moment as its priority (both policies are
//! LRUs), and the clock only moves forward. Those blocks go on the end of a list linked
//! through a per-slot array: O(1) to add, to take out from anywhere and to pop, where a
//! sorted set pays a search and rebalancing for each. A priority lower than the list's
//! last goes into a B-tree instead; under a leaf-only policy that is a parent which becomes
//! a leaf when its last child is evicted, and keeps its older release tick. The next victim
//! is the lower of the two heads, so the order is exactly the one a single sorted set of
//! (priority, slot) gives.

use std::collections::BTreeSet;

use super::BlockId;

/// No slot (the end of the list).
const NIL: u32 = u32::MAX;

/// Where a slot is in the order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Out,
    List,
    Tree,
}

/// A slot's priority and, on the list, its neighbours.
#[derive(Clone, Copy, Debug)]
struct Link {
    key: u64,
    prev: u32,
    next: u32,
    place: Place,
}

const OUT: Link = Link {
    key: 0,
    prev: NIL,
    next: NIL,
    place: Place::Out,
};

#[derive(Debug)]
pub(super) struct Order {
    links: Vec<Link>,
    /// The list's first and last slots, in rising (priority, slot).
    head: u32,
    tail: u32,
    /// Slots that arrived below the list's last.
    tree: BTreeSet<(u64, u32)>,
    len: usize,
}

impl Order {
    /// An empty order over `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Order {
            links: vec![OUT; capacity],
            head: NIL,
            tail: NIL,
            tree: BTreeSet::new(),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The slot's priority, if it is in the order.
    pub fn key(&self, id: BlockId) -> Option<u64> {
        let link = &self.links[id.index()];
        (link.place != Place::Out).then_some(link.key)
    }

    /// Puts a slot that is not in the order into it.
    pub fn insert(&mut self, id: BlockId, key: u64) {
        let i = id.0;
        debug_assert_eq!(self.links[i as usize].place, Place::Out);
        self.len += 1;
        let tail = self.tail;
        if tail != NIL && (key, i) < (self.links[tail as usize].key, tail) {
            self.links[i as usize] = Link {
                place: Place::Tree,
                key,
                ..OUT
            };
            self.tree.insert((key, i));
            return;
        }
        self.links[i as usize] = Link {
            key,
            prev: tail,
            next: NIL,
            place: Place::List,
        };
        match tail {
            NIL => self.head = i,
            t => self.links[t as usize].next = i,
        }
        self.tail = i;
    }

    /// Takes a slot out of the order; false if it was not in it.
    pub fn remove(&mut self, id: BlockId) -> bool {
        let i = id.0;
        let link = std::mem::replace(&mut self.links[i as usize], OUT);
        match link.place {
            Place::Out => return false,
            Place::Tree => {
                self.tree.remove(&(link.key, i));
            }
            Place::List => {
                match link.prev {
                    NIL => self.head = link.next,
                    p => self.links[p as usize].next = link.next,
                }
                match link.next {
                    NIL => self.tail = link.prev,
                    n => self.links[n as usize].prev = link.prev,
                }
            }
        }
        self.len -= 1;
        true
    }

    /// Takes the lowest (priority, slot) out of the order.
    pub fn pop_first(&mut self) -> Option<BlockId> {
        let list = (self.head != NIL).then(|| (self.links[self.head as usize].key, self.head));
        let tree = self.tree.first().copied();
        let (_, i) = match (list, tree) {
            (Some(l), Some(t)) => l.min(t),
            (l, t) => l.or(t)?,
        };
        self.remove(BlockId(i));
        Some(BlockId(i))
    }

    /// Every structural invariant, or the first one broken.
    pub fn check(&self) -> Result<(), String> {
        let mut on_list = 0;
        let (mut prev, mut at) = (NIL, self.head);
        let mut last: Option<(u64, u32)> = None;
        while at != NIL {
            let link = &self.links[at as usize];
            if link.place != Place::List || link.prev != prev {
                return Err(format!("list slot {at} is {link:?}, reached from {prev}"));
            }
            if last.is_some_and(|l| l >= (link.key, at)) {
                return Err(format!("list out of order at slot {at}"));
            }
            last = Some((link.key, at));
            on_list += 1;
            if on_list > self.links.len() {
                return Err("the list loops".into());
            }
            (prev, at) = (at, link.next);
        }
        if prev != self.tail {
            return Err(format!("list ends at {prev}, tail is {}", self.tail));
        }
        for &(key, i) in &self.tree {
            let link = &self.links[i as usize];
            if link.place != Place::Tree || link.key != key {
                return Err(format!("tree entry ({key}, {i}) but slot is {link:?}"));
            }
        }
        let placed = self.links.iter().filter(|l| l.place != Place::Out).count();
        if placed != on_list + self.tree.len() || placed != self.len {
            return Err(format!(
                "{placed} slots placed, {on_list} listed, {} in the tree, len {}",
                self.tree.len(),
                self.len
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a sorted set: any mix of inserts (rising or not), removals and pops gives the
    /// same victims in the same order.
    #[test]
    fn pops_as_a_sorted_set_would() {
        let mut order = Order::new(64);
        let mut model: BTreeSet<(u64, u32)> = BTreeSet::new();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut clock = 0u64;
        for _ in 0..20_000 {
            let i = (next() % 64) as u32;
            match next() % 4 {
                0 | 1 => {
                    if order.key(BlockId(i)).is_none() {
                        // Mostly the clock (rising), sometimes an older priority.
                        clock += 1;
                        let key = if next() % 5 == 0 {
                            clock.saturating_sub(next() % 40)
                        } else {
                            clock
                        };
                        order.insert(BlockId(i), key);
                        model.insert((key, i));
                    }
                }
                2 => {
                    let had = order.key(BlockId(i)).map(|k| (k, i));
                    assert_eq!(order.remove(BlockId(i)), had.is_some());
                    if let Some(entry) = had {
                        assert!(model.remove(&entry));
                    }
                }
                _ => assert_eq!(
                    order.pop_first().map(|id| id.0),
                    model.pop_first().map(|(_, i)| i)
                ),
            }
            assert_eq!(order.len(), model.len());
        }
        order.check().unwrap();
        while let Some((_, i)) = model.pop_first() {
            assert_eq!(order.pop_first(), Some(BlockId(i)));
        }
        assert_eq!(order.pop_first(), None);
        order.check().unwrap();
    }

    /// The negative control: `check` catches a list put out of order.
    #[test]
    fn check_catches_a_list_out_of_order() {
        let mut order = Order::new(4);
        order.insert(BlockId(0), 5);
        order.insert(BlockId(1), 7);
        order.check().unwrap();
        order.links[1].key = 3;
        assert!(order.check().is_err());
    }
}
