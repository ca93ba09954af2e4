//! The simulator's view of a model: per-stage compute, parameters and
//! activation sizes, taken from the reference model presets of
//! [`crate::model`] (`preset`, `StagePlan`, `stage_costs`: matmul FLOPs
//! 2*m*n*k, causal attention, backward = 2 x forward, f32 frames).
//!
//! GWTF puts the embedding (the preset's first stage) and the head + loss
//! (its last stage) on the data holders (stage 0 here); the stages in
//! between are the relay stages 1..=S.
use crate::model::{preset, stage_costs, StagePlan};

#[derive(Clone, Debug, PartialEq)]
pub struct ModelPreset {
    pub name: String,
    /// Relay stages S.
    pub relay_stages: u16,
    /// Forward FLOPs per microbatch of relay stage s (index s-1).
    relay_fwd: Vec<f64>,
    /// Bytes of activations a relay stage keeps per microbatch (index s-1).
    relay_act: Vec<u64>,
    embed_fwd: f64,
    head_fwd: f64,
    /// Parameters: index 0 = holders (embedding + head), s = relay stage s.
    params: Vec<u64>,
    frame_bytes: u64,
    /// Stages of the preset (embedding and head stages included).
    pub preset_stages: usize,
    pub total_params: u64,
    /// Sequences per microbatch.
    pub sequences: usize,
}

impl ModelPreset {
    /// A preset of `crate::model` by name (llama-124m, llama-500m, llama-1.5b,
    /// and the small ones); it needs at least 3 stages.
    pub fn by_name(name: &str) -> Option<ModelPreset> {
        Self::with_sequences(name, None)
    }

    /// [`ModelPreset::by_name`] with microbatches of `sequences` sequences
    /// (`None`: the preset's own batch): compute, activations and frames
    /// grow with it, the weights do not.
    pub fn with_sequences(name: &str, sequences: Option<usize>) -> Option<ModelPreset> {
        let cfg = preset(name).ok()?;
        let plan = StagePlan::new(&cfg, cfg.n_stages).ok()?;
        if plan.len() < 3 || sequences == Some(0) {
            return None;
        }
        let sequences = sequences.unwrap_or(cfg.batch);
        let costs = stage_costs(&cfg, &plan, sequences, cfg.seq);
        let last = costs.len() - 1;
        let relays = &costs[1..last];
        Some(ModelPreset {
            name: cfg.name.clone(),
            relay_stages: relays.len() as u16,
            relay_fwd: relays.iter().map(|c| c.fwd_flops as f64).collect(),
            relay_act: relays.iter().map(|c| c.activation_bytes).collect(),
            embed_fwd: costs[0].fwd_flops as f64,
            head_fwd: costs[last].fwd_flops as f64,
            params: std::iter::once(costs[0].params + costs[last].params)
                .chain(relays.iter().map(|c| c.params))
                .collect(),
            frame_bytes: costs[0].output_bytes,
            preset_stages: costs.len(),
            total_params: cfg.total_params() as u64,
            sequences,
        })
    }

    pub fn llama_500m() -> ModelPreset {
        Self::by_name("llama-500m").expect("llama-500m preset")
    }

    /// Forward FLOPs of relay stage `s` (1..=S) for one microbatch.
    pub fn stage_fwd_flops(&self, s: u16) -> f64 {
        self.relay_fwd[(s.max(1) - 1) as usize]
    }

    /// Mean forward FLOPs over the relay stages.
    pub fn mean_stage_fwd_flops(&self) -> f64 {
        self.relay_fwd.iter().sum::<f64>() / self.relay_fwd.len() as f64
    }

    /// Head forward, loss and head backward at the holder (3 x head forward).
    pub fn loss_flops(&self) -> f64 {
        3.0 * self.head_fwd
    }

    /// Embedding forward (its backward counts twice that).
    pub fn embed_flops(&self) -> f64 {
        self.embed_fwd.max(1.0)
    }

    /// Bytes of one activation frame between stages (the gradient has the same size).
    pub fn activation_bytes(&self) -> u64 {
        self.frame_bytes
    }

    pub fn stage_params(&self, s: u16) -> u64 {
        self.params[s as usize]
    }

    /// Weights + gradients + Adam state (16 bytes per parameter).
    pub fn stage_state_bytes(&self, s: u16) -> u64 {
        16 * self.stage_params(s)
    }

    /// Microbatches a relay of stage `s` with `mem_bytes` of GPU memory holds at once.
    pub fn relay_capacity(&self, s: u16, mem_bytes: u64) -> u32 {
        let i = (s.max(1) - 1) as usize;
        let free = mem_bytes.saturating_sub(self.stage_state_bytes(s.max(1)));
        ((free / self.relay_act[i].max(1)) as u32).clamp(1, 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_map_onto_holders_and_relays() {
        for (name, lo, hi) in [
            ("llama-124m", 0.1e9, 0.2e9),
            ("llama-500m", 0.4e9, 0.7e9),
            ("llama-1.5b", 1.2e9, 1.9e9),
        ] {
            let m = ModelPreset::by_name(name).unwrap();
            assert!((6..=8).contains(&m.preset_stages), "{name}");
            assert_eq!(m.relay_stages as usize, m.preset_stages - 2);
            let p = m.total_params as f64;
            assert!(p > lo && p < hi, "{name}: {p}");
            let sum: u64 = (0..=m.relay_stages).map(|s| m.stage_params(s)).sum();
            assert_eq!(sum, m.total_params, "{name}");
            assert!(m.stage_fwd_flops(1) > 0.0 && m.loss_flops() > 0.0);
            // A 24 GiB GPU holds at least one microbatch of a stage.
            assert!(m.relay_capacity(1, 24 << 30) >= 1);
        }
        assert!(ModelPreset::by_name("nope").is_none());
    }

    /// A microbatch of 32 sequences costs 16 times one of the preset's 2:
    /// compute, activations and frames; the weights stay.
    #[test]
    fn a_larger_microbatch_scales_its_costs_not_the_weights() {
        let (m, big) = (
            ModelPreset::by_name("llama-500m").unwrap(),
            ModelPreset::with_sequences("llama-500m", Some(32)).unwrap(),
        );
        assert_eq!((m.sequences, big.sequences), (2, 32));
        let r = |a: f64, b: f64| b / a;
        assert!((r(m.stage_fwd_flops(1), big.stage_fwd_flops(1)) - 16.0).abs() < 1e-9);
        assert_eq!(16 * m.activation_bytes(), big.activation_bytes());
        assert_eq!(16 * m.relay_act[0], big.relay_act[0]);
        assert_eq!(m.stage_params(1), big.stage_params(1));
        assert!(ModelPreset::with_sequences("llama-500m", Some(0)).is_none());
    }
}
