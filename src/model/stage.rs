//! A pipeline stage: a contiguous part of the model (embedding, blocks, head) with its
//! parameters, gradient accumulator, AdamW state and the activations of the microbatches
//! in flight.
use super::config::{
    block_tensors, embedding_tensors, head_tensors, Family, Init, ModelConfig, StagePlan,
    StageSpec, TensorSpec,
};
use super::kernels::{adamw_update, AdamW};
use super::ops::*;
use super::rng::Rng;
use super::ModelError;
use std::collections::HashMap;
use std::ops::Range;

/// Identifier of a microbatch (unique among those in flight at one stage).
pub type MicrobatchId = u64;

/// Shape of the activation (or gradient) frame between two stages: `[batch, seq, d_model]`
/// f32, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Width.
    pub d_model: usize,
}

impl ActShape {
    /// Number of f32 values.
    pub fn numel(&self) -> usize {
        self.batch * self.seq * self.d_model
    }
    /// Number of bytes (f32).
    pub fn bytes(&self) -> usize {
        4 * self.numel()
    }
}

/// What a stage's forward takes: token ids (stage 0) or the previous stage's activations.
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    /// `[batch * seq]` token ids (stage 0 only).
    Tokens(&'a [u32]),
    /// `[batch, seq, d_model]` activations (every other stage).
    Hidden(&'a [f32]),
}

/// What a stage's forward returns.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    /// Activations `[batch, seq, d_model]` for the next stage.
    Hidden(Vec<f32>),
    /// The mean cross-entropy loss of the microbatch (last stage).
    Loss(f32),
}

/// Activations one transformer block keeps for its backward pass.
#[derive(Default)]
struct BlockActs {
    inp: Vec<f32>,
    n1: Vec<f32>,
    n1_mean: Vec<f32>,
    n1_rstd: Vec<f32>,
    qkv: Vec<f32>, // after RoPE for LLaMA
    att: Vec<f32>,
    atty: Vec<f32>,
    res2: Vec<f32>,
    n2: Vec<f32>,
    n2_mean: Vec<f32>,
    n2_rstd: Vec<f32>,
    fch: Vec<f32>,
    fca: Vec<f32>,
}

struct HeadActs {
    inp: Vec<f32>,
    norm: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
    probs: Vec<f32>,
    targets: Vec<u32>,
}

struct Saved {
    batch: usize,
    seq: usize,
    tokens: Option<Vec<u32>>,
    blocks: Vec<BlockActs>,
    head: Option<HeadActs>,
}

/// Everything a stage carries from one optimizer step to the next: what a checkpoint keeps
/// of it (the gradient accumulator is empty between steps, activations are not kept).
#[derive(Clone, Debug, PartialEq)]
pub struct StageState {
    /// Stage index in its plan.
    pub index: usize,
    /// AdamW steps taken (the bias correction of the next step depends on it).
    pub step: u64,
    /// Parameters, flat, in the stage's tensor order.
    pub params: Vec<f32>,
    /// AdamW first moments, same layout.
    pub m: Vec<f32>,
    /// AdamW second moments, same layout.
    pub v: Vec<f32>,
}

impl StageState {
    /// Checks that the state fits a stage `index` of `n` parameters.
    pub fn check(&self, index: usize, n: usize) -> Result<(), ModelError> {
        if self.index != index || self.params.len() != n || self.m.len() != n || self.v.len() != n {
            return Err(ModelError::BadState(format!(
                "state of stage {} with {}/{}/{} params/m/v for stage {index} with {n}",
                self.index,
                self.params.len(),
                self.m.len(),
                self.v.len()
            )));
        }
        Ok(())
    }

    /// [`Stage::export_state`]'s bytes of this state, handed to `sink` piece by piece.
    pub fn bytes_into(&self, sink: impl FnMut(&[u8])) {
        state_bytes_into(
            self.index,
            self.step,
            [&self.params, &self.m, &self.v],
            sink,
        );
    }

    /// The state `parts` holds, decoded (what [`Stage::import_state`] loads).
    pub fn from_parts(parts: &StateParts<'_>) -> Result<StageState, ModelError> {
        Ok(StageState {
            index: parts.index,
            step: parts.step,
            params: bytes_to_f32s(parts.params)?,
            m: bytes_to_f32s(parts.m)?,
            v: bytes_to_f32s(parts.v)?,
        })
    }
}

/// The state format of [`Stage::export_state`], written from its parts.
fn state_bytes_into(index: usize, step: u64, vals: [&[f32]; 3], mut sink: impl FnMut(&[u8])) {
    sink(STATE_MAGIC);
    sink(&(index as u32).to_le_bytes());
    sink(&step.to_le_bytes());
    sink(&(vals[0].len() as u64).to_le_bytes());
    for v in vals {
        f32s_bytes_into(v, &mut sink);
    }
}

/// One pipeline stage.
pub struct Stage {
    cfg: ModelConfig,
    spec: StageSpec,
    tensors: Vec<(TensorSpec, Range<usize>)>,
    emb: Range<usize>,
    blocks: Vec<Range<usize>>,
    head: Range<usize>,
    params: Vec<f32>,
    grads: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    saved: HashMap<MicrobatchId, Saved>,
    accumulated: u64,
    step: u64,
}

const HEAD_ID: u64 = u32::MAX as u64;
const STATE_MAGIC: &[u8; 8] = b"GWTFSTG1";

fn split<'a>(mut s: &'a [f32], lens: &[usize]) -> Vec<&'a [f32]> {
    let mut v = Vec::with_capacity(lens.len());
    for &l in lens {
        let (a, b) = s.split_at(l);
        v.push(a);
        s = b;
    }
    v
}

fn split_mut<'a>(mut s: &'a mut [f32], lens: &[usize]) -> Vec<&'a mut [f32]> {
    let mut v = Vec::with_capacity(lens.len());
    for &l in lens {
        let (a, b) = std::mem::take(&mut s).split_at_mut(l);
        v.push(a);
        s = b;
    }
    v
}

pub(crate) fn check_tokens(
    what: &'static str,
    t: &[u32],
    n: usize,
    vocab: usize,
) -> Result<(), ModelError> {
    if t.len() != n {
        return Err(ModelError::ShapeMismatch {
            what,
            expected: n,
            got: t.len(),
        });
    }
    if let Some(&bad) = t.iter().find(|&&x| x as usize >= vocab) {
        return Err(ModelError::TokenOutOfRange { token: bad, vocab });
    }
    Ok(())
}

/// Where a stage's tensors lie in its flat buffers, and how they are initialised: shared by
/// the CPU [`Stage`] and the device stage ([`super::gpu::DeviceStage`]), so that both hold
/// the same tensors in the same order and start from the same values.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// The config, with `n_stages` set to the plan's (validated).
    pub cfg: ModelConfig,
    /// What the stage holds.
    pub spec: StageSpec,
    /// Every tensor and its range in the flat buffers, in buffer order.
    pub tensors: Vec<(TensorSpec, Range<usize>)>,
    /// `(layer, index in its list)` of every tensor: the key of its random stream.
    ids: Vec<(u64, u64)>,
    /// Range of the embedding tensors (empty if none).
    pub emb: Range<usize>,
    /// Range of each block's tensors.
    pub blocks: Vec<Range<usize>>,
    /// Range of the head's tensors (empty if none).
    pub head: Range<usize>,
}

impl Layout {
    /// The layout of stage `index` of `plan`.
    pub fn new(cfg: &ModelConfig, plan: &StagePlan, index: usize) -> Result<Layout, ModelError> {
        let mut c = cfg.clone();
        c.n_stages = plan.len();
        c.validate()?;
        let spec = plan.stages.get(index).cloned().ok_or_else(|| {
            ModelError::InvalidConfig(format!("stage {index} of a {}-stage plan", plan.len()))
        })?;
        let mut tensors = Vec::new();
        let mut off = 0;
        let mut ids = Vec::new();
        let mut push = |list: Vec<TensorSpec>, layer: u64, tensors: &mut Vec<_>| {
            let start = off;
            for (i, t) in list.into_iter().enumerate() {
                ids.push((layer, i as u64));
                tensors.push((t.clone(), off..off + t.len));
                off += t.len;
            }
            start..off
        };
        let emb = if spec.embedding {
            push(embedding_tensors(&c), 0, &mut tensors)
        } else {
            0..0
        };
        let mut blocks = Vec::new();
        for l in spec.blocks.clone() {
            blocks.push(push(block_tensors(&c), l as u64 + 1, &mut tensors));
        }
        let head = if spec.head {
            push(head_tensors(&c), HEAD_ID, &mut tensors)
        } else {
            off..off
        };
        Ok(Layout {
            cfg: c,
            spec,
            tensors,
            ids,
            emb,
            blocks,
            head,
        })
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.tensors.last().map(|(_, r)| r.end).unwrap_or(0)
    }

    /// The initial parameters for `seed`. A tensor's initial values depend only on the seed
    /// and the tensor's identity (layer, name), never on the cut.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut params = vec![0.0f32; self.num_params()];
        for ((t, r), (layer, ti)) in self.tensors.iter().zip(&self.ids) {
            let p = &mut params[r.clone()];
            match t.init {
                Init::Ones => p.fill(1.0),
                Init::Zeros => p.fill(0.0),
                Init::Normal(std) => {
                    let mut rng = Rng::derived(seed, &[*layer, *ti]);
                    for x in p.iter_mut() {
                        *x = (rng.normal() * std) as f32;
                    }
                }
            }
        }
        params
    }
}

impl Stage {
    /// Stage `index` of `plan`, initialised from `seed`. A tensor's initial values depend
    /// only on the seed and the tensor's identity (layer, name), never on the cut, so any
    /// plan of the same config starts from the same model.
    pub fn new(
        cfg: &ModelConfig,
        plan: &StagePlan,
        index: usize,
        seed: u64,
    ) -> Result<Stage, ModelError> {
        let layout = Layout::new(cfg, plan, index)?;
        let params = layout.init_params(seed);
        let n = params.len();
        let Layout {
            cfg: c,
            spec,
            tensors,
            emb,
            blocks,
            head,
            ..
        } = layout;
        Ok(Stage {
            cfg: c,
            spec,
            tensors,
            emb,
            blocks,
            head,
            grads: vec![0.0; n],
            m: vec![0.0; n],
            v: vec![0.0; n],
            params,
            saved: HashMap::new(),
            accumulated: 0,
            step: 0,
        })
    }

    /// All stages of a plan.
    pub fn all(cfg: &ModelConfig, plan: &StagePlan, seed: u64) -> Result<Vec<Stage>, ModelError> {
        (0..plan.len())
            .map(|i| Stage::new(cfg, plan, i, seed))
            .collect()
    }

    /// The config (with `n_stages` set to the plan's).
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// What this stage holds.
    pub fn spec(&self) -> &StageSpec {
        &self.spec
    }
    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }
    /// The parameter tensors and their ranges in the flat buffers.
    pub fn tensors(&self) -> &[(TensorSpec, Range<usize>)] {
        &self.tensors
    }
    /// Flat parameters.
    pub fn params(&self) -> &[f32] {
        &self.params
    }
    /// Accumulated gradients: the **sum** over the microbatches whose backward ran since the
    /// last step (each microbatch's gradient is that of its mean loss).
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }
    /// Microbatches accumulated into [`Stage::grads`] since the last step.
    pub fn accumulated(&self) -> u64 {
        self.accumulated
    }
    /// Optimizer steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }
    /// `(batch, seq)` of a microbatch whose forward is stored, if any.
    pub fn saved_shape(&self, mb: MicrobatchId) -> Option<(usize, usize)> {
        self.saved.get(&mb).map(|s| (s.batch, s.seq))
    }

    /// The head's softmax probabilities (`[batch * seq, vocab]`) of a microbatch whose
    /// forward ran on this stage (the last one) and is still held: what text generation
    /// samples from.
    pub fn saved_probs(&self, mb: MicrobatchId) -> Option<&[f32]> {
        self.saved
            .get(&mb)
            .and_then(|s| s.head.as_ref())
            .map(|h| h.probs.as_slice())
    }

    /// Microbatches whose forward ran and whose backward has not (activations held).
    pub fn in_flight(&self) -> usize {
        self.saved.len()
    }
    /// Shape of the activation frame for a microbatch of this config.
    pub fn act_shape(&self, batch: usize, seq: usize) -> ActShape {
        ActShape {
            batch,
            seq,
            d_model: self.cfg.d_model,
        }
    }

    /// Forward pass of microbatch `mb` (`batch` sequences of `seq` tokens). Stage 0 takes
    /// [`StageInput::Tokens`], the others [`StageInput::Hidden`]; the last stage needs the
    /// `targets` (`[batch * seq]`) and returns the loss. The activations needed by the
    /// backward are kept under `mb` until [`Stage::backward`] or [`Stage::discard`].
    pub fn forward(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, ModelError> {
        if self.saved.contains_key(&mb) {
            return Err(ModelError::DuplicateMicrobatch(mb));
        }
        let n = self.spec.check_microbatch(&self.cfg, batch, seq)?;
        let c = self.cfg.d_model;
        let v = self.cfg.vocab_size;
        let mut saved = Saved {
            batch,
            seq,
            tokens: None,
            blocks: Vec::new(),
            head: None,
        };
        let mut x = match (self.spec.embedding, input) {
            (true, StageInput::Tokens(tok)) => {
                check_tokens("tokens", tok, n, v)?;
                let p = &self.params[self.emb.clone()];
                let (wte, wpe) = p.split_at(v * c);
                let wpe = (self.cfg.family == Family::Gpt).then_some(wpe);
                let mut out = vec![0.0; n * c];
                encoder_forward(&mut out, tok, wte, wpe, seq, c);
                saved.tokens = Some(tok.to_vec());
                out
            }
            (false, StageInput::Hidden(h)) => {
                self.spec.check_activations(&self.cfg, n, h.len())?;
                h.to_vec()
            }
            (true, _) => return Err(ModelError::WrongInput("stage 0 takes token ids")),
            (false, _) => return Err(ModelError::WrongInput("this stage takes activations")),
        };
        if self.spec.head {
            let t = targets.ok_or(ModelError::MissingTargets)?;
            check_tokens("targets", t, n, v)?;
        }
        for r in &self.blocks {
            let (out, acts) = block_forward(&self.cfg, &self.params[r.clone()], x, batch, seq);
            saved.blocks.push(acts);
            x = out;
        }
        let out = if self.spec.head {
            let t = targets.ok_or(ModelError::MissingTargets)?;
            let p = &self.params[self.head.clone()];
            let (loss, acts) = head_forward(&self.cfg, p, x, t);
            saved.head = Some(acts);
            StageOutput::Loss(loss)
        } else {
            StageOutput::Hidden(x)
        };
        self.saved.insert(mb, saved);
        Ok(out)
    }

    /// Backward pass of microbatch `mb`: the last stage takes `None` (the gradient of its
    /// mean loss), the others the gradient of their output. Adds this microbatch's parameter
    /// gradients to the accumulator, frees its activations, and returns the gradient of the
    /// stage's input (`None` for stage 0). On a shape error nothing changes.
    pub fn backward(
        &mut self,
        mb: MicrobatchId,
        grad_output: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let c = self.cfg.d_model;
        let sv = self
            .saved
            .get(&mb)
            .ok_or(ModelError::UnknownMicrobatch(mb))?;
        self.spec
            .check_grad_output(&self.cfg, sv.batch * sv.seq, grad_output.map(<[f32]>::len))?;
        let sv = self
            .saved
            .remove(&mb)
            .ok_or(ModelError::UnknownMicrobatch(mb))?;
        let mut dx = match &sv.head {
            Some(h) => {
                let r = self.head.clone();
                head_backward(&self.cfg, &self.params[r.clone()], &mut self.grads[r], h)
            }
            None => grad_output.map(|g| g.to_vec()).unwrap_or_default(),
        };
        for (r, acts) in self.blocks.iter().zip(&sv.blocks).rev() {
            dx = block_backward(
                &self.cfg,
                &self.params[r.clone()],
                &mut self.grads[r.clone()],
                acts,
                &dx,
                sv.batch,
                sv.seq,
            );
        }
        self.accumulated += 1;
        if let Some(tok) = &sv.tokens {
            let v = self.cfg.vocab_size;
            let g = &mut self.grads[self.emb.clone()];
            let (dwte, dwpe) = g.split_at_mut(v * c);
            let dwpe = (self.cfg.family == Family::Gpt).then_some(dwpe);
            encoder_backward(dwte, dwpe, &dx, tok, sv.seq, c);
            Ok(None)
        } else {
            Ok(Some(dx))
        }
    }

    /// Drops the activations of `mb` without a backward (the microbatch was abandoned).
    /// Returns whether it was held.
    pub fn discard(&mut self, mb: MicrobatchId) -> bool {
        self.saved.remove(&mb).is_some()
    }

    /// Takes the accumulated gradient out (the accumulator starts again from
    /// zero): a swarm node keeps each microbatch's gradient apart until it
    /// knows the microbatch is counted in its stage's aggregate.
    pub fn take_grads(&mut self) -> Vec<f32> {
        self.accumulated = 0;
        std::mem::replace(&mut self.grads, vec![0.0; self.params.len()])
    }

    /// Sets the accumulated gradient to zero.
    pub fn zero_grad(&mut self) {
        self.grads.fill(0.0);
        self.accumulated = 0;
    }

    /// The mean gradient over the accumulated microbatches (what replicas average, with
    /// weight [`Stage::accumulated`]).
    pub fn mean_grads(&self) -> Vec<f32> {
        let s = 1.0 / self.accumulated.max(1) as f32;
        self.grads.iter().map(|g| g * s).collect()
    }

    /// Replaces the accumulator with an aggregated mean gradient (e.g. the weighted average
    /// of the replicas' [`Stage::mean_grads`]); the next [`Stage::step`] applies it as is.
    pub fn set_mean_grads(&mut self, mean: &[f32]) -> Result<(), ModelError> {
        self.check_len("gradients", mean.len())?;
        self.grads.copy_from_slice(mean);
        self.accumulated = 1;
        Ok(())
    }

    /// AdamW step with the mean of the accumulated gradients; then zeroes the accumulator.
    pub fn step(&mut self, opt: &AdamW) -> Result<(), ModelError> {
        if self.accumulated == 0 {
            return Err(ModelError::NothingAccumulated);
        }
        self.step += 1;
        let scale = 1.0 / self.accumulated as f32;
        for (t, r) in &self.tensors {
            adamw_update(
                &mut self.params[r.clone()],
                &self.grads[r.clone()],
                &mut self.m[r.clone()],
                &mut self.v[r.clone()],
                opt,
                self.step,
                scale,
                t.decay,
            );
        }
        self.zero_grad();
        Ok(())
    }

    fn check_len(&self, what: &'static str, got: usize) -> Result<(), ModelError> {
        if got != self.params.len() {
            return Err(ModelError::ShapeMismatch {
                what,
                expected: self.params.len(),
                got,
            });
        }
        Ok(())
    }

    /// Exchanges the parameters with `other` (same length): a swarm node runs
    /// a microbatch recomputed after its stage's update on the weights from
    /// before it, and swaps them back.
    pub fn swap_params(&mut self, other: &mut Vec<f32>) -> Result<(), ModelError> {
        self.check_len("parameters", other.len())?;
        std::mem::swap(&mut self.params, other);
        Ok(())
    }

    /// Replaces the parameters (e.g. with a weighted average of the replicas').
    pub fn import_params(&mut self, p: &[f32]) -> Result<(), ModelError> {
        self.check_len("parameters", p.len())?;
        self.params.copy_from_slice(p);
        Ok(())
    }

    /// Parameters as little-endian f32 bytes.
    pub fn export_params_bytes(&self) -> Vec<u8> {
        f32s_to_bytes(&self.params)
    }

    /// Inverse of [`Stage::export_params_bytes`].
    pub fn import_params_bytes(&mut self, b: &[u8]) -> Result<(), ModelError> {
        let p = bytes_to_f32s(b)?;
        self.import_params(&p)
    }

    /// Everything a joining replica downloads: parameters, AdamW moments and step count.
    /// Format: `"GWTFSTG1"`, u32 stage index, u64 step, u64 n, then n f32 params, n f32 m,
    /// n f32 v (all little-endian).
    pub fn export_state(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(28 + 12 * self.params.len());
        self.state_bytes_into(|piece| b.extend_from_slice(piece));
        b
    }

    /// [`Stage::export_state`]'s bytes, handed to `sink` a few KiB at a
    /// time from a buffer on the stack: a digest of the state needs no
    /// copy of it (a trainer that hashed a fresh export at every update
    /// allocated and filled three times its state's size each time).
    pub fn state_bytes_into(&self, sink: impl FnMut(&[u8])) {
        let vals = [&self.params[..], &self.m, &self.v];
        state_bytes_into(self.spec.index, self.step, vals, sink);
    }

    /// A copy of the parameters, AdamW moments and step count.
    pub fn state(&self) -> StageState {
        StageState {
            index: self.spec.index,
            step: self.step,
            params: self.params.clone(),
            m: self.m.clone(),
            v: self.v.clone(),
        }
    }

    /// Replaces the AdamW moments and step count only, keeping the
    /// parameters, the accumulated gradient and the activations held for
    /// backwards: the optimizer state that follows weights imported first.
    pub fn set_moments(&mut self, step: u64, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        for (what, got) in [("first moments", m.len()), ("second moments", v.len())] {
            if got != self.params.len() {
                return Err(ModelError::ShapeMismatch {
                    what,
                    expected: self.params.len(),
                    got,
                });
            }
        }
        self.m.copy_from_slice(m);
        self.v.copy_from_slice(v);
        self.step = step;
        Ok(())
    }

    /// Inverse of [`Stage::state`]: checked before any change; drops the gradient
    /// accumulator and any activations held.
    pub fn set_state(&mut self, st: &StageState) -> Result<(), ModelError> {
        st.check(self.spec.index, self.params.len())?;
        self.params.copy_from_slice(&st.params);
        self.m.copy_from_slice(&st.m);
        self.v.copy_from_slice(&st.v);
        self.step = st.step;
        self.saved.clear();
        self.zero_grad();
        Ok(())
    }

    /// Inverse of [`Stage::export_state`]; checked (magic, stage index, sizes) before any
    /// change.
    pub fn import_state(&mut self, b: &[u8]) -> Result<(), ModelError> {
        let parts = StateParts::parse(b, self.spec.index, self.params.len())?;
        self.params = bytes_to_f32s(parts.params)?;
        self.m = bytes_to_f32s(parts.m)?;
        self.v = bytes_to_f32s(parts.v)?;
        self.step = parts.step;
        Ok(())
    }
}

/// A stage state as [`Stage::export_state`] lays it out, borrowed, not
/// decoded: what a checkpoint writer needs to write a state it received
/// without copying it into a stage first.
#[derive(Clone, Copy, Debug)]
pub struct StateParts<'a> {
    pub index: usize,
    pub step: u64,
    /// Parameters, AdamW first and second moments: each `4 * n` bytes of
    /// little-endian f32.
    pub params: &'a [u8],
    pub m: &'a [u8],
    pub v: &'a [u8],
}

impl<'a> StateParts<'a> {
    /// Splits `b` (as [`Stage::export_state`] wrote it), checked whole
    /// against a stage `index` of `n` parameters.
    pub fn parse(b: &'a [u8], index: usize, n: usize) -> Result<StateParts<'a>, ModelError> {
        if b.len() as u64 != 28 + 12 * n as u64 || &b[..8] != STATE_MAGIC {
            return Err(ModelError::BadState(format!(
                "expected {} bytes with magic GWTFSTG1, got {}",
                28 + 12 * n as u64,
                b.len()
            )));
        }
        let idx = u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()) as usize;
        let step = u64::from_le_bytes(b[12..20].try_into().unwrap_or_default());
        let nn = u64::from_le_bytes(b[20..28].try_into().unwrap_or_default());
        if idx != index || nn != n as u64 {
            return Err(ModelError::BadState(format!(
                "state of stage {idx} with {nn} params, this is stage {index} with {n}"
            )));
        }
        let body = &b[28..];
        Ok(StateParts {
            index,
            step,
            params: &body[..4 * n],
            m: &body[4 * n..8 * n],
            v: &body[8 * n..],
        })
    }
}

/// f32 values as little-endian bytes.
/// `v` as little-endian bytes, handed to `sink` 16 KiB at a time from a
/// buffer on the stack (no copy of `v` allocated).
pub fn f32s_bytes_into(v: &[f32], mut sink: impl FnMut(&[u8])) {
    let mut buf = [0u8; 16 << 10];
    for chunk in v.chunks(buf.len() / 4) {
        for (o, x) in buf.chunks_exact_mut(4).zip(chunk) {
            o.copy_from_slice(&x.to_le_bytes());
        }
        sink(&buf[..4 * chunk.len()]);
    }
}

pub fn f32s_to_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 * v.len());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Little-endian bytes as f32 values (length must be a multiple of 4).
pub fn bytes_to_f32s(b: &[u8]) -> Result<Vec<f32>, ModelError> {
    if b.len() % 4 != 0 {
        return Err(ModelError::BadState(format!(
            "{} bytes is not a whole number of f32",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Weighted average of N replicas' buffers (gradients or parameters), weights = microbatches
/// each processed. See [`super::kernels::weighted_average`].
pub fn average_replicas(bufs: &[&[f32]], weights: &[f32]) -> Result<Vec<f32>, ModelError> {
    let n = bufs.first().map(|b| b.len()).unwrap_or(0);
    let mut out = vec![0.0; n];
    super::kernels::weighted_average(&mut out, bufs, weights)?;
    Ok(out)
}

// ------------------------------------------------------------------------------------------
// Blocks and head

fn lens(ts: &[TensorSpec]) -> Vec<usize> {
    ts.iter().map(|t| t.len).collect()
}

fn block_forward(
    cfg: &ModelConfig,
    p: &[f32],
    inp: Vec<f32>,
    b: usize,
    t: usize,
) -> (Vec<f32>, BlockActs) {
    let (c, nh, h) = (cfg.d_model, cfg.n_heads, cfg.ffn_hidden);
    let n = b * t;
    let ps = split(p, &lens(&block_tensors(cfg)));
    let mut a = BlockActs {
        n1: vec![0.0; n * c],
        ..Default::default()
    };
    let mut out = vec![0.0; n * c];
    let (qkv_w, qkv_b, attproj_w, attproj_b, fc_w, fc_b, fcproj_w, fcproj_b);
    match cfg.family {
        Family::Gpt => {
            a.n1_mean = vec![0.0; n];
            a.n1_rstd = vec![0.0; n];
            layernorm_forward(
                &mut a.n1,
                &mut a.n1_mean,
                &mut a.n1_rstd,
                &inp,
                ps[0],
                ps[1],
                c,
                cfg.norm_eps,
            );
            (qkv_w, qkv_b, attproj_w, attproj_b) = (ps[2], Some(ps[3]), ps[4], Some(ps[5]));
            (fc_w, fc_b, fcproj_w, fcproj_b) = (ps[8], Some(ps[9]), ps[10], Some(ps[11]));
        }
        Family::Llama => {
            a.n1_rstd = vec![0.0; n];
            rmsnorm_forward(&mut a.n1, &mut a.n1_rstd, &inp, ps[0], c, cfg.norm_eps);
            (qkv_w, qkv_b, attproj_w, attproj_b) = (ps[1], None, ps[2], None);
            (fc_w, fc_b, fcproj_w, fcproj_b) = (ps[4], None, ps[5], None);
        }
    }
    a.qkv = vec![0.0; n * 3 * c];
    matmul_forward(&mut a.qkv, &a.n1, qkv_w, qkv_b, n, c, 3 * c);
    if cfg.family == Family::Llama {
        let mut r = vec![0.0; n * 3 * c];
        rope_forward(&mut r, &a.qkv, t, 3 * c, 2 * nh, c / nh, cfg.rope_base);
        a.qkv = r;
    }
    a.att = vec![0.0; b * nh * t * t];
    a.atty = vec![0.0; n * c];
    attention_forward(&mut a.atty, &mut a.att, &a.qkv, b, t, c, nh);
    // res2 = inp + attproj(atty)
    a.res2 = vec![0.0; n * c];
    matmul_forward(&mut a.res2, &a.atty, attproj_w, attproj_b, n, c, c);
    add_inplace(&mut a.res2, &inp);
    a.n2 = vec![0.0; n * c];
    let fc_out = match cfg.family {
        Family::Gpt => {
            a.n2_mean = vec![0.0; n];
            a.n2_rstd = vec![0.0; n];
            layernorm_forward(
                &mut a.n2,
                &mut a.n2_mean,
                &mut a.n2_rstd,
                &a.res2,
                ps[6],
                ps[7],
                c,
                cfg.norm_eps,
            );
            h
        }
        Family::Llama => {
            a.n2_rstd = vec![0.0; n];
            rmsnorm_forward(&mut a.n2, &mut a.n2_rstd, &a.res2, ps[3], c, cfg.norm_eps);
            2 * h
        }
    };
    a.fch = vec![0.0; n * fc_out];
    matmul_forward(&mut a.fch, &a.n2, fc_w, fc_b, n, c, fc_out);
    a.fca = vec![0.0; n * h];
    match cfg.family {
        Family::Gpt => gelu_forward(&mut a.fca, &a.fch),
        Family::Llama => swiglu_forward(&mut a.fca, &a.fch, h),
    }
    matmul_forward(&mut out, &a.fca, fcproj_w, fcproj_b, n, h, c);
    add_inplace(&mut out, &a.res2);
    a.inp = inp;
    (out, a)
}

fn block_backward(
    cfg: &ModelConfig,
    p: &[f32],
    g: &mut [f32],
    a: &BlockActs,
    dout: &[f32],
    b: usize,
    t: usize,
) -> Vec<f32> {
    let (c, nh, h) = (cfg.d_model, cfg.n_heads, cfg.ffn_hidden);
    let n = b * t;
    let l = lens(&block_tensors(cfg));
    let ps = split(p, &l);
    let mut gs = split_mut(g, &l);
    let gpt = cfg.family == Family::Gpt;
    // Tensor indices per family.
    let (i_qkv, i_attproj, i_fc, i_fcproj) = if gpt { (2, 4, 8, 10) } else { (1, 2, 4, 5) };
    let fc_out = if gpt { h } else { 2 * h };
    let mut dres2 = dout.to_vec();
    // MLP: out = res2 + fcproj(act(fc(norm2(res2))))
    let mut dfca = vec![0.0; n * h];
    {
        let (gw, gb) = two(&mut gs, i_fcproj, gpt);
        matmul_backward(&mut dfca, gw, gb, dout, &a.fca, ps[i_fcproj], n, h, c);
    }
    let mut dfch = vec![0.0; n * fc_out];
    if gpt {
        gelu_backward(&mut dfch, &a.fch, &dfca);
    } else {
        swiglu_backward(&mut dfch, &a.fch, &dfca, h);
    }
    let mut dn2 = vec![0.0; n * c];
    {
        let (gw, gb) = two(&mut gs, i_fc, gpt);
        matmul_backward(&mut dn2, gw, gb, &dfch, &a.n2, ps[i_fc], n, c, fc_out);
    }
    if gpt {
        let (gw, gb) = two(&mut gs, 6, true);
        let gb = gb.unwrap_or_default();
        layernorm_backward(
            &mut dres2, gw, gb, &dn2, &a.res2, ps[6], &a.n2_mean, &a.n2_rstd, c,
        );
    } else {
        rmsnorm_backward(&mut dres2, gs[3], &dn2, &a.res2, ps[3], &a.n2_rstd, c);
    }
    // Attention: res2 = inp + attproj(attn(qkv(norm1(inp))))
    let mut dinp = dres2.clone();
    let mut datty = vec![0.0; n * c];
    {
        let (gw, gb) = two(&mut gs, i_attproj, gpt);
        matmul_backward(&mut datty, gw, gb, &dres2, &a.atty, ps[i_attproj], n, c, c);
    }
    let mut dqkv = vec![0.0; n * 3 * c];
    attention_backward(&mut dqkv, &datty, &a.qkv, &a.att, b, t, c, nh);
    if !gpt {
        let mut d = vec![0.0; n * 3 * c];
        rope_backward(&mut d, &dqkv, t, 3 * c, 2 * nh, c / nh, cfg.rope_base);
        dqkv = d;
    }
    let mut dn1 = vec![0.0; n * c];
    {
        let (gw, gb) = two(&mut gs, i_qkv, gpt);
        matmul_backward(&mut dn1, gw, gb, &dqkv, &a.n1, ps[i_qkv], n, c, 3 * c);
    }
    if gpt {
        let (gw, gb) = two(&mut gs, 0, true);
        let gb = gb.unwrap_or_default();
        layernorm_backward(
            &mut dinp, gw, gb, &dn1, &a.inp, ps[0], &a.n1_mean, &a.n1_rstd, c,
        );
    } else {
        rmsnorm_backward(&mut dinp, gs[0], &dn1, &a.inp, ps[0], &a.n1_rstd, c);
    }
    dinp
}

/// The gradient tensor `i` and, when `with_next`, tensor `i + 1` (its bias).
fn two<'a>(
    gs: &'a mut [&mut [f32]],
    i: usize,
    with_next: bool,
) -> (&'a mut [f32], Option<&'a mut [f32]>) {
    let (a, b) = gs[i..].split_at_mut(1);
    let w: &mut [f32] = a[0];
    let bias = if with_next { Some(&mut *b[0]) } else { None };
    (w, bias)
}

fn head_forward(cfg: &ModelConfig, p: &[f32], inp: Vec<f32>, targets: &[u32]) -> (f32, HeadActs) {
    let (c, v) = (cfg.d_model, cfg.vocab_size);
    let n = inp.len() / c;
    let ps = split(p, &lens(&head_tensors(cfg)));
    let mut norm = vec![0.0; n * c];
    let mut mean = Vec::new();
    let mut rstd = vec![0.0; n];
    let w_head = match cfg.family {
        Family::Gpt => {
            mean = vec![0.0; n];
            layernorm_forward(
                &mut norm,
                &mut mean,
                &mut rstd,
                &inp,
                ps[0],
                ps[1],
                c,
                cfg.norm_eps,
            );
            ps[2]
        }
        Family::Llama => {
            rmsnorm_forward(&mut norm, &mut rstd, &inp, ps[0], c, cfg.norm_eps);
            ps[1]
        }
    };
    let mut logits = vec![0.0; n * v];
    matmul_forward(&mut logits, &norm, w_head, None, n, c, v);
    let mut probs = vec![0.0; n * v];
    let loss = crossentropy_forward(&mut probs, &logits, targets, v);
    (
        loss as f32,
        HeadActs {
            inp,
            norm,
            mean,
            rstd,
            probs,
            targets: targets.to_vec(),
        },
    )
}

fn head_backward(cfg: &ModelConfig, p: &[f32], g: &mut [f32], a: &HeadActs) -> Vec<f32> {
    let (c, v) = (cfg.d_model, cfg.vocab_size);
    let n = a.targets.len();
    let l = lens(&head_tensors(cfg));
    let ps = split(p, &l);
    let mut gs = split_mut(g, &l);
    let mut dlogits = vec![0.0; n * v];
    crossentropy_backward(&mut dlogits, &a.probs, &a.targets, v, 1.0);
    let mut dnorm = vec![0.0; n * c];
    let ih = gs.len() - 1;
    matmul_backward(&mut dnorm, gs[ih], None, &dlogits, &a.norm, ps[ih], n, c, v);
    let mut dx = vec![0.0; n * c];
    match cfg.family {
        Family::Gpt => {
            let (gw, gb) = two(&mut gs, 0, true);
            let gb = gb.unwrap_or_default();
            layernorm_backward(&mut dx, gw, gb, &dnorm, &a.inp, ps[0], &a.mean, &a.rstd, c);
        }
        Family::Llama => rmsnorm_backward(&mut dx, gs[0], &dnorm, &a.inp, ps[0], &a.rstd, c),
    }
    dx
}
