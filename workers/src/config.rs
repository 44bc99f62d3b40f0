//! The worker's one configuration struct, with the defaults of a 7-8B model on one GPU.

use serde::{Deserialize, Serialize};

use crate::block_manager::EvictionKind;
use crate::engine::TimingModel;
use crate::offload::KvLayout;

/// Everything that shapes a worker's engine, cache and copy engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Block slots in GPU memory (G1).
    pub g1_blocks: usize,
    /// Block slots in host memory (G2); 0 disables offload.
    pub g2_blocks: usize,
    /// KV bytes per token across all layers (K and V): 131072 for a 7-8B model in bf16
    /// (32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes).
    pub kv_bytes_per_token: u64,
    /// Bandwidth of each direction of the G1↔G2 link, GB/s (10⁹ bytes per second). The
    /// default, 25, is a PCIe 4.0 ×16 link's; kvroute's own transfers of 2 MiB blocks ran at
    /// 51 GB/s each way over an H100's PCIe 5.0 ×16 (`kvroute-bench kernels`, 2026-11-26).
    pub link_gbps: f64,
    /// Token budget of one engine step (prefill chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Step durations are divided by this (a faster GPU, or a quicker replay).
    pub speedup: f64,
    /// Which cached block G1 and G2 give up first.
    pub eviction: EvictionKind,
    /// An evicted G1 block is copied to G2 if it was hit at least this often (0 = always)…
    pub offload_min_hits: u32,
    /// …or if blocks extending it are still cached (in G1 or G2).
    pub offload_parents: bool,
    /// Byte mode: keep real KV bytes per block in this geometry, fill them from the block's
    /// `SeqHash`, move them on offload/onboard and verify on every onboard. `None` keeps
    /// only the accounting (what the replay bench runs).
    pub kv_bytes: Option<KvLayout>,
    /// Step-duration model.
    pub timing: TimingModel,
    /// Size of the token vocabulary synthesised decode tokens are drawn from.
    pub vocab_size: u32,
    /// Where the KV bytes live: `cpu` (with `kv_bytes`, host byte mode) or `cuda:N` (G1 on
    /// the GPU, G2 pinned; `kv_bytes` defaults to a Llama-8B geometry).
    pub device: Device,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            g1_blocks: 16_384,
            g2_blocks: 65_536,
            kv_bytes_per_token: 131_072,
            link_gbps: 25.0,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            speedup: 1.0,
            eviction: EvictionKind::LineageLru,
            offload_min_hits: 1,
            offload_parents: true,
            kv_bytes: None,
            timing: TimingModel::default(),
            vocab_size: 128_000,
            device: Device::Cpu,
        }
    }
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// A field that must be positive (and finite) is not.
    #[error("{field} must be a positive finite number")]
    NotPositive {
        /// The field's name.
        field: &'static str,
    },
    /// Byte mode's block geometry disagrees with `block_size`.
    #[error("kv_bytes.block_size {layout} differs from block_size {block_size}")]
    LayoutMismatch {
        /// The layout's block size.
        layout: usize,
        /// The engine's block size.
        block_size: usize,
    },
    /// More blocks than one snapshot may carry ([`kvroute::protocol::MAX_SNAPSHOT_BLOCKS`]):
    /// a router could never follow this worker from a snapshot.
    #[error("g1_blocks + g2_blocks is {blocks}, over the {max} blocks a snapshot may carry")]
    TooManyBlocks {
        /// G1 and G2 blocks together.
        blocks: usize,
        /// The limit.
        max: usize,
    },
    /// The KV device cannot be used.
    #[error("--device {device}: {message}")]
    Device {
        /// The device asked for.
        device: String,
        /// What is missing or failed.
        message: String,
    },
}

impl EngineConfig {
    /// Checks that the configuration can run.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("block_size", self.block_size > 0),
            ("g1_blocks", self.g1_blocks > 0),
            ("kv_bytes_per_token", self.kv_bytes_per_token > 0),
            ("link_gbps", positive_finite(self.link_gbps)),
            ("max_num_batched_tokens", self.max_num_batched_tokens > 0),
            ("max_num_seqs", self.max_num_seqs > 0),
            ("speedup", positive_finite(self.speedup)),
            ("vocab_size", self.vocab_size > 0),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, ok)| !ok) {
            return Err(ConfigError::NotPositive { field });
        }
        let blocks = self.g1_blocks.saturating_add(self.g2_blocks);
        if blocks > kvroute::protocol::MAX_SNAPSHOT_BLOCKS {
            return Err(ConfigError::TooManyBlocks {
                blocks,
                max: kvroute::protocol::MAX_SNAPSHOT_BLOCKS,
            });
        }
        let t = &self.timing;
        if !t.prefill.iter().chain(&t.decode).all(|c| c.is_finite()) || !t.decode_min_ms.is_finite()
        {
            return Err(ConfigError::NotPositive {
                field: "timing (every coefficient must be finite)",
            });
        }
        if let Some(layout) = &self.kv_bytes {
            if layout.block_size != self.block_size {
                return Err(ConfigError::LayoutMismatch {
                    layout: layout.block_size,
                    block_size: self.block_size,
                });
            }
            layout
                .validate()
                .map_err(|e| ConfigError::NotPositive { field: e.field })?;
        }
        Ok(())
    }

    /// Bytes of one block on the link: `block_size × kv_bytes_per_token`, or the byte-mode
    /// layout's block size when that is on.
    pub fn block_bytes(&self) -> u64 {
        match &self.kv_bytes {
            Some(layout) => layout.block_bytes() as u64,
            None => self.block_size as u64 * self.kv_bytes_per_token,
        }
    }
}

fn positive_finite(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// Where a worker keeps its KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Device {
    /// Host memory (byte mode): G1 and G2 are both host buffers.
    #[default]
    Cpu,
    /// G1 on CUDA device N, G2 in pinned host memory.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("{s:?} is not cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl From<Device> for String {
    fn from(d: Device) -> String {
        d.to_string()
    }
}

impl TryFrom<String> for Device {
    type Error = String;

    fn try_from(s: String) -> Result<Device, String> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_must_be_finite() {
        for speedup in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
            let c = EngineConfig {
                speedup,
                ..EngineConfig::default()
            };
            assert_eq!(
                c.validate(),
                Err(ConfigError::NotPositive { field: "speedup" }),
                "{speedup}"
            );
        }
        let mut c = EngineConfig::default();
        c.timing.decode[1] = f64::NAN;
        assert!(c.validate().is_err());
        assert_eq!(EngineConfig::default().validate(), Ok(()));
    }

    /// A cache larger than one snapshot carries is refused: routers could never resync
    /// this worker (every fetch failed at the limit and was asked again, forever).
    #[test]
    fn a_cache_over_a_snapshot_is_refused() {
        let max = kvroute::protocol::MAX_SNAPSHOT_BLOCKS;
        let at = EngineConfig {
            g1_blocks: max / 2,
            g2_blocks: max - max / 2,
            ..EngineConfig::default()
        };
        assert_eq!(at.validate(), Ok(()));
        let over = EngineConfig {
            g2_blocks: at.g2_blocks + 1,
            ..at
        };
        assert_eq!(
            over.validate(),
            Err(ConfigError::TooManyBlocks {
                blocks: max + 1,
                max
            })
        );
    }
}
