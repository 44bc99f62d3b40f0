//! How long one engine step takes.

use serde::{Deserialize, Serialize};

/// Step durations as quadratic fits (DESIGN §9). The defaults are the published defaults of
/// NVIDIA Dynamo's mocker engine, so replay results compare with it:
/// prefill ms = 4.209989e-7·T² + 1.518344e-2·T + 16.50142 (T = tokens computed in the step),
/// decode ms = −25.74·p² + 54.01·p + 5.74, at least 1 ms (p = KV tokens of running
/// sequences / G1 capacity in tokens).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimingModel {
    /// Prefill coefficients `[a, b, c]` of `a·T² + b·T + c`, ms.
    pub prefill: [f64; 3],
    /// Decode coefficients `[a, b, c]` of `a·p² + b·p + c`, ms.
    pub decode: [f64; 3],
    /// Floor of a decode step, ms.
    pub decode_min_ms: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        TimingModel {
            prefill: [4.209989e-7, 1.518344e-2, 16.50142],
            decode: [-25.74, 54.01, 5.74],
            decode_min_ms: 1.0,
        }
    }
}

impl TimingModel {
    /// Duration of a step, µs (at least 1). A step that computes any prefill tokens is
    /// priced as a prefill of all its tokens (decode tokens ride along, one each); a pure
    /// decode step by the KV occupancy `kv_fraction`.
    pub fn step_us(
        &self,
        prefill_tokens: usize,
        decode_tokens: usize,
        kv_fraction: f64,
        speedup: f64,
    ) -> u64 {
        let ms = if prefill_tokens > 0 {
            let t = (prefill_tokens + decode_tokens) as f64;
            let [a, b, c] = self.prefill;
            a * t * t + b * t + c
        } else {
            let p = kv_fraction.clamp(0.0, 1.0);
            let [a, b, c] = self.decode;
            (a * p * p + b * p + c).max(self.decode_min_ms)
        };
        ((ms * 1000.0 / speedup).round() as u64).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_published_fits() {
        let m = TimingModel::default();
        // 1000 prefill tokens: 0.421 + 15.183 + 16.501 = 32.106 ms.
        assert_eq!(m.step_us(1000, 0, 0.0, 1.0), 32_106);
        assert_eq!(m.step_us(0, 8, 0.0, 1.0), 5_740);
        assert_eq!(m.step_us(0, 8, 0.5, 1.0), 26_310);
        assert_eq!(m.step_us(1000, 0, 0.0, 2.0), 16_053);
        assert_eq!(m.step_us(0, 1, 0.0, 1e12), 1);
    }
}
