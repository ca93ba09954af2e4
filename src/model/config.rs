//! Model configurations, presets, the cut into pipeline stages and per-stage costs.
use super::ModelError;
use std::ops::Range;

/// The two model families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// GPT-2-like: learned positions, LayerNorm (with bias), GELU MLP, biased linears.
    Gpt,
    /// LLaMA-like: RoPE, RMSNorm, SwiGLU MLP, no biases.
    Llama,
}

/// Shape of a model (and its default microbatch shape). Serialized as is in a
/// checkpoint's `config.json` (with the run's stages and microbatch shape).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    /// Preset name (free text for custom configs).
    pub name: String,
    /// Family.
    pub family: Family,
    /// Vocabulary size (256 for the byte-level tokenizer).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Attention heads (`d_model % n_heads == 0`).
    pub n_heads: usize,
    /// Hidden width of the MLP (GPT: usually 4 d; LLaMA: SwiGLU width, about 8/3 d).
    pub ffn_hidden: usize,
    /// Longest sequence (GPT: size of the learned position table).
    pub max_seq: usize,
    /// Default number of pipeline stages for this preset.
    pub n_stages: usize,
    /// Default microbatch: sequences per microbatch.
    pub batch: usize,
    /// Default microbatch: tokens per sequence (`<= max_seq`).
    pub seq: usize,
    /// RoPE base (LLaMA).
    pub rope_base: f64,
    /// Epsilon of the norms.
    pub norm_eps: f64,
}

/// Names accepted by [`preset`], smallest first.
pub const PRESET_NAMES: [&str; 7] = [
    "gpt-tiny",
    "llama-tiny",
    "llama-small",
    "llama-124m",
    "gpt2-small",
    "llama-500m",
    "llama-1.5b",
];

/// The names of the presets.
pub fn preset_names() -> &'static [&'static str] {
    &PRESET_NAMES
}

/// A preset configuration by name (see [`PRESET_NAMES`]).
pub fn preset(name: &str) -> Result<ModelConfig, ModelError> {
    #[allow(clippy::too_many_arguments)]
    fn mk(
        name: &str,
        family: Family,
        vocab: usize,
        d: usize,
        layers: usize,
        heads: usize,
        ffn: usize,
        max_seq: usize,
        stages: usize,
        batch: usize,
        seq: usize,
    ) -> ModelConfig {
        ModelConfig {
            name: name.to_string(),
            family,
            vocab_size: vocab,
            d_model: d,
            n_layers: layers,
            n_heads: heads,
            ffn_hidden: ffn,
            max_seq,
            n_stages: stages,
            batch,
            seq,
            rope_base: 10000.0,
            norm_eps: 1e-5,
        }
    }
    use Family::*;
    let c = match name {
        "gpt-tiny" => mk(name, Gpt, 256, 32, 2, 4, 128, 16, 4, 8, 16),
        "llama-tiny" => mk(name, Llama, 256, 32, 2, 4, 96, 16, 4, 8, 16),
        // ~10.8M parameters, byte-level: the demo model.
        "llama-small" => mk(name, Llama, 256, 384, 6, 6, 1024, 128, 5, 4, 128),
        // Shapes of LLaMA-like models at ~124M, ~500M and ~1.5B parameters (vocab 32000,
        // untied head). Used for cost figures by the simulator; never allocated by tests.
        "llama-124m" => mk(name, Llama, 32000, 768, 12, 12, 1664, 1024, 6, 4, 1024),
        "llama-500m" => mk(name, Llama, 32000, 1280, 24, 20, 3072, 1024, 8, 2, 1024),
        "llama-1.5b" => mk(name, Llama, 32000, 2048, 24, 16, 6144, 1024, 8, 1, 1024),
        // GPT-2 small's shape (12 blocks of 768, 12 heads, MLP 3072, 1024 positions,
        // its 50257 tokens) with an untied head: 163M parameters (124M tied). Trains on
        // the byte-level data (ids below 256); checked against Hugging Face's GPT-2.
        "gpt2-small" => mk(name, Gpt, 50257, 768, 12, 12, 3072, 1024, 6, 1, 128),
        _ => return Err(ModelError::UnknownPreset(name.to_string())),
    };
    Ok(c)
}

impl ModelConfig {
    /// Checks the shape; every constructor of stages calls it.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |s: String| Err(ModelError::InvalidConfig(s));
        if self.vocab_size == 0 || self.vocab_size > u32::MAX as usize {
            return bad(format!("vocab_size {} out of range", self.vocab_size));
        }
        if self.d_model == 0 || self.n_heads == 0 || self.ffn_hidden == 0 || self.max_seq == 0 {
            return bad("d_model, n_heads, ffn_hidden and max_seq must be > 0".into());
        }
        if self.d_model % self.n_heads != 0 {
            return bad(format!(
                "d_model {} is not divisible by n_heads {}",
                self.d_model, self.n_heads
            ));
        }
        if self.family == Family::Llama && (self.d_model / self.n_heads) % 2 != 0 {
            return bad("RoPE needs an even head size".into());
        }
        if self.batch == 0 || self.seq == 0 || self.seq > self.max_seq {
            return bad(format!(
                "microbatch batch {} seq {} (max_seq {})",
                self.batch, self.seq, self.max_seq
            ));
        }
        if self.norm_eps.is_nan()
            || self.norm_eps <= 0.0
            || self.rope_base.is_nan()
            || self.rope_base <= 1.0
        {
            return bad("norm_eps must be > 0 and rope_base > 1".into());
        }
        StagePlan::new(self, self.n_stages).map(|_| ())
    }

    /// Head size.
    pub fn head_size(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Parameters of the embedding part (token table, plus positions for GPT).
    pub fn embedding_params(&self) -> usize {
        let pos = if self.family == Family::Gpt {
            self.max_seq * self.d_model
        } else {
            0
        };
        self.vocab_size * self.d_model + pos
    }

    /// Parameters of one transformer block.
    pub fn block_params(&self) -> usize {
        block_tensors(self).iter().map(|t| t.len).sum()
    }

    /// Parameters of the head part (final norm + output projection).
    pub fn head_params(&self) -> usize {
        head_tensors(self).iter().map(|t| t.len).sum()
    }

    /// Total parameters of the model.
    pub fn total_params(&self) -> usize {
        self.embedding_params() + self.n_layers * self.block_params() + self.head_params()
    }
}

/// How a parameter tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with this standard deviation.
    Normal(f64),
    /// All ones (norm weights).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// One parameter tensor of a stage's flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// Name, e.g. `qkv_w`.
    pub name: &'static str,
    /// Number of elements.
    pub len: usize,
    /// Initialisation.
    pub init: Init,
    /// Whether AdamW applies weight decay to it (matrices yes; norms, biases no).
    pub decay: bool,
}

fn t(name: &'static str, len: usize, init: Init, decay: bool) -> TensorSpec {
    TensorSpec {
        name,
        len,
        init,
        decay,
    }
}

/// Tensors of the embedding, in buffer order.
pub fn embedding_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let mut v = vec![t(
        "wte",
        c.vocab_size * c.d_model,
        Init::Normal(0.02),
        false,
    )];
    if c.family == Family::Gpt {
        v.push(t("wpe", c.max_seq * c.d_model, Init::Normal(0.01), false));
    }
    v
}

/// Tensors of one block, in buffer order (see `stage.rs` for the index constants).
pub fn block_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let d = c.d_model;
    let h = c.ffn_hidden;
    let proj_std = 0.02 / (2.0 * c.n_layers.max(1) as f64).sqrt();
    match c.family {
        Family::Gpt => vec![
            t("ln1_w", d, Init::Ones, false),
            t("ln1_b", d, Init::Zeros, false),
            t("qkv_w", 3 * d * d, Init::Normal(0.02), true),
            t("qkv_b", 3 * d, Init::Zeros, false),
            t("attproj_w", d * d, Init::Normal(proj_std), true),
            t("attproj_b", d, Init::Zeros, false),
            t("ln2_w", d, Init::Ones, false),
            t("ln2_b", d, Init::Zeros, false),
            t("fc_w", h * d, Init::Normal(0.02), true),
            t("fc_b", h, Init::Zeros, false),
            t("fcproj_w", d * h, Init::Normal(proj_std), true),
            t("fcproj_b", d, Init::Zeros, false),
        ],
        Family::Llama => vec![
            t("rms1_w", d, Init::Ones, false),
            t("qkv_w", 3 * d * d, Init::Normal(0.02), true),
            t("attproj_w", d * d, Init::Normal(proj_std), true),
            t("rms2_w", d, Init::Ones, false),
            t("fc_w", 2 * h * d, Init::Normal(0.02), true),
            t("fcproj_w", d * h, Init::Normal(proj_std), true),
        ],
    }
}

/// Tensors of the head (final norm + untied output projection), in buffer order.
pub fn head_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let d = c.d_model;
    let mut v = vec![t("lnf_w", d, Init::Ones, false)];
    if c.family == Family::Gpt {
        v.push(t("lnf_b", d, Init::Zeros, false));
    }
    v.push(t("lm_head", c.vocab_size * d, Init::Normal(0.02), true));
    v
}

/// What one stage holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// Stage index, 0-based.
    pub index: usize,
    /// Holds the embedding (stage 0).
    pub embedding: bool,
    /// Transformer blocks it holds (global layer indices).
    pub blocks: Range<usize>,
    /// Holds the final norm, head and loss (last stage).
    pub head: bool,
}

/// The checks of what a stage is given, said once for the CPU [`super::Stage`] and the
/// device stage ([`super::gpu::DeviceStage`]).
impl StageSpec {
    /// A microbatch of `batch` sequences of `seq` tokens fits `cfg`: its `batch * seq`
    /// positions.
    pub fn check_microbatch(
        &self,
        cfg: &ModelConfig,
        batch: usize,
        seq: usize,
    ) -> Result<usize, ModelError> {
        match batch.checked_mul(seq) {
            Some(n) if batch > 0 && seq > 0 && seq <= cfg.max_seq => Ok(n),
            _ => Err(ModelError::InvalidConfig(format!(
                "microbatch of {batch} x {seq} (max_seq {})",
                cfg.max_seq
            ))),
        }
    }

    /// The activations a stage after the first takes: `[positions, d_model]` values.
    pub fn check_activations(
        &self,
        cfg: &ModelConfig,
        positions: usize,
        len: usize,
    ) -> Result<(), ModelError> {
        exactly("input activations", positions * cfg.d_model, len)
    }

    /// The gradient `backward` takes: none for the last stage (its loss is the start),
    /// `[positions, d_model]` values for the others (`len`: what was given).
    pub fn check_grad_output(
        &self,
        cfg: &ModelConfig,
        positions: usize,
        len: Option<usize>,
    ) -> Result<(), ModelError> {
        match (self.head, len) {
            (true, Some(_)) => Err(ModelError::WrongInput(
                "the last stage takes no output gradient",
            )),
            (false, None) => Err(ModelError::MissingGradient),
            (false, Some(len)) => exactly("output gradient", positions * cfg.d_model, len),
            (true, None) => Ok(()),
        }
    }
}

fn exactly(what: &'static str, expected: usize, got: usize) -> Result<(), ModelError> {
    if got != expected {
        return Err(ModelError::ShapeMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// The cut of a model into `S` contiguous stages. With `S >= 3`: stage 0 is the embedding,
/// stage `S-1` the final norm + head + loss, and the blocks are spread evenly (earlier stages
/// take the remainder) over stages `1..S-1`. With `S = 2` stage 0 holds the embedding and all
/// blocks; with `S = 1` a single stage is the whole (unsplit) model. `S <= n_layers + 2`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePlan {
    /// The stages, in order.
    pub stages: Vec<StageSpec>,
}

impl StagePlan {
    /// Cuts `cfg` into `n_stages` stages.
    pub fn new(cfg: &ModelConfig, n_stages: usize) -> Result<Self, ModelError> {
        let l = cfg.n_layers;
        if n_stages == 0 || n_stages > l + 2 {
            return Err(ModelError::InvalidConfig(format!(
                "{n_stages} stages for {l} layers (need 1..={})",
                l + 2
            )));
        }
        let stages = match n_stages {
            1 => vec![StageSpec {
                index: 0,
                embedding: true,
                blocks: 0..l,
                head: true,
            }],
            2 => vec![
                StageSpec {
                    index: 0,
                    embedding: true,
                    blocks: 0..l,
                    head: false,
                },
                StageSpec {
                    index: 1,
                    embedding: false,
                    blocks: l..l,
                    head: true,
                },
            ],
            s => {
                let mid = s - 2;
                let mut v = vec![StageSpec {
                    index: 0,
                    embedding: true,
                    blocks: 0..0,
                    head: false,
                }];
                let mut start = 0;
                for i in 0..mid {
                    let n = l / mid + usize::from(i < l % mid);
                    v.push(StageSpec {
                        index: i + 1,
                        embedding: false,
                        blocks: start..start + n,
                        head: false,
                    });
                    start += n;
                }
                v.push(StageSpec {
                    index: s - 1,
                    embedding: false,
                    blocks: l..l,
                    head: true,
                });
                v
            }
        };
        Ok(StagePlan { stages })
    }

    /// Number of stages.
    pub fn len(&self) -> usize {
        self.stages.len()
    }

    /// Never true for a valid plan.
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }
}

/// What one stage costs per microbatch (derived from the shapes; nothing is allocated).
#[derive(Clone, Debug, PartialEq)]
pub struct StageCost {
    /// Stage index.
    pub index: usize,
    /// Parameters held by the stage.
    pub params: u64,
    /// Forward FLOPs per microbatch: matmuls `2*m*n*k`, attention `QK^T` and `AV` over the
    /// causal half (`t*(t+1)/2` pairs), head matmul; elementwise ops are not counted.
    pub fwd_flops: u64,
    /// Backward FLOPs per microbatch: twice the matmul and attention FLOPs of the forward
    /// (input and weight gradients).
    pub bwd_flops: u64,
    /// Bytes of activations the stage keeps per in-flight microbatch for its backward
    /// (f32, as this implementation stores them).
    pub activation_bytes: u64,
    /// Bytes of the frame it sends forward (`[batch, seq, d_model]` f32; 4 bytes for the
    /// loss of the last stage). The gradient sent backward has the size of its input frame.
    pub output_bytes: u64,
}

/// Per-stage costs for microbatches of `batch` sequences of `seq` tokens.
pub fn stage_costs(
    cfg: &ModelConfig,
    plan: &StagePlan,
    batch: usize,
    seq: usize,
) -> Vec<StageCost> {
    let (b, t, d, h, v) = (
        batch as u64,
        seq as u64,
        cfg.d_model as u64,
        cfg.ffn_hidden as u64,
        cfg.vocab_size as u64,
    );
    let n = b * t;
    let nh = cfg.n_heads as u64;
    let mm = |m: u64, k: u64, nn: u64| 2 * m * k * nn;
    let pairs = t * (t + 1) / 2;
    let attn = 2 * 2 * b * nh * pairs * (d / nh); // QK^T and AV
    let block_mm = match cfg.family {
        Family::Gpt => mm(n, d, 3 * d) + mm(n, d, d) + mm(n, d, h) + mm(n, h, d),
        Family::Llama => mm(n, d, 3 * d) + mm(n, d, d) + mm(n, d, 2 * h) + mm(n, h, d),
    };
    let block_fwd = block_mm + attn;
    let block_act = match cfg.family {
        // inp, ln1, qkv, atty, res2, ln2, fch, gelu + 4 stats + att
        Family::Gpt => n * (d + d + 3 * d + d + d + d + h + h + 4) + b * nh * t * t,
        // inp, rms1, qkv (after rope), atty, res2, rms2, fch(2h), swiglu(h) + 2 stats + att
        Family::Llama => n * (d + d + 3 * d + d + d + d + 2 * h + h + 2) + b * nh * t * t,
    };
    let head_fwd = mm(n, d, v);
    let head_act = n * (d + d + 2 + v) + n; // inp, norm, stats, probs, targets
    plan.stages
        .iter()
        .map(|s| {
            let nb = s.blocks.len() as u64;
            let mut params = nb * cfg.block_params() as u64;
            let mut fwd = nb * block_fwd;
            let mut act = nb * block_act;
            if s.embedding {
                params += cfg.embedding_params() as u64;
                act += n; // token ids
            }
            if s.head {
                params += cfg.head_params() as u64;
                fwd += head_fwd;
                act += head_act;
            }
            StageCost {
                index: s.index,
                params,
                fwd_flops: fwd,
                bwd_flops: 2 * fwd,
                activation_bytes: 4 * act,
                output_bytes: if s.head { 4 } else { 4 * n * d },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a stage is given is checked the same way for the CPU and the device
    /// stage: these are the checks both call.
    #[test]
    fn a_stage_checks_microbatches_activations_and_gradients() {
        let cfg = preset("gpt-tiny").unwrap();
        let plan = StagePlan::new(&cfg, 3).unwrap();
        let (first, mid, last) = (&plan.stages[0], &plan.stages[1], &plan.stages[2]);
        let c = cfg.d_model;
        assert_eq!(
            mid.check_microbatch(&cfg, 2, cfg.max_seq).unwrap(),
            2 * cfg.max_seq
        );
        for (b, t) in [(0, 4), (2, 0), (2, cfg.max_seq + 1), (usize::MAX, 2)] {
            let e = first.check_microbatch(&cfg, b, t).unwrap_err();
            assert!(matches!(e, ModelError::InvalidConfig(_)), "{b} x {t}: {e}");
        }
        mid.check_activations(&cfg, 6, 6 * c).unwrap();
        let e = mid.check_activations(&cfg, 6, 6 * c - 1).unwrap_err();
        assert!(
            matches!(e, ModelError::ShapeMismatch { what: "input activations", expected, got }
                if expected == 6 * c && got == 6 * c - 1),
            "{e}"
        );
        mid.check_grad_output(&cfg, 6, Some(6 * c)).unwrap();
        last.check_grad_output(&cfg, 6, None).unwrap();
        let e = mid.check_grad_output(&cfg, 6, Some(5 * c)).unwrap_err();
        assert!(
            matches!(
                e,
                ModelError::ShapeMismatch {
                    what: "output gradient",
                    ..
                }
            ),
            "{e}"
        );
        let e = mid.check_grad_output(&cfg, 6, None).unwrap_err();
        assert!(matches!(e, ModelError::MissingGradient), "{e}");
        let e = last.check_grad_output(&cfg, 6, Some(6 * c)).unwrap_err();
        assert!(matches!(e, ModelError::WrongInput(_)), "{e}");
    }
}
