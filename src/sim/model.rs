//! LLaMA-like model presets and the per-stage compute and memory figures the
//! simulator needs.
//!
//! The figures are derived from the model configuration, never invented:
//! - matmul FLOPs are 2*m*n*k; one layer's forward over T = batch*seq tokens
//!   does the Q, K, V, O projections (4 * 2*T*d*d), the SwiGLU MLP
//!   (3 * 2*T*d*ffn) and attention scores and values (2 * 2*T*seq*d);
//! - backward = 2 x forward;
//! - the head (at the data holder) is a 2*T*d*vocab matmul, forward and
//!   backward; the embedding is a lookup (2*T*d);
//! - activation bytes between stages = batch*seq*d_model*2 (bf16);
//! - activation memory kept for the backward per layer and microbatch =
//!   34*T*d + 5*heads*T*seq bytes (Korthikanti et al. 2022, 16-bit, no
//!   recomputation); weights + grads + Adam state = 16 bytes per parameter.
//!
//! (The reference model presets of `src/model/` were not on main when this
//! was written; these are computed from the same configurations.)
#[derive(Clone, Debug, PartialEq)]
pub struct ModelPreset {
    pub name: &'static str,
    pub d_model: u64,
    pub layers: u64,
    pub heads: u64,
    pub ffn: u64,
    pub vocab: u64,
    pub seq: u64,
    pub micro_batch: u64,
    /// Relay stages (the transformer layers are split evenly over them).
    pub stages: u16,
}

impl ModelPreset {
    /// ~124M parameters: d 768, 12 layers, 12 heads, SwiGLU 2048, vocab 32000
    /// (134M with an untied head), 6 stages of 2 layers.
    pub fn llama_124m() -> ModelPreset {
        ModelPreset {
            name: "llama-124m",
            d_model: 768,
            layers: 12,
            heads: 12,
            ffn: 2048,
            vocab: 32000,
            seq: 1024,
            micro_batch: 4,
            stages: 6,
        }
    }
    /// ~500M: d 1280, 24 layers, 20 heads, SwiGLU 3456, vocab 32000 (0.56B
    /// with an untied head), 6 stages of 4 layers.
    pub fn llama_500m() -> ModelPreset {
        ModelPreset {
            name: "llama-500m",
            d_model: 1280,
            layers: 24,
            heads: 20,
            ffn: 3456,
            vocab: 32000,
            seq: 1024,
            micro_batch: 4,
            stages: 6,
        }
    }
    /// ~1.5B: d 2048, 28 layers, 16 heads, SwiGLU 5632, vocab 32000 (1.57B),
    /// 7 stages of 4 layers.
    pub fn llama_1_5b() -> ModelPreset {
        ModelPreset {
            name: "llama-1.5b",
            d_model: 2048,
            layers: 28,
            heads: 16,
            ffn: 5632,
            vocab: 32000,
            seq: 1024,
            micro_batch: 4,
            stages: 7,
        }
    }

    pub fn by_name(name: &str) -> Option<ModelPreset> {
        match name {
            "llama-124m" | "124m" => Some(Self::llama_124m()),
            "llama-500m" | "500m" => Some(Self::llama_500m()),
            "llama-1.5b" | "1.5b" => Some(Self::llama_1_5b()),
            _ => None,
        }
    }

    pub fn tokens(&self) -> u64 {
        self.micro_batch * self.seq
    }

    fn layers_per_stage(&self) -> u64 {
        self.layers.div_ceil(self.stages as u64)
    }

    /// Parameters of one transformer layer.
    pub fn layer_params(&self) -> u64 {
        4 * self.d_model * self.d_model + 3 * self.d_model * self.ffn
    }

    /// Parameters of relay stage `s` (1..=S) or of the holders' part (s = 0:
    /// embedding + head).
    pub fn stage_params(&self, s: u16) -> u64 {
        if s == 0 {
            2 * self.vocab * self.d_model
        } else {
            self.layers_per_stage() * self.layer_params()
        }
    }

    pub fn total_params(&self) -> u64 {
        self.stage_params(0) + self.layers * self.layer_params()
    }

    /// Forward FLOPs of one layer for one microbatch.
    pub fn layer_fwd_flops(&self) -> f64 {
        let t = self.tokens() as f64;
        let d = self.d_model as f64;
        let proj = 4.0 * 2.0 * t * d * d;
        let mlp = 3.0 * 2.0 * t * d * self.ffn as f64;
        let attn = 2.0 * 2.0 * t * self.seq as f64 * d;
        proj + mlp + attn
    }

    /// Forward FLOPs of a relay stage for one microbatch.
    pub fn stage_fwd_flops(&self) -> f64 {
        self.layers_per_stage() as f64 * self.layer_fwd_flops()
    }

    /// Head forward + loss + head backward (3 x 2*T*d*V) at the holder.
    pub fn loss_flops(&self) -> f64 {
        3.0 * 2.0 * self.tokens() as f64 * self.d_model as f64 * self.vocab as f64
    }

    /// Embedding lookup.
    pub fn embed_flops(&self) -> f64 {
        2.0 * self.tokens() as f64 * self.d_model as f64
    }

    /// Bytes of one activation between stages (bf16).
    pub fn activation_bytes(&self) -> u64 {
        self.tokens() * self.d_model * 2
    }

    /// Weights + gradients + optimizer state of a stage (16 B/parameter).
    pub fn stage_state_bytes(&self, s: u16) -> u64 {
        16 * self.stage_params(s)
    }

    /// Activation memory one microbatch keeps on a relay until its backward.
    pub fn stage_activation_memory(&self) -> u64 {
        let t = self.tokens();
        let per_layer = 34 * t * self.d_model + 5 * self.heads * t * self.seq;
        self.layers_per_stage() * per_layer
    }

    /// Microbatches a relay with `mem_bytes` of GPU memory holds at once.
    pub fn relay_capacity(&self, mem_bytes: u64) -> u32 {
        let free = mem_bytes.saturating_sub(self.stage_state_bytes(1));
        ((free / self.stage_activation_memory().max(1)) as u32).clamp(1, 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_advertised_sizes() {
        let p = ModelPreset::llama_124m().total_params() as f64 / 1e6;
        assert!((110.0..160.0).contains(&p), "{p}");
        let p = ModelPreset::llama_500m().total_params() as f64 / 1e6;
        assert!((450.0..600.0).contains(&p), "{p}");
        let p = ModelPreset::llama_1_5b().total_params() as f64 / 1e9;
        assert!((1.3..1.7).contains(&p), "{p}");
        for m in [
            ModelPreset::llama_124m(),
            ModelPreset::llama_500m(),
            ModelPreset::llama_1_5b(),
        ] {
            assert!((6..=8).contains(&m.stages));
            assert_eq!(m.layers % m.stages as u64, 0);
        }
    }

    #[test]
    fn flops_follow_the_formulas() {
        let m = ModelPreset::llama_500m();
        let t = 4096.0;
        let d = 1280.0;
        let layer = 8.0 * t * d * d + 6.0 * t * d * 3456.0 + 4.0 * t * 1024.0 * d;
        assert_eq!(m.layer_fwd_flops(), layer);
        assert_eq!(m.stage_fwd_flops(), 4.0 * layer);
        assert_eq!(m.activation_bytes(), 4096 * 1280 * 2);
        // A 24 GB GPU holds a handful of 500M-stage microbatches.
        let c = m.relay_capacity(24 << 30);
        assert!((4..=16).contains(&c), "{c}");
    }
}
