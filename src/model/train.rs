//! The single-process pipeline: all stages of a plan run one after another in this process.
use super::config::{ModelConfig, StagePlan};
use super::data::{generate_corpus, tokenize, Batcher};
use super::kernels::AdamW;
use super::stage::{MicrobatchId, Stage, StageInput, StageOutput};
use super::ModelError;
use std::time::Instant;

/// All stages of a model, run in sequence.
pub struct Pipeline {
    /// The stages, in order.
    pub stages: Vec<Stage>,
}

impl Pipeline {
    /// The model `cfg` cut into `n_stages` stages, initialised from `seed`.
    pub fn new(cfg: &ModelConfig, n_stages: usize, seed: u64) -> Result<Self, ModelError> {
        let plan = StagePlan::new(cfg, n_stages)?;
        Ok(Pipeline {
            stages: Stage::all(cfg, &plan, seed)?,
        })
    }

    fn forward_all(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f32, ModelError> {
        let last = self.stages.len() - 1;
        let mut h: Vec<f32> = Vec::new();
        for (i, s) in self.stages.iter_mut().enumerate() {
            let input = if i == 0 {
                StageInput::Tokens(tokens)
            } else {
                StageInput::Hidden(&h)
            };
            let tg = (i == last).then_some(targets);
            match s.forward(mb, batch, seq, input, tg)? {
                StageOutput::Hidden(x) => h = x,
                StageOutput::Loss(l) => return Ok(l),
            }
        }
        Err(ModelError::InvalidConfig(
            "pipeline has no loss stage".into(),
        ))
    }

    /// Forward and backward of one microbatch through every stage; the gradients are
    /// accumulated in the stages. Returns the microbatch's mean loss.
    pub fn forward_backward(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f32, ModelError> {
        let loss = self.forward_all(mb, batch, seq, tokens, targets)?;
        let mut g: Option<Vec<f32>> = None;
        for s in self.stages.iter_mut().rev() {
            g = s.backward(mb, g.as_deref())?;
        }
        Ok(loss)
    }

    /// Loss without training (activations are dropped, no gradient).
    pub fn eval_loss(
        &mut self,
        batch: usize,
        seq: usize,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f32, ModelError> {
        let mb = u64::MAX;
        let r = self.forward_all(mb, batch, seq, tokens, targets);
        for s in &mut self.stages {
            s.discard(mb);
        }
        r
    }

    /// AdamW step on every stage.
    pub fn step(&mut self, opt: &AdamW) -> Result<(), ModelError> {
        self.stages.iter_mut().try_for_each(|s| s.step(opt))
    }

    /// All parameters, stage after stage.
    pub fn params_flat(&self) -> Vec<f32> {
        self.stages
            .iter()
            .flat_map(|s| s.params().iter().copied())
            .collect()
    }

    /// All accumulated gradients, stage after stage.
    pub fn grads_flat(&self) -> Vec<f32> {
        self.stages
            .iter()
            .flat_map(|s| s.grads().iter().copied())
            .collect()
    }

    /// Total parameters.
    pub fn num_params(&self) -> usize {
        self.stages.iter().map(|s| s.num_params()).sum()
    }
}

/// Options of [`train`].
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Optimizer steps.
    pub steps: usize,
    /// Seed of initialisation, corpus and sampling.
    pub seed: u64,
    /// Peak learning rate (linear warmup, then cosine decay to 10%).
    pub lr: f32,
    /// Warmup steps.
    pub warmup: usize,
    /// Sequences per microbatch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Microbatches accumulated per step.
    pub accum: usize,
    /// Pipeline stages.
    pub stages: usize,
    /// Size of the generated corpus.
    pub corpus_bytes: usize,
    /// AdamW weight decay.
    pub weight_decay: f32,
}

impl TrainOptions {
    /// Defaults for a config: its microbatch shape and stage count.
    pub fn for_config(cfg: &ModelConfig) -> Self {
        TrainOptions {
            steps: 100,
            seed: 1,
            lr: 1e-3,
            warmup: 10,
            batch: cfg.batch,
            seq: cfg.seq,
            accum: 1,
            stages: cfg.n_stages,
            corpus_bytes: 64 * 1024,
            weight_decay: 0.1,
        }
    }

    /// Learning rate at step `s` (0-based).
    pub fn lr_at(&self, s: usize) -> f32 {
        if s < self.warmup {
            return self.lr * (s + 1) as f32 / self.warmup as f32;
        }
        let span = (self.steps.saturating_sub(self.warmup)).max(1) as f32;
        let p = ((s - self.warmup) as f32 / span).min(1.0);
        let cos = 0.5 * (1.0 + (std::f32::consts::PI * p).cos());
        self.lr * (0.1 + 0.9 * cos)
    }
}

/// One logged optimizer step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StepLog {
    /// Step, 1-based.
    pub step: usize,
    /// Mean training loss over the step's microbatches.
    pub loss: f32,
    /// Tokens (forward + backward) per second in this step.
    pub tokens_per_s: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Seconds since training started.
    pub elapsed_s: f64,
}

/// Checks [`TrainOptions`] for `cfg` (shared by [`train`] and the device trainer).
pub(crate) fn check_options(cfg: &ModelConfig, o: &TrainOptions) -> Result<(), ModelError> {
    if cfg.vocab_size < 256 {
        return Err(ModelError::InvalidConfig(
            "byte-level training needs vocab_size >= 256".into(),
        ));
    }
    if o.batch == 0 || o.seq == 0 || o.seq > cfg.max_seq || o.accum == 0 {
        return Err(ModelError::InvalidConfig(format!(
            "batch {} seq {} accum {} (max_seq {})",
            o.batch, o.seq, o.accum, cfg.max_seq
        )));
    }
    if !o.lr.is_finite() || o.lr <= 0.0 {
        return Err(ModelError::InvalidConfig(format!("learning rate {}", o.lr)));
    }
    Ok(())
}

/// The training loop shared by [`train`] and the device trainer: the seeded corpus and
/// sampler, the learning-rate schedule and the logs. `step` runs one optimizer step on
/// the step's microbatches (`accum` pairs of token and target ids, `batch * seq` each)
/// and returns each microbatch's mean loss.
pub(crate) fn run_loop(
    o: &TrainOptions,
    mut step: impl FnMut(&[(Vec<u32>, Vec<u32>)], &AdamW) -> Result<Vec<f32>, ModelError>,
    mut on_step: impl FnMut(&StepLog),
) -> Result<Vec<StepLog>, ModelError> {
    let corpus = generate_corpus(o.seed, o.corpus_bytes);
    let mut data = Batcher::new(tokenize(&corpus), o.seed.wrapping_add(17))?;
    let mut logs = Vec::with_capacity(o.steps);
    let t0 = Instant::now();
    for s in 0..o.steps {
        let ts = Instant::now();
        let mut mbs = Vec::with_capacity(o.accum);
        for _ in 0..o.accum {
            mbs.push(data.next_batch(o.batch, o.seq)?);
        }
        let lr = o.lr_at(s);
        let opt = AdamW {
            lr,
            weight_decay: o.weight_decay,
            ..AdamW::default()
        };
        let losses = step(&mbs, &opt)?;
        let loss: f32 = losses.iter().sum();
        let dt = ts.elapsed().as_secs_f64();
        let log = StepLog {
            step: s + 1,
            loss: loss / o.accum as f32,
            tokens_per_s: (o.batch * o.seq * o.accum) as f64 / dt.max(1e-9),
            lr,
            elapsed_s: t0.elapsed().as_secs_f64(),
        };
        on_step(&log);
        logs.push(log);
    }
    Ok(logs)
}

/// Trains `cfg` on the generated corpus with the stages run one after another; calls
/// `on_step` after every step and returns all logs.
pub fn train(
    cfg: &ModelConfig,
    o: &TrainOptions,
    on_step: impl FnMut(&StepLog),
) -> Result<Vec<StepLog>, ModelError> {
    check_options(cfg, o)?;
    let mut p = Pipeline::new(cfg, o.stages, o.seed)?;
    let mut mb: MicrobatchId = 0;
    run_loop(
        o,
        |mbs, opt| {
            let mut losses = Vec::with_capacity(mbs.len());
            for (x, y) in mbs {
                losses.push(p.forward_backward(mb, o.batch, o.seq, x, y)?);
                mb += 1;
            }
            p.step(opt)?;
            Ok(losses)
        },
        on_step,
    )
}
