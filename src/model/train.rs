//! The single-process pipeline: all stages of a plan run one after another in this process.
//!
//! [`Trainer`] is the training loop shared with the device trainer ([`super::gpu`]): data
//! order, learning-rate schedule, logs, held-out evaluation, and the state a checkpoint
//! needs to continue bit for bit.
use super::config::{ModelConfig, StagePlan};
use super::data::Batcher;
use super::dataset::{DataSource, Dataset};
use super::kernels::AdamW;
use super::stage::{MicrobatchId, Stage, StageInput, StageOutput, StageState};
use super::ModelError;
use std::time::Instant;

/// All stages of a model, run in sequence.
pub struct Pipeline {
    /// The stages, in order.
    pub stages: Vec<Stage>,
    next_mb: MicrobatchId,
}

impl Pipeline {
    /// The model `cfg` cut into `n_stages` stages, initialised from `seed`.
    pub fn new(cfg: &ModelConfig, n_stages: usize, seed: u64) -> Result<Self, ModelError> {
        let plan = StagePlan::new(cfg, n_stages)?;
        Ok(Pipeline {
            stages: Stage::all(cfg, &plan, seed)?,
            next_mb: 0,
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

    /// The next-token distribution after `context` (one sequence, `1..=max_seq` tokens):
    /// the softmax of the logits at its last position. Nothing is trained.
    pub fn next_token_probs(&mut self, context: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mb = u64::MAX;
        let t = context.len();
        let dummy = vec![0u32; t];
        let r = self.forward_all(mb, 1, t, context, &dummy).and_then(|_| {
            let last = self.stages.last().and_then(|s| s.saved_probs(mb));
            let probs = last.ok_or(ModelError::MissingTargets)?;
            let v = probs.len() / t.max(1);
            Ok(probs[(t - 1) * v..].to_vec())
        });
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

    /// Every stage's parameters, AdamW moments and step count.
    pub fn states(&self) -> Vec<StageState> {
        self.stages.iter().map(|s| s.state()).collect()
    }

    /// Replaces every stage's state (each checked against its stage first).
    pub fn set_states(&mut self, states: &[StageState]) -> Result<(), ModelError> {
        check_state_count(self.stages.len(), states.len())?;
        for (s, st) in self.stages.iter().zip(states) {
            st.check(s.spec().index, s.num_params())?;
        }
        for (s, st) in self.stages.iter_mut().zip(states) {
            s.set_state(st)?;
        }
        Ok(())
    }
}

pub(crate) fn check_state_count(stages: usize, states: usize) -> Result<(), ModelError> {
    if stages != states {
        return Err(ModelError::BadState(format!(
            "{states} stage states for a {stages}-stage pipeline"
        )));
    }
    Ok(())
}

/// What [`Trainer`] needs of a model: the CPU [`Pipeline`] or a device pipeline.
pub trait TrainModel {
    /// One optimizer step on the microbatches (`batch * seq` token and target ids each);
    /// returns each microbatch's mean loss.
    fn train_step(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
        opt: &AdamW,
    ) -> Result<Vec<f32>, ModelError>;
    /// Each microbatch's mean loss, without training.
    fn eval_losses(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
    ) -> Result<Vec<f32>, ModelError>;
    /// Every stage's state, on the host.
    fn stage_states(&self) -> Result<Vec<StageState>, ModelError>;
    /// Replaces every stage's state.
    fn set_stage_states(&mut self, states: &[StageState]) -> Result<(), ModelError>;
}

impl TrainModel for Pipeline {
    fn train_step(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
        opt: &AdamW,
    ) -> Result<Vec<f32>, ModelError> {
        let mut losses = Vec::with_capacity(microbatches.len());
        for (x, y) in microbatches {
            losses.push(self.forward_backward(self.next_mb, batch, seq, x, y)?);
            self.next_mb += 1;
        }
        self.step(opt)?;
        Ok(losses)
    }

    fn eval_losses(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
    ) -> Result<Vec<f32>, ModelError> {
        microbatches
            .iter()
            .map(|(x, y)| self.eval_loss(batch, seq, x, y))
            .collect()
    }

    fn stage_states(&self) -> Result<Vec<StageState>, ModelError> {
        Ok(self.states())
    }

    fn set_stage_states(&mut self, states: &[StageState]) -> Result<(), ModelError> {
        self.set_states(states)
    }
}

/// Options of [`train`] and [`Trainer`].
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    /// Optimizer steps of the whole run: the horizon of the learning-rate schedule. [`train`]
    /// runs them all; a [`Trainer`] may run them in parts (save, resume), or go on past
    /// them at the final rate.
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
    /// Size of the generated corpus (when training on it).
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

    /// The defaults of a run of `steps` optimizer steps (what `gwtf train` and the swarm
    /// use): linear warmup over a tenth of it (1 to 20 steps), peak learning rate 1e-2
    /// for models up to 64 wide and 1e-3 above, a 512 KiB generated corpus above 64 wide.
    pub fn for_run(cfg: &ModelConfig, steps: usize) -> Self {
        let mut o = Self::for_config(cfg);
        o.steps = steps;
        o.warmup = (steps / 10).clamp(1, 20);
        o.lr = if cfg.d_model <= 64 { 1e-2 } else { 1e-3 };
        if cfg.d_model > 64 {
            o.corpus_bytes = 512 * 1024;
        }
        o
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
pub fn check_options(cfg: &ModelConfig, o: &TrainOptions) -> Result<(), ModelError> {
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

/// The training loop: a model, its data and where it is in them. Running `a` steps, taking
/// [`Trainer::checkpoint_state`], and continuing a new trainer from it with
/// [`Trainer::resume`] for `b` steps gives bit for bit the run of `a + b` steps.
pub struct Trainer<M> {
    model: M,
    opts: TrainOptions,
    data: Dataset,
    batcher: Batcher,
    steps_done: usize,
    t0: Option<Instant>,
}

/// Where a run is, besides its stages: what a checkpoint adds to the stage states.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    /// Optimizer steps taken.
    pub steps_done: usize,
    /// Position of the training-window sampler in its random stream.
    pub data_rng_state: u64,
}

impl<M: TrainModel> Trainer<M> {
    /// A trainer at step 0 (the model as given, normally fresh from the seed). The
    /// training documents move into the window sampler (no second copy is kept).
    pub fn new(model: M, opts: TrainOptions, mut data: Dataset) -> Result<Self, ModelError> {
        let train = std::mem::take(&mut data.train);
        let batcher = Batcher::from_documents(train, opts.seed.wrapping_add(17))?;
        Ok(Trainer {
            model,
            opts,
            data,
            batcher,
            steps_done: 0,
            t0: None,
        })
    }

    /// Continues from a checkpoint: the stages' states and the run's progress.
    pub fn resume(&mut self, states: &[StageState], p: &Progress) -> Result<(), ModelError> {
        self.model.set_stage_states(states)?;
        self.batcher.set_rng_state(p.data_rng_state);
        self.steps_done = p.steps_done;
        Ok(())
    }

    /// The options.
    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }
    /// The data: its description and held-out part (the training documents are in the
    /// sampler, `train` is empty here).
    pub fn data(&self) -> &Dataset {
        &self.data
    }
    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }
    /// The model, mutably.
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    /// Where the run is.
    pub fn progress(&self) -> Progress {
        Progress {
            steps_done: self.steps_done,
            data_rng_state: self.batcher.rng_state(),
        }
    }

    /// Everything a checkpoint holds of the run: every stage's state and the progress.
    pub fn checkpoint_state(&self) -> Result<(Vec<StageState>, Progress), ModelError> {
        Ok((self.model.stage_states()?, self.progress()))
    }

    /// Runs `steps` more optimizer steps; calls `on_step` after each and returns their logs
    /// (steps numbered from the start of the run, 1-based).
    pub fn run(
        &mut self,
        steps: usize,
        mut on_step: impl FnMut(&StepLog),
    ) -> Result<Vec<StepLog>, ModelError> {
        let o = &self.opts;
        let mut logs = Vec::with_capacity(steps);
        let t0 = *self.t0.get_or_insert_with(Instant::now);
        for _ in 0..steps {
            let s = self.steps_done;
            let ts = Instant::now();
            let mut mbs = Vec::with_capacity(o.accum);
            for _ in 0..o.accum {
                mbs.push(self.batcher.next_batch(o.batch, o.seq)?);
            }
            let lr = o.lr_at(s);
            let opt = AdamW {
                lr,
                weight_decay: o.weight_decay,
                ..AdamW::default()
            };
            let losses = self.model.train_step(o.batch, o.seq, &mbs, &opt)?;
            self.steps_done += 1;
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

    /// Mean loss over the held-out sequences ([`Dataset::heldout_windows`]), evaluated
    /// `batch` sequences at a time; nothing is trained.
    pub fn heldout_loss(&mut self) -> Result<f32, ModelError> {
        self.heldout_loss_of(usize::MAX)
    }

    /// [`Trainer::heldout_loss`] over the first `most` held-out sequences (a large
    /// model on a CPU: each costs a forward).
    pub fn heldout_loss_of(&mut self, most: usize) -> Result<f32, ModelError> {
        let (b, t) = (self.opts.batch, self.opts.seq);
        let mut windows = self.data.heldout_windows(t);
        windows.truncate(most);
        if windows.is_empty() {
            return Err(ModelError::Data(format!(
                "no held-out sequence of {t} tokens"
            )));
        }
        let (mut sum, mut n) = (0.0f64, 0usize);
        for chunk in windows.chunks(b) {
            let mut x = Vec::with_capacity(chunk.len() * t);
            let mut y = Vec::with_capacity(chunk.len() * t);
            for (a, c) in chunk {
                x.extend_from_slice(a);
                y.extend_from_slice(c);
            }
            let l = self.model.eval_losses(chunk.len(), t, &[(x, y)])?;
            sum += l[0] as f64 * chunk.len() as f64;
            n += chunk.len();
        }
        Ok((sum / n as f64) as f32)
    }
}

/// Trains `cfg` on the generated corpus with the stages run one after another; calls
/// `on_step` after every step and returns all logs.
pub fn train(
    cfg: &ModelConfig,
    o: &TrainOptions,
    on_step: impl FnMut(&StepLog),
) -> Result<Vec<StepLog>, ModelError> {
    check_options(cfg, o)?;
    let data = Dataset::load(
        &DataSource::Synthetic {
            seed: o.seed,
            bytes: o.corpus_bytes,
        },
        o.seq,
    )?;
    let p = Pipeline::new(cfg, o.stages, o.seed)?;
    Trainer::new(p, o.clone(), data)?.run(o.steps, on_step)
}
