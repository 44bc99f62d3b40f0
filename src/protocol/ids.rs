//! Identifier newtypes. Bare `u64`s never cross an API: a worker id, a block's own hash and a
//! prefix hash are different things that happen to share a representation.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
            rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
        )]
        #[serde(transparent)]
        #[rkyv(derive(Debug, PartialEq, Eq))]
        pub struct $name(pub $inner);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl From<$inner> for $name {
            fn from(value: $inner) -> Self {
                Self(value)
            }
        }
    };
}

id_newtype!(
    /// A worker process (one engine, possibly with several data-parallel ranks).
    WorkerId(u64)
);
id_newtype!(
    /// A data-parallel rank inside a worker; each rank has its own KV cache.
    DpRank(u32)
);
id_newtype!(
    /// Hash of one full block's tokens alone (xxh3-64, seed 1337). What lookups are keyed by.
    LocalHash(u64)
);
id_newtype!(
    /// Hash of a whole prefix ending at a block: chains the parent's `SeqHash` with this
    /// block's `LocalHash`. What KV events name blocks by.
    SeqHash(u64)
);

/// The memory tier a block lives in.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[rkyv(derive(Debug, PartialEq, Eq))]
#[repr(u8)]
pub enum Tier {
    /// G1: GPU memory, where attention reads it.
    Device,
    /// G2: host (CPU) memory, one copy away.
    Host,
    /// G3: local disk.
    Disk,
    /// G4: remote storage.
    Remote,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::Remote];
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        })
    }
}
