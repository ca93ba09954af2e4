//! [`DeviceStage`]: a pipeline stage whose parameters, gradients, AdamW state and
//! activations live in a [`Backend`]'s memory. It mirrors [`crate::model::Stage`] op for
//! op (same tensors, same initialisation, same order of operations), so on the
//! [`super::HostBackend`] it computes exactly what the CPU stage computes.
use super::backend::{Backend, DPtr, DeviceBuffer};
use crate::model::config::{block_tensors, head_tensors, Family, ModelConfig, StageSpec};
use crate::model::config::{StagePlan, TensorSpec};
use crate::model::kernels::AdamW;
use crate::model::stage::{check_tokens, Layout, MicrobatchId, StageState};
use crate::model::ModelError;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// Token ids or targets in a backend's memory, all checked `< bound` on the host before
/// the upload (the kernels index tables with them). A view of a shared buffer: cheap to
/// clone and to cut, and the buffer lives as long as any view does.
pub struct DeviceIds<B: Backend> {
    buf: Arc<B::Ids>,
    start: usize,
    len: usize,
    bound: usize,
}

impl<B: Backend> Clone for DeviceIds<B> {
    fn clone(&self) -> Self {
        DeviceIds {
            buf: self.buf.clone(),
            start: self.start,
            len: self.len,
            bound: self.bound,
        }
    }
}

impl<B: Backend> DeviceIds<B> {
    /// Checks that every id is `< bound`, then uploads them.
    pub fn upload(backend: &B, ids: &[u32], bound: usize) -> Result<Self, ModelError> {
        check_tokens("ids", ids, ids.len(), bound)?;
        Ok(DeviceIds {
            buf: Arc::new(backend.upload_ids(ids)?),
            start: 0,
            len: ids.len(),
            bound,
        })
    }
    /// Number of ids.
    pub fn len(&self) -> usize {
        self.len
    }
    /// No ids.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Every id is below this.
    pub fn bound(&self) -> usize {
        self.bound
    }
    /// Ids `start..start + len` of this view.
    pub fn slice(&self, start: usize, len: usize) -> Result<Self, ModelError> {
        self.ptr().sub(start, len)?;
        Ok(DeviceIds {
            buf: self.buf.clone(),
            start: self.start + start,
            len,
            bound: self.bound,
        })
    }
    fn ptr(&self) -> DPtr<u32> {
        // SAFETY: start + len <= the buffer's length (checked when the view was cut).
        unsafe { DPtr::from_raw(self.buf.ptr().addr() + (4 * self.start) as u64, self.len) }
    }
}

/// What a device stage's forward takes.
pub enum DeviceInput<B: Backend> {
    /// `[batch * seq]` token ids (stage 0 only).
    Tokens(DeviceIds<B>),
    /// `[batch, seq, d_model]` activations (every other stage); the stage keeps them for
    /// its backward.
    Hidden(B::Buf),
}

/// What a device stage's forward returns.
pub enum DeviceOutput<B: Backend> {
    /// Activations `[batch, seq, d_model]` for the next stage.
    Hidden(B::Buf),
    /// The loss of each of the `batch * seq` positions (last stage); their mean is the
    /// microbatch's loss.
    Loss(B::Buf),
}

struct BlockActs<B: Backend> {
    inp: B::Buf,
    n1: B::Buf,
    n1_mean: Option<B::Buf>,
    n1_rstd: B::Buf,
    qkv: B::Buf, // after RoPE for LLaMA
    att: B::Buf,
    atty: B::Buf,
    res2: B::Buf,
    n2: B::Buf,
    n2_mean: Option<B::Buf>,
    n2_rstd: B::Buf,
    fch: B::Buf,
    fca: B::Buf,
}

struct HeadActs<B: Backend> {
    inp: B::Buf,
    norm: B::Buf,
    mean: Option<B::Buf>,
    rstd: B::Buf,
    probs: B::Buf,
    targets: DeviceIds<B>,
}

struct Saved<B: Backend> {
    batch: usize,
    seq: usize,
    tokens: Option<DeviceIds<B>>,
    blocks: Vec<BlockActs<B>>,
    head: Option<HeadActs<B>>,
}

/// Indices of a block's tensors in [`block_tensors`] order (a bias follows its weight).
struct BlockIdx {
    norm1: usize,
    qkv: usize,
    attproj: usize,
    norm2: usize,
    fc: usize,
    fcproj: usize,
    bias: bool,
}

impl BlockIdx {
    fn of(f: Family) -> BlockIdx {
        match f {
            // ln1_w ln1_b qkv_w qkv_b attproj_w attproj_b ln2_w ln2_b fc_w fc_b fcproj_w fcproj_b
            Family::Gpt => BlockIdx {
                norm1: 0,
                qkv: 2,
                attproj: 4,
                norm2: 6,
                fc: 8,
                fcproj: 10,
                bias: true,
            },
            // rms1_w qkv_w attproj_w rms2_w fc_w fcproj_w
            Family::Llama => BlockIdx {
                norm1: 0,
                qkv: 1,
                attproj: 2,
                norm2: 3,
                fc: 4,
                fcproj: 5,
                bias: false,
            },
        }
    }
    /// The bias of the linear layer whose weight is tensor `i` (GPT only).
    fn bias(&self, t: &[DPtr<f32>], i: usize) -> Option<DPtr<f32>> {
        self.bias.then(|| t[i + 1])
    }
}

/// The tensors of `r` (a range of the flat buffer at `p`), cut at the lengths of `specs`.
fn tensors(
    p: DPtr<f32>,
    r: &Range<usize>,
    specs: &[TensorSpec],
) -> Result<Vec<DPtr<f32>>, ModelError> {
    let mut v = Vec::with_capacity(specs.len());
    let mut off = r.start;
    for t in specs {
        v.push(p.sub(off, t.len)?);
        off += t.len;
    }
    if off != r.end {
        return Err(ModelError::InvalidConfig(format!(
            "tensors end at {off}, their range at {}",
            r.end
        )));
    }
    Ok(v)
}

/// One pipeline stage on a [`Backend`]: the device twin of [`crate::model::Stage`].
///
/// The activations, gradients and ids given to a stage must come from the backend it
/// was created on (a single-device process has one backend; the pipeline and the
/// trainer pass them along for you).
pub struct DeviceStage<B: Backend> {
    backend: Arc<B>,
    layout: Layout,
    params: B::Buf,
    grads: B::Buf,
    m: B::Buf,
    v: B::Buf,
    saved: HashMap<MicrobatchId, Saved<B>>,
    accumulated: u64,
    step: u64,
}

impl<B: Backend> DeviceStage<B> {
    /// Stage `index` of `plan`, initialised from `seed` exactly as [`crate::model::Stage::new`]
    /// (the parameters are generated on the host by the same code and uploaded).
    pub fn new(
        backend: Arc<B>,
        cfg: &ModelConfig,
        plan: &StagePlan,
        index: usize,
        seed: u64,
    ) -> Result<Self, ModelError> {
        let layout = Layout::new(cfg, plan, index)?;
        let params = backend.upload(&layout.init_params(seed))?;
        let n = layout.num_params();
        Ok(DeviceStage {
            grads: backend.zeros(n)?,
            m: backend.zeros(n)?,
            v: backend.zeros(n)?,
            params,
            backend,
            layout,
            saved: HashMap::new(),
            accumulated: 0,
            step: 0,
        })
    }

    /// All stages of a plan.
    pub fn all(
        backend: &Arc<B>,
        cfg: &ModelConfig,
        plan: &StagePlan,
        seed: u64,
    ) -> Result<Vec<Self>, ModelError> {
        (0..plan.len())
            .map(|i| DeviceStage::new(backend.clone(), cfg, plan, i, seed))
            .collect()
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }
    /// The config (with `n_stages` set to the plan's).
    pub fn config(&self) -> &ModelConfig {
        &self.layout.cfg
    }
    /// What this stage holds.
    pub fn spec(&self) -> &StageSpec {
        &self.layout.spec
    }
    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.layout.num_params()
    }
    /// The parameter tensors and their ranges in the flat buffers.
    pub fn tensors(&self) -> &[(TensorSpec, Range<usize>)] {
        &self.layout.tensors
    }
    /// Microbatches accumulated since the last step.
    pub fn accumulated(&self) -> u64 {
        self.accumulated
    }
    /// Optimizer steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }
    /// Microbatches whose forward ran and whose backward has not.
    pub fn in_flight(&self) -> usize {
        self.saved.len()
    }
    /// The parameters, copied to the host (waits for the queued work).
    pub fn params_to_host(&self) -> Result<Vec<f32>, ModelError> {
        self.backend.download_buf(&self.params)
    }
    /// The accumulated gradients (the sum over microbatches, as [`crate::model::Stage::grads`]),
    /// copied to the host.
    pub fn grads_to_host(&self) -> Result<Vec<f32>, ModelError> {
        self.backend.download_buf(&self.grads)
    }

    /// Parameters, AdamW moments and step count, copied to the host (as
    /// [`crate::model::Stage::state`]).
    pub fn state(&self) -> Result<StageState, ModelError> {
        Ok(StageState {
            index: self.layout.spec.index,
            step: self.step,
            params: self.backend.download_buf(&self.params)?,
            m: self.backend.download_buf(&self.m)?,
            v: self.backend.download_buf(&self.v)?,
        })
    }

    /// Inverse of [`DeviceStage::state`] (as [`crate::model::Stage::set_state`]): checked
    /// before any change, then uploaded.
    pub fn set_state(&mut self, st: &StageState) -> Result<(), ModelError> {
        st.check(self.layout.spec.index, self.layout.num_params())?;
        let (p, m, v) = (
            self.backend.upload(&st.params)?,
            self.backend.upload(&st.m)?,
            self.backend.upload(&st.v)?,
        );
        (self.params, self.m, self.v) = (p, m, v);
        self.step = st.step;
        self.saved.clear();
        self.zero_grad()
    }

    /// Forward pass of microbatch `mb`, with the checks and meaning of
    /// [`crate::model::Stage::forward`]; the work is queued on the backend.
    pub fn forward(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        input: DeviceInput<B>,
        targets: Option<DeviceIds<B>>,
    ) -> Result<DeviceOutput<B>, ModelError> {
        let cfg = &self.layout.cfg;
        if self.saved.contains_key(&mb) {
            return Err(ModelError::DuplicateMicrobatch(mb));
        }
        let n = self.layout.spec.check_microbatch(cfg, batch, seq)?;
        let (c, v) = (cfg.d_model, cfg.vocab_size);
        let check_ids = |what: &'static str, ids: &DeviceIds<B>| {
            if ids.len() != n {
                return Err(ModelError::ShapeMismatch {
                    what,
                    expected: n,
                    got: ids.len(),
                });
            }
            if ids.bound() > v {
                return Err(ModelError::InvalidConfig(format!(
                    "{what} were checked against {} ids, the vocabulary has {v}",
                    ids.bound()
                )));
            }
            Ok(())
        };
        let be = &*self.backend;
        let mut saved = Saved {
            batch,
            seq,
            tokens: None,
            blocks: Vec::new(),
            head: None,
        };
        let mut x = match (self.layout.spec.embedding, input) {
            (true, DeviceInput::Tokens(tok)) => {
                check_ids("tokens", &tok)?;
                if self.layout.spec.head {
                    let t = targets.as_ref().ok_or(ModelError::MissingTargets)?;
                    check_ids("targets", t)?;
                }
                let p = self.params.ptr().sub(
                    self.layout.emb.start,
                    self.layout.emb.end - self.layout.emb.start,
                )?;
                let wte = p.sub(0, v * c)?;
                let wpe = match cfg.family {
                    Family::Gpt => Some(p.sub(v * c, cfg.max_seq * c)?),
                    Family::Llama => None,
                };
                let out = be.zeros(n * c)?;
                // SAFETY: every buffer is alive (owned here or borrowed) until queued; the
                // tokens are < vocab (checked above) = rows of wte.
                unsafe { be.encoder_forward(out.ptr(), tok.ptr(), wte, wpe, seq, c)? };
                saved.tokens = Some(tok);
                out
            }
            (false, DeviceInput::Hidden(h)) => {
                self.layout.spec.check_activations(cfg, n, h.len())?;
                if self.layout.spec.head {
                    let t = targets.as_ref().ok_or(ModelError::MissingTargets)?;
                    check_ids("targets", t)?;
                }
                h
            }
            (true, _) => return Err(ModelError::WrongInput("stage 0 takes token ids")),
            (false, _) => return Err(ModelError::WrongInput("this stage takes activations")),
        };
        let block_specs = block_tensors(cfg);
        for r in &self.layout.blocks {
            let p = tensors(self.params.ptr(), r, &block_specs)?;
            let (out, acts) = block_forward(be, cfg, &p, x, batch, seq)?;
            saved.blocks.push(acts);
            x = out;
        }
        let out = if self.layout.spec.head {
            let t = targets.ok_or(ModelError::MissingTargets)?;
            let p = tensors(self.params.ptr(), &self.layout.head, &head_tensors(cfg))?;
            let (losses, acts) = head_forward(be, cfg, &p, x, t)?;
            saved.head = Some(acts);
            DeviceOutput::Loss(losses)
        } else {
            DeviceOutput::Hidden(x)
        };
        self.saved.insert(mb, saved);
        Ok(out)
    }

    /// Backward pass of microbatch `mb`, with the checks and meaning of
    /// [`crate::model::Stage::backward`]: the last stage takes `None`, the others the
    /// gradient of their output; returns the gradient of the input (`None` for stage 0).
    pub fn backward(
        &mut self,
        mb: MicrobatchId,
        grad_output: Option<B::Buf>,
    ) -> Result<Option<B::Buf>, ModelError> {
        let cfg = &self.layout.cfg;
        let c = cfg.d_model;
        let sv = self
            .saved
            .get(&mb)
            .ok_or(ModelError::UnknownMicrobatch(mb))?;
        self.layout.spec.check_grad_output(
            cfg,
            sv.batch * sv.seq,
            grad_output.as_ref().map(|g| g.len()),
        )?;
        let sv = self
            .saved
            .remove(&mb)
            .ok_or(ModelError::UnknownMicrobatch(mb))?;
        let be = &*self.backend;
        let (params, grads) = (self.params.ptr(), self.grads.ptr());
        let mut dx = match (&sv.head, grad_output) {
            (Some(h), _) => {
                let specs = head_tensors(cfg);
                let p = tensors(params, &self.layout.head, &specs)?;
                let g = tensors(grads, &self.layout.head, &specs)?;
                head_backward(be, cfg, &p, &g, h)?
            }
            (None, Some(g)) => g,
            (None, None) => return Err(ModelError::MissingGradient),
        };
        let block_specs = block_tensors(cfg);
        for (r, acts) in self.layout.blocks.iter().zip(&sv.blocks).rev() {
            let p = tensors(params, r, &block_specs)?;
            let g = tensors(grads, r, &block_specs)?;
            dx = block_backward(be, cfg, &p, &g, acts, &dx, sv.batch, sv.seq)?;
        }
        self.accumulated += 1;
        if let Some(tok) = &sv.tokens {
            let v = cfg.vocab_size;
            let emb = &self.layout.emb;
            let g = grads.sub(emb.start, emb.end - emb.start)?;
            let dwte = g.sub(0, v * c)?;
            let dwpe = match cfg.family {
                Family::Gpt => Some(g.sub(v * c, cfg.max_seq * c)?),
                Family::Llama => None,
            };
            // SAFETY: all buffers alive; tokens < vocab (checked at forward).
            unsafe { be.encoder_backward(dwte, dwpe, dx.ptr(), tok.ptr(), sv.seq, c)? };
            Ok(None)
        } else {
            Ok(Some(dx))
        }
    }

    /// Drops the activations of `mb` without a backward. Returns whether it was held.
    pub fn discard(&mut self, mb: MicrobatchId) -> bool {
        self.saved.remove(&mb).is_some()
    }

    /// Takes the accumulated gradient out to the host; the accumulator starts again from
    /// zero (as [`crate::model::Stage::take_grads`]: a swarm node keeps each microbatch's
    /// gradient apart until its stage aggregates).
    pub fn take_grads(&mut self) -> Result<Vec<f32>, ModelError> {
        let g = self.backend.download_buf(&self.grads)?;
        self.zero_grad()?;
        Ok(g)
    }

    /// Replaces the accumulator with an aggregated mean gradient; the next
    /// [`DeviceStage::step`] applies it as is (as [`crate::model::Stage::set_mean_grads`]).
    pub fn set_mean_grads(&mut self, mean: &[f32]) -> Result<(), ModelError> {
        self.check_len("gradients", mean.len())?;
        self.grads = self.backend.upload(mean)?;
        self.accumulated = 1;
        Ok(())
    }

    /// Exchanges the parameters with the host values `other` (same length), as
    /// [`crate::model::Stage::swap_params`].
    /// [`crate::model::Stage::set_moments`]: the AdamW moments and step
    /// count only, checked, then uploaded.
    pub fn set_moments(&mut self, step: u64, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        self.check_len("first moments", m.len())?;
        self.check_len("second moments", v.len())?;
        let (m, v) = (self.backend.upload(m)?, self.backend.upload(v)?);
        (self.m, self.v) = (m, v);
        self.step = step;
        Ok(())
    }

    pub fn swap_params(&mut self, other: &mut Vec<f32>) -> Result<(), ModelError> {
        self.check_len("parameters", other.len())?;
        let held = self.backend.download_buf(&self.params)?;
        self.params = self.backend.upload(other)?;
        *other = held;
        Ok(())
    }

    fn check_len(&self, what: &'static str, got: usize) -> Result<(), ModelError> {
        let n = self.layout.num_params();
        if got != n {
            return Err(ModelError::ShapeMismatch {
                what,
                expected: n,
                got,
            });
        }
        Ok(())
    }

    /// Sets the accumulated gradient to zero.
    pub fn zero_grad(&mut self) -> Result<(), ModelError> {
        // SAFETY: the buffer is owned by this stage.
        unsafe { self.backend.fill_zero(self.grads.ptr())? };
        self.accumulated = 0;
        Ok(())
    }

    /// AdamW step with the mean of the accumulated gradients, then zeroes the accumulator
    /// (as [`crate::model::Stage::step`]).
    pub fn step(&mut self, opt: &AdamW) -> Result<(), ModelError> {
        if self.accumulated == 0 {
            return Err(ModelError::NothingAccumulated);
        }
        self.step += 1;
        let scale = 1.0 / self.accumulated as f32;
        let (p, g, m, v) = (
            self.params.ptr(),
            self.grads.ptr(),
            self.m.ptr(),
            self.v.ptr(),
        );
        for (t, r) in &self.layout.tensors {
            let (s, l) = (r.start, r.end - r.start);
            // SAFETY: the four buffers are owned by this stage.
            unsafe {
                self.backend.adamw(
                    p.sub(s, l)?,
                    g.sub(s, l)?,
                    m.sub(s, l)?,
                    v.sub(s, l)?,
                    opt,
                    self.step,
                    scale,
                    t.decay,
                )?
            };
        }
        self.zero_grad()
    }
}

// ------------------------------------------------------------------------------------------
// Blocks and head: the same sequence of ops as block_forward / block_backward /
// head_forward / head_backward in ../stage.rs.
//
// SAFETY (every `unsafe` block below): each DPtr is a tensor of the stage's parameter or
// gradient buffers, or a buffer created here or held in the saved activations; all of
// them outlive the queuing of the op, and a device frees them in stream order after it.

fn block_forward<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    p: &[DPtr<f32>],
    inp: B::Buf,
    b: usize,
    t: usize,
) -> Result<(B::Buf, BlockActs<B>), ModelError> {
    let (c, nh, h) = (cfg.d_model, cfg.n_heads, cfg.ffn_hidden);
    let n = b * t;
    let eps = cfg.norm_eps;
    let gpt = cfg.family == Family::Gpt;
    let ix = BlockIdx::of(cfg.family);
    let fc_out = if gpt { h } else { 2 * h };
    let n1 = be.zeros(n * c)?;
    let n1_rstd = be.zeros(n)?;
    let n1_mean = if gpt { Some(be.zeros(n)?) } else { None };
    let qkv_pre = be.zeros(n * 3 * c)?;
    let att = be.zeros(b * nh * t * t)?;
    let atty = be.zeros(n * c)?;
    let res2 = be.zeros(n * c)?;
    let n2 = be.zeros(n * c)?;
    let n2_rstd = be.zeros(n)?;
    let n2_mean = if gpt { Some(be.zeros(n)?) } else { None };
    let fch = be.zeros(n * fc_out)?;
    let fca = be.zeros(n * h)?;
    let out = be.zeros(n * c)?;
    unsafe {
        match &n1_mean {
            Some(mean) => be.layernorm_forward(
                n1.ptr(),
                mean.ptr(),
                n1_rstd.ptr(),
                inp.ptr(),
                p[ix.norm1],
                p[ix.norm1 + 1],
                c,
                eps,
            )?,
            None => be.rmsnorm_forward(n1.ptr(), n1_rstd.ptr(), inp.ptr(), p[ix.norm1], c, eps)?,
        }
        be.matmul_forward(
            qkv_pre.ptr(),
            n1.ptr(),
            p[ix.qkv],
            ix.bias(p, ix.qkv),
            n,
            c,
            3 * c,
        )?;
    }
    let qkv = if gpt {
        qkv_pre
    } else {
        let r = be.zeros(n * 3 * c)?;
        unsafe {
            be.rope_forward(
                r.ptr(),
                qkv_pre.ptr(),
                t,
                3 * c,
                2 * nh,
                c / nh,
                cfg.rope_base,
            )?
        };
        r
    };
    unsafe {
        be.attention_forward(atty.ptr(), att.ptr(), qkv.ptr(), b, t, c, nh)?;
        // res2 = inp + attproj(atty)
        be.matmul_forward(
            res2.ptr(),
            atty.ptr(),
            p[ix.attproj],
            ix.bias(p, ix.attproj),
            n,
            c,
            c,
        )?;
        be.add_inplace(res2.ptr(), inp.ptr())?;
        match &n2_mean {
            Some(mean) => be.layernorm_forward(
                n2.ptr(),
                mean.ptr(),
                n2_rstd.ptr(),
                res2.ptr(),
                p[ix.norm2],
                p[ix.norm2 + 1],
                c,
                eps,
            )?,
            None => be.rmsnorm_forward(n2.ptr(), n2_rstd.ptr(), res2.ptr(), p[ix.norm2], c, eps)?,
        }
        be.matmul_forward(
            fch.ptr(),
            n2.ptr(),
            p[ix.fc],
            ix.bias(p, ix.fc),
            n,
            c,
            fc_out,
        )?;
        if gpt {
            be.gelu_forward(fca.ptr(), fch.ptr())?;
        } else {
            be.swiglu_forward(fca.ptr(), fch.ptr(), h)?;
        }
        be.matmul_forward(
            out.ptr(),
            fca.ptr(),
            p[ix.fcproj],
            ix.bias(p, ix.fcproj),
            n,
            h,
            c,
        )?;
        be.add_inplace(out.ptr(), res2.ptr())?;
    }
    Ok((
        out,
        BlockActs {
            inp,
            n1,
            n1_mean,
            n1_rstd,
            qkv,
            att,
            atty,
            res2,
            n2,
            n2_mean,
            n2_rstd,
            fch,
            fca,
        },
    ))
}

#[allow(clippy::too_many_arguments)]
fn block_backward<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    p: &[DPtr<f32>],
    g: &[DPtr<f32>],
    a: &BlockActs<B>,
    dout: &B::Buf,
    b: usize,
    t: usize,
) -> Result<B::Buf, ModelError> {
    let (c, nh, h) = (cfg.d_model, cfg.n_heads, cfg.ffn_hidden);
    let n = b * t;
    let gpt = cfg.family == Family::Gpt;
    let ix = BlockIdx::of(cfg.family);
    let fc_out = if gpt { h } else { 2 * h };
    let dres2 = be.zeros(n * c)?;
    let dfca = be.zeros(n * h)?;
    let dfch = be.zeros(n * fc_out)?;
    let dn2 = be.zeros(n * c)?;
    let dinp = be.zeros(n * c)?;
    let datty = be.zeros(n * c)?;
    let dqkv_post = be.zeros(n * 3 * c)?;
    let dn1 = be.zeros(n * c)?;
    unsafe {
        be.copy(dres2.ptr(), dout.ptr())?;
        // MLP: out = res2 + fcproj(act(fc(norm2(res2))))
        be.matmul_backward(
            dfca.ptr(),
            g[ix.fcproj],
            ix.bias(g, ix.fcproj),
            dout.ptr(),
            a.fca.ptr(),
            p[ix.fcproj],
            n,
            h,
            c,
        )?;
        if gpt {
            be.gelu_backward(dfch.ptr(), a.fch.ptr(), dfca.ptr())?;
        } else {
            be.swiglu_backward(dfch.ptr(), a.fch.ptr(), dfca.ptr(), h)?;
        }
        be.matmul_backward(
            dn2.ptr(),
            g[ix.fc],
            ix.bias(g, ix.fc),
            dfch.ptr(),
            a.n2.ptr(),
            p[ix.fc],
            n,
            c,
            fc_out,
        )?;
        match &a.n2_mean {
            Some(mean) => be.layernorm_backward(
                dres2.ptr(),
                g[ix.norm2],
                g[ix.norm2 + 1],
                dn2.ptr(),
                a.res2.ptr(),
                p[ix.norm2],
                mean.ptr(),
                a.n2_rstd.ptr(),
                c,
            )?,
            None => be.rmsnorm_backward(
                dres2.ptr(),
                g[ix.norm2],
                dn2.ptr(),
                a.res2.ptr(),
                p[ix.norm2],
                a.n2_rstd.ptr(),
                c,
            )?,
        }
        // Attention: res2 = inp + attproj(attn(qkv(norm1(inp))))
        be.copy(dinp.ptr(), dres2.ptr())?;
        be.matmul_backward(
            datty.ptr(),
            g[ix.attproj],
            ix.bias(g, ix.attproj),
            dres2.ptr(),
            a.atty.ptr(),
            p[ix.attproj],
            n,
            c,
            c,
        )?;
        be.attention_backward(
            dqkv_post.ptr(),
            datty.ptr(),
            a.qkv.ptr(),
            a.att.ptr(),
            b,
            t,
            c,
            nh,
        )?;
    }
    let dqkv = if gpt {
        dqkv_post
    } else {
        let d = be.zeros(n * 3 * c)?;
        unsafe {
            be.rope_backward(
                d.ptr(),
                dqkv_post.ptr(),
                t,
                3 * c,
                2 * nh,
                c / nh,
                cfg.rope_base,
            )?
        };
        d
    };
    unsafe {
        be.matmul_backward(
            dn1.ptr(),
            g[ix.qkv],
            ix.bias(g, ix.qkv),
            dqkv.ptr(),
            a.n1.ptr(),
            p[ix.qkv],
            n,
            c,
            3 * c,
        )?;
        match &a.n1_mean {
            Some(mean) => be.layernorm_backward(
                dinp.ptr(),
                g[ix.norm1],
                g[ix.norm1 + 1],
                dn1.ptr(),
                a.inp.ptr(),
                p[ix.norm1],
                mean.ptr(),
                a.n1_rstd.ptr(),
                c,
            )?,
            None => be.rmsnorm_backward(
                dinp.ptr(),
                g[ix.norm1],
                dn1.ptr(),
                a.inp.ptr(),
                p[ix.norm1],
                a.n1_rstd.ptr(),
                c,
            )?,
        }
    }
    Ok(dinp)
}

fn head_forward<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    p: &[DPtr<f32>],
    inp: B::Buf,
    targets: DeviceIds<B>,
) -> Result<(B::Buf, HeadActs<B>), ModelError> {
    let (c, v) = (cfg.d_model, cfg.vocab_size);
    let n = targets.len();
    let norm = be.zeros(n * c)?;
    let rstd = be.zeros(n)?;
    let logits = be.zeros(n * v)?;
    let probs = be.zeros(n * v)?;
    let losses = be.zeros(n)?;
    let mut mean = None;
    // The head's tensors: lnf_w [lnf_b] lm_head.
    let w_head = p[p.len() - 1];
    unsafe {
        match cfg.family {
            Family::Gpt => {
                let m = be.zeros(n)?;
                be.layernorm_forward(
                    norm.ptr(),
                    m.ptr(),
                    rstd.ptr(),
                    inp.ptr(),
                    p[0],
                    p[1],
                    c,
                    cfg.norm_eps,
                )?;
                mean = Some(m);
            }
            Family::Llama => {
                be.rmsnorm_forward(norm.ptr(), rstd.ptr(), inp.ptr(), p[0], c, cfg.norm_eps)?
            }
        }
        be.matmul_forward(logits.ptr(), norm.ptr(), w_head, None, n, c, v)?;
        // Targets < vocab: checked by the caller (DeviceIds bound <= vocab).
        be.crossentropy_forward(probs.ptr(), losses.ptr(), logits.ptr(), targets.ptr(), v)?;
    }
    Ok((
        losses,
        HeadActs {
            inp,
            norm,
            mean,
            rstd,
            probs,
            targets,
        },
    ))
}

fn head_backward<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    p: &[DPtr<f32>],
    g: &[DPtr<f32>],
    a: &HeadActs<B>,
) -> Result<B::Buf, ModelError> {
    let (c, v) = (cfg.d_model, cfg.vocab_size);
    let n = a.targets.len();
    let dlogits = be.zeros(n * v)?;
    let dnorm = be.zeros(n * c)?;
    let dx = be.zeros(n * c)?;
    let ih = p.len() - 1;
    unsafe {
        be.crossentropy_backward(dlogits.ptr(), a.probs.ptr(), a.targets.ptr(), v, 1.0)?;
        be.matmul_backward(
            dnorm.ptr(),
            g[ih],
            None,
            dlogits.ptr(),
            a.norm.ptr(),
            p[ih],
            n,
            c,
            v,
        )?;
        match &a.mean {
            Some(mean) => be.layernorm_backward(
                dx.ptr(),
                g[0],
                g[1],
                dnorm.ptr(),
                a.inp.ptr(),
                p[0],
                mean.ptr(),
                a.rstd.ptr(),
                c,
            )?,
            None => be.rmsnorm_backward(
                dx.ptr(),
                g[0],
                dnorm.ptr(),
                a.inp.ptr(),
                p[0],
                a.rstd.ptr(),
                c,
            )?,
        }
    }
    Ok(dx)
}
