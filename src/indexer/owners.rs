//! The owners of one block: (worker slot, tier) pairs, sorted, the first three stored inline.
//! Most blocks have one to three owners; keeping them in the node itself saves a heap
//! allocation per block on store and a dependent cache miss per level on lookup.

use super::slots::SlotRef;
use crate::protocol::Tier;

const INLINE: usize = 3;

/// One owner entry.
pub(crate) type Owner = (SlotRef, Tier);

#[derive(Debug, Clone)]
pub(crate) enum Owners {
    Inline { len: u8, items: [Owner; INLINE] },
    Spilled(Vec<Owner>),
}

const EMPTY: Owner = (
    SlotRef {
        index: 0,
        generation: 0,
    },
    Tier::Device,
);

impl Default for Owners {
    fn default() -> Self {
        Owners::Inline {
            len: 0,
            items: [EMPTY; INLINE],
        }
    }
}

impl Owners {
    pub(crate) fn as_slice(&self) -> &[Owner] {
        match self {
            Owners::Inline { len, items } => &items[..*len as usize],
            Owners::Spilled(v) => v,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Adds an owner (no-op if present).
    pub(crate) fn insert(&mut self, owner: Owner) {
        let at = match self.as_slice().binary_search(&owner) {
            Ok(_) => return,
            Err(at) => at,
        };
        match self {
            Owners::Inline { len, items } if (*len as usize) < INLINE => {
                let n = *len as usize;
                items.copy_within(at..n, at + 1);
                items[at] = owner;
                *len += 1;
            }
            Owners::Inline { items, .. } => {
                let mut v = items.to_vec();
                v.insert(at, owner);
                *self = Owners::Spilled(v);
            }
            Owners::Spilled(v) => v.insert(at, owner),
        }
    }

    /// Removes an owner (no-op if absent).
    pub(crate) fn remove(&mut self, owner: Owner) {
        let Ok(at) = self.as_slice().binary_search(&owner) else {
            return;
        };
        match self {
            Owners::Inline { len, items } => {
                let n = *len as usize;
                items.copy_within(at + 1..n, at);
                *len -= 1;
            }
            Owners::Spilled(v) => {
                v.remove(at);
                if v.len() <= INLINE {
                    let mut items = [EMPTY; INLINE];
                    items[..v.len()].copy_from_slice(v);
                    *self = Owners::Inline {
                        len: v.len() as u8,
                        items,
                    };
                }
            }
        }
    }

    /// Whether `slot` holds the block in the device tier.
    pub(crate) fn on_device(&self, slot: SlotRef) -> bool {
        self.as_slice().binary_search(&(slot, Tier::Device)).is_ok()
    }

    /// The fastest lower tier `slot` holds the block in.
    pub(crate) fn lower_tier(&self, slot: SlotRef) -> Option<Tier> {
        let owners = self.as_slice();
        let i = owners.partition_point(|o| *o <= (slot, Tier::Device));
        owners.get(i).filter(|(s, _)| *s == slot).map(|(_, t)| *t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(i: u32) -> SlotRef {
        SlotRef {
            index: i,
            generation: 2,
        }
    }

    #[test]
    fn spills_and_comes_back_sorted() {
        let mut o = Owners::default();
        for i in [5, 1, 3, 2, 4] {
            o.insert((slot(i), Tier::Device));
        }
        o.insert((slot(3), Tier::Host));
        o.insert((slot(3), Tier::Host));
        assert!(matches!(o, Owners::Spilled(_)));
        let got: Vec<u32> = o.as_slice().iter().map(|(s, _)| s.index).collect();
        assert_eq!(got, vec![1, 2, 3, 3, 4, 5]);
        assert!(o.on_device(slot(3)));
        assert_eq!(o.lower_tier(slot(3)), Some(Tier::Host));
        assert_eq!(o.lower_tier(slot(4)), None);
        for i in [1, 2, 4] {
            o.remove((slot(i), Tier::Device));
        }
        assert!(matches!(o, Owners::Inline { len: 3, .. }));
        o.remove((slot(3), Tier::Device));
        assert!(!o.on_device(slot(3)));
        assert_eq!(o.lower_tier(slot(3)), Some(Tier::Host));
        o.remove((slot(3), Tier::Host));
        o.remove((slot(5), Tier::Device));
        assert!(o.is_empty());
    }
}
