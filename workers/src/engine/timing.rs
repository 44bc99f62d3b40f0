//! How long one engine step takes.

use serde::{Deserialize, Serialize};

/// Step durations as quadratic fits (DESIGN §9). The defaults are the published defaults of
/// NVIDIA Dynamo's mocker engine, so replay results compare with it:
/// prefill ms = 4.209989e-7·T² + 1.518344e-2·T + 16.50142 (T = tokens computed in the step),
/// decode ms = −25.74·p² + 54.01·p + 5.74, at least 1 ms (p = tokens of the sequences
/// decoding in the step, prompt and output so far / G1 capacity in tokens).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimingModel {
    /// Prefill coefficients `[a, b, c]` of `a·T² + b·T + c`, ms.
    pub prefill: [f64; 3],
    /// Decode coefficients `[a, b, c]` of `a·p² + b·p + c`, ms.
    pub decode: [f64; 3],
    /// Floor of a decode step, ms.
    pub decode_min_ms: f64,
    /// How a step holding both prefill and decode tokens is priced.
    pub mixed_step: MixedStep,
}

/// The price of a step that computes prefill tokens while other sequences decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MixedStep {
    /// One forward pass over every scheduled token, as vLLM runs it:
    /// `prefill(P + D) + max(decode(p) − decode(0), 0)`. The decoders' tokens ride in the
    /// prefill's pass and their attention over their KV is what the decode fit adds beyond
    /// its fixed cost (the composition Dynamo's replay uses with measured profiles).
    #[default]
    Marginal,
    /// `prefill(P) + decode(p)`: two passes, the fixed cost counted twice; Dynamo's mocker
    /// with its polynomial fits (aisimulate-core), kept so the two replays compare like for
    /// like.
    Additive,
}

impl MixedStep {
    /// Parses `marginal` or `additive`.
    pub fn parse(name: &str) -> Option<MixedStep> {
        match name {
            "marginal" => Some(MixedStep::Marginal),
            "additive" => Some(MixedStep::Additive),
            _ => None,
        }
    }
}

impl Default for TimingModel {
    fn default() -> Self {
        TimingModel {
            prefill: [4.209989e-7, 1.518344e-2, 16.50142],
            decode: [-25.74, 54.01, 5.74],
            decode_min_ms: 1.0,
            mixed_step: MixedStep::Marginal,
        }
    }
}

impl TimingModel {
    /// Duration of a step, µs (at least 1): `prefill_tokens` computed for prompts,
    /// `decode_tokens` sequences decoding one token each, whose tokens (prompt and output so
    /// far) fill `decode_kv_fraction` of G1. A step with no prefill is priced by the decode
    /// fit alone; one with no decoders by the prefill fit alone; one with both as
    /// [`TimingModel::mixed_step`] says.
    pub fn step_us(
        &self,
        prefill_tokens: usize,
        decode_tokens: usize,
        decode_kv_fraction: f64,
        speedup: f64,
    ) -> u64 {
        let ms = if prefill_tokens == 0 {
            self.decode_ms(decode_kv_fraction)
        } else if decode_tokens == 0 {
            self.prefill_ms(prefill_tokens)
        } else {
            match self.mixed_step {
                MixedStep::Marginal => {
                    self.prefill_ms(prefill_tokens + decode_tokens)
                        + (self.decode_ms(decode_kv_fraction) - self.decode_ms(0.0)).max(0.0)
                }
                MixedStep::Additive => {
                    self.prefill_ms(prefill_tokens) + self.decode_ms(decode_kv_fraction)
                }
            }
        };
        ((ms * 1000.0 / speedup).round() as u64).max(1)
    }

    fn prefill_ms(&self, tokens: usize) -> f64 {
        let t = tokens as f64;
        let [a, b, c] = self.prefill;
        a * t * t + b * t + c
    }

    fn decode_ms(&self, kv_fraction: f64) -> f64 {
        let p = kv_fraction.clamp(0.0, 1.0);
        let [a, b, c] = self.decode;
        (a * p * p + b * p + c).max(self.decode_min_ms)
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

    /// 900 prefill tokens beside 100 decoders holding half of G1 (hand-computed):
    /// prefill(1000) = 32.106 ms, prefill(900) = 0.341 + 13.665 + 16.501 = 30.5075 ms,
    /// decode(0.5) = 26.310 ms, decode(0) = 5.740 ms.
    #[test]
    fn a_mixed_step_is_one_pass_or_two() {
        let marginal = TimingModel::default();
        // One pass over 1000 tokens, plus the decoders' attention beyond the fixed cost.
        assert_eq!(
            marginal.step_us(900, 100, 0.5, 1.0),
            32_106 + 26_310 - 5_740
        );
        let additive = TimingModel {
            mixed_step: MixedStep::Additive,
            ..TimingModel::default()
        };
        assert_eq!(additive.step_us(900, 100, 0.5, 1.0), 56_818); // 30.5075 + 26.310 ms
        // Alone, either kind of work is priced the same by both.
        for m in [marginal, additive] {
            assert_eq!(m.step_us(1000, 0, 0.5, 1.0), 32_106);
            assert_eq!(m.step_us(0, 100, 0.5, 1.0), 26_310);
        }
    }
}
