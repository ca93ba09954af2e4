//! The reference models on a device: [`DeviceStage`] (the device twin of
//! [`crate::model::Stage`]), [`DevicePipeline`] and [`train_gpu`] (`gwtf train --device cuda`).
//!
//! Parameters, gradients, AdamW moments and activations live in a [`Backend`]'s memory and
//! never leave it during training: per optimizer step the token and target ids go up in
//! one upload and the losses come back in one download. The backends:
//! - [`KernelBackend`]: matrix multiplies as column-major sgemm calls, every other op
//!   (norms, GELU, SwiGLU, RoPE, attention, cross-entropy, residual adds, biases,
//!   embedding, AdamW) through our kernels in `src/cuda/kernels/`, on a [`KernelRunner`].
//!   [`CudaBackend`] (with the `cuda` feature) is the one on a CUDA device: NVRTC modules
//!   and cuBLAS. The tests also run it on a CPU emulation of the device
//!   (tests/cuda_emulated.rs).
//! - [`HostBackend`]: the same ops on the CPU (the kernels' twins in `ops.rs`), so that the
//!   device stage's bookkeeping is tested on any machine, against the CPU
//!   [`crate::model::Stage`].
//!
//! Same stage split, same initialisation (generated on the host by the CPU code, then
//! uploaded) and same training loop as the CPU trainer.
mod backend;
#[cfg(feature = "cuda")]
mod cuda;
mod host;
mod kernel;
mod stage;

pub use backend::{Backend, DPtr, DeviceBuffer};
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaRunner};
pub use host::{HostBackend, HostBuf};
pub use kernel::{KernelBackend, KernelBuf, KernelRunner};
pub use stage::{DeviceIds, DeviceInput, DeviceOutput, DeviceStage};

use super::config::{ModelConfig, StagePlan};
use super::dataset::{DataSource, Dataset};
use super::kernels::AdamW;
use super::stage::{MicrobatchId, StageState};
use super::train::{check_options, check_state_count, StepLog, TrainModel, TrainOptions, Trainer};
use super::ModelError;
use std::sync::Arc;

/// All stages of a model on one backend, run in sequence (the device twin of
/// [`crate::model::Pipeline`]).
pub struct DevicePipeline<B: Backend> {
    backend: Arc<B>,
    /// The stages, in order.
    pub stages: Vec<DeviceStage<B>>,
    next_mb: MicrobatchId,
}

impl<B: Backend> DevicePipeline<B> {
    /// The model `cfg` cut into `n_stages` stages, initialised from `seed` (the same
    /// parameters as [`crate::model::Pipeline::new`]).
    pub fn new(
        backend: Arc<B>,
        cfg: &ModelConfig,
        n_stages: usize,
        seed: u64,
    ) -> Result<Self, ModelError> {
        let plan = StagePlan::new(cfg, n_stages)?;
        Ok(DevicePipeline {
            stages: DeviceStage::all(&backend, cfg, &plan, seed)?,
            backend,
            next_mb: 0,
        })
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Total parameters.
    pub fn num_params(&self) -> usize {
        self.stages.iter().map(|s| s.num_params()).sum()
    }

    /// Forward and backward of every microbatch (pairs of token and target ids,
    /// `batch * seq` each) through every stage; the gradients are accumulated in the
    /// stages. Returns each microbatch's mean loss (waits for the device).
    pub fn forward_backward(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
    ) -> Result<Vec<f32>, ModelError> {
        let losses = self.queue_microbatches(batch, seq, microbatches, true)?;
        self.mean_losses(&losses, microbatches.len())
    }

    /// AdamW step on every stage.
    pub fn step(&mut self, opt: &AdamW) -> Result<(), ModelError> {
        self.stages.iter_mut().try_for_each(|s| s.step(opt))
    }

    /// One optimizer step: [`DevicePipeline::forward_backward`] of the microbatches, then
    /// AdamW, all queued before the one wait for the losses.
    pub fn train_step(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
        opt: &AdamW,
    ) -> Result<Vec<f32>, ModelError> {
        let losses = self.queue_microbatches(batch, seq, microbatches, true)?;
        self.step(opt)?;
        self.mean_losses(&losses, microbatches.len())
    }

    /// Each microbatch's mean loss, forward only: no gradient is accumulated and the
    /// activations are dropped (the held-out evaluation).
    pub fn eval_losses(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
    ) -> Result<Vec<f32>, ModelError> {
        let losses = self.queue_microbatches(batch, seq, microbatches, false)?;
        self.mean_losses(&losses, microbatches.len())
    }

    /// Every stage's parameters, AdamW moments and step count, on the host.
    pub fn states(&self) -> Result<Vec<StageState>, ModelError> {
        self.stages.iter().map(|s| s.state()).collect()
    }

    /// Replaces every stage's state (checked against each stage before it is uploaded).
    pub fn set_states(&mut self, states: &[StageState]) -> Result<(), ModelError> {
        check_state_count(self.stages.len(), states.len())?;
        for (s, st) in self.stages.iter_mut().zip(states) {
            s.set_state(st)?;
        }
        Ok(())
    }

    /// All parameters, stage after stage, on the host.
    pub fn params_flat(&self) -> Result<Vec<f32>, ModelError> {
        let mut v = Vec::with_capacity(self.num_params());
        for s in &self.stages {
            v.extend(s.params_to_host()?);
        }
        Ok(v)
    }

    /// All accumulated gradients, stage after stage, on the host.
    pub fn grads_flat(&self) -> Result<Vec<f32>, ModelError> {
        let mut v = Vec::with_capacity(self.num_params());
        for s in &self.stages {
            v.extend(s.grads_to_host()?);
        }
        Ok(v)
    }

    /// Queues forward and (when `train`) backward of the microbatches; returns the
    /// per-position losses, microbatch after microbatch (`len * batch * seq`).
    fn queue_microbatches(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
        train: bool,
    ) -> Result<B::Buf, ModelError> {
        let k = microbatches.len();
        let n = batch * seq;
        if k == 0 || n == 0 {
            return Err(ModelError::InvalidConfig(format!(
                "{k} microbatches of {batch} x {seq}"
            )));
        }
        let cfg = self.stages[0].config().clone();
        // One upload: all tokens, then all targets, each checked < vocab.
        let mut ids = Vec::with_capacity(2 * k * n);
        for (what, pick) in [("tokens", 0), ("targets", 1)] {
            for (x, y) in microbatches {
                let part = if pick == 0 { x } else { y };
                if part.len() != n {
                    return Err(ModelError::ShapeMismatch {
                        what,
                        expected: n,
                        got: part.len(),
                    });
                }
                ids.extend_from_slice(part);
            }
        }
        let ids = DeviceIds::upload(&*self.backend, &ids, cfg.vocab_size)?;
        let losses = self.backend.zeros(k * n)?;
        for i in 0..k {
            let mb = self.next_mb;
            self.next_mb += 1;
            let r = self.one_microbatch(mb, batch, seq, &ids, i, k, losses.ptr(), train);
            if r.is_err() || !train {
                for s in &mut self.stages {
                    s.discard(mb);
                }
            }
            r?;
        }
        Ok(losses)
    }

    #[allow(clippy::too_many_arguments)]
    fn one_microbatch(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        ids: &DeviceIds<B>,
        i: usize,
        k: usize,
        losses: DPtr<f32>,
        train: bool,
    ) -> Result<(), ModelError> {
        let n = batch * seq;
        let last = self.stages.len() - 1;
        let mut input = DeviceInput::Tokens(ids.slice(i * n, n)?);
        for (si, s) in self.stages.iter_mut().enumerate() {
            let targets = (si == last)
                .then(|| ids.slice((k + i) * n, n))
                .transpose()?;
            match s.forward(mb, batch, seq, input, targets)? {
                DeviceOutput::Hidden(h) => input = DeviceInput::Hidden(h),
                DeviceOutput::Loss(rows) => {
                    // SAFETY: `losses` is the live buffer of queue_microbatches (k * n
                    // values); `rows` is alive until the copy is queued.
                    unsafe { self.backend.copy(losses.sub(i * n, n)?, rows.ptr())? };
                    break;
                }
            }
        }
        if !train {
            return Ok(());
        }
        let mut g: Option<B::Buf> = None;
        for s in self.stages.iter_mut().rev() {
            g = s.backward(mb, g)?;
        }
        Ok(())
    }

    /// Waits for the device, downloads the per-position losses and averages each
    /// microbatch's (in f64, as the CPU's cross-entropy does).
    fn mean_losses(&self, losses: &B::Buf, k: usize) -> Result<Vec<f32>, ModelError> {
        let rows = self.backend.download_buf(losses)?;
        let n = rows.len() / k.max(1);
        Ok(rows
            .chunks(n.max(1))
            .map(|c| (c.iter().map(|&x| x as f64).sum::<f64>() / c.len() as f64) as f32)
            .collect())
    }
}

impl<B: Backend> TrainModel for DevicePipeline<B> {
    fn train_step(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
        opt: &AdamW,
    ) -> Result<Vec<f32>, ModelError> {
        DevicePipeline::train_step(self, batch, seq, microbatches, opt)
    }

    fn eval_losses(
        &mut self,
        batch: usize,
        seq: usize,
        microbatches: &[(Vec<u32>, Vec<u32>)],
    ) -> Result<Vec<f32>, ModelError> {
        DevicePipeline::eval_losses(self, batch, seq, microbatches)
    }

    fn stage_states(&self) -> Result<Vec<StageState>, ModelError> {
        self.states()
    }

    fn set_stage_states(&mut self, states: &[StageState]) -> Result<(), ModelError> {
        self.set_states(states)
    }
}

/// [`crate::model::train::train`] on `backend`: same checks, corpus, sampler, schedule and
/// logs; one upload of ids and one download of losses per step.
pub fn train_on<B: Backend>(
    backend: Arc<B>,
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
    let p = DevicePipeline::new(backend, cfg, o.stages, o.seed)?;
    Trainer::new(p, o.clone(), data)?.run(o.steps, on_step)
}

/// Opens CUDA device 0 for training: the probe, NVRTC compilation and cuBLAS. Without a
/// usable device (no driver, no GPU, no cuBLAS, or a build without CUDA) this is
/// [`ModelError::DeviceUnavailable`] with the probe's explanation.
#[cfg(feature = "cuda")]
pub fn open_cuda() -> Result<Arc<CudaBackend>, ModelError> {
    Ok(Arc::new(CudaBackend::new(0)?))
}

/// Trains `cfg` on CUDA device 0 (`gwtf train --device cuda`). Without a usable device (no
/// driver, no GPU, no cuBLAS, or a build without CUDA) this is
/// [`ModelError::DeviceUnavailable`] with the probe's explanation.
pub fn train_gpu(
    cfg: &ModelConfig,
    o: &TrainOptions,
    on_step: impl FnMut(&StepLog),
) -> Result<Vec<StepLog>, ModelError> {
    check_options(cfg, o)?;
    #[cfg(feature = "cuda")]
    {
        train_on(open_cuda()?, cfg, o, on_step)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = on_step;
        Err(no_cuda())
    }
}

/// The error of a build without the `cuda` feature: the probe's explanation.
#[cfg(not(feature = "cuda"))]
pub fn no_cuda() -> ModelError {
    ModelError::DeviceUnavailable(
        crate::cuda::probe(crate::cuda::ProbeDetail::CountOnly).to_string(),
    )
}
