//! Reference trainer: small GPT-like and LLaMA-like models cut into pipeline stages, with
//! forward and backward on the CPU (hand-written kernels in the style of llm.c).
//!
//! - [`config`]: configurations, presets ([`preset`], [`preset_names`]), the cut into
//!   stages ([`StagePlan`]) and per-stage costs for the simulator ([`stage_costs`]).
//! - [`ops`]: the layer ops (forward + backward over slices, generic over f32/f64).
//! - [`stage`]: [`Stage`], the unit a relay serves: forward / backward per microbatch id
//!   (several in flight), gradient accumulation, AdamW, export/import, replica averaging.
//! - [`kernels`]: CPU twins of the CUDA kernels (bf16, int8 blockwise, weighted average,
//!   fused AdamW).
//! - [`train`]: the single-process pipeline trainer used by `gwtf train` and the tests.
//! - [`gpu`]: the same stages, pipeline and trainer with everything resident on a device
//!   (`gwtf train --device cuda`: cuBLAS and our NVRTC kernels), or on the host through
//!   the kernels' CPU twins.
//! - [`data`]: a deterministic, seeded English-like corpus, a byte-level tokenizer and the
//!   window sampler.
//! - [`dataset`]: what a run trains on (the generated corpus or text files) and the part of
//!   it held out for evaluation.
//! - [`checkpoint`]: saving and loading a run (weights, AdamW state, data position), one
//!   safetensors file per stage (docs/CHECKPOINT.md).
//! - [`sample`]: text generation from a trained model.
//! - [`bench`]: kernel bandwidth against memcpy measured in the same run.
//!
//! Stage 0 is the embedding, the last stage the final norm + head + cross-entropy loss,
//! the stages between hold transformer blocks. Activations and their gradients between
//! stages are flat f32 buffers of shape `[batch, seq, d_model]`.
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod dataset;
pub mod gpu;
pub mod kernels;
pub mod ops;
pub mod rng;
pub mod sample;
pub mod stage;
pub mod train;

pub use config::{
    preset, preset_names, stage_costs, Family, ModelConfig, StageCost, StagePlan, StageSpec,
};
pub use kernels::AdamW;
pub use stage::{
    average_replicas, ActShape, MicrobatchId, Stage, StageInput, StageOutput, StageState,
    StateParts,
};
pub use train::{Pipeline, StepLog, TrainOptions};

use std::fmt;

/// Errors of the model module.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelError {
    /// The configuration (or a plan, or an argument) is invalid.
    InvalidConfig(String),
    /// No preset by that name.
    UnknownPreset(String),
    /// A buffer has the wrong length.
    ShapeMismatch {
        /// Which buffer.
        what: &'static str,
        /// Expected element count.
        expected: usize,
        /// Actual element count.
        got: usize,
    },
    /// A token id or target is `>= vocab`.
    TokenOutOfRange {
        /// The token.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The wrong kind of input for this stage.
    WrongInput(&'static str),
    /// The last stage needs targets.
    MissingTargets,
    /// A stage other than the last needs the gradient of its output.
    MissingGradient,
    /// Backward of a microbatch this stage does not hold.
    UnknownMicrobatch(MicrobatchId),
    /// Forward of a microbatch id already in flight at this stage.
    DuplicateMicrobatch(MicrobatchId),
    /// `step` with no accumulated gradient.
    NothingAccumulated,
    /// An exported state/parameter buffer does not fit this stage.
    BadState(String),
    /// The requested device is not available.
    DeviceUnavailable(String),
    /// An operation on the device failed (driver, cuBLAS or kernel launch error).
    Device(String),
    /// Training data that cannot be used (the message names the file).
    Data(String),
    /// A checkpoint that cannot be written, read or used (the message names the file).
    Checkpoint(String),
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::InvalidConfig(s) => write!(f, "invalid model configuration: {s}"),
            ModelError::UnknownPreset(s) => write!(
                f,
                "unknown model preset {s:?} (known: {})",
                preset_names().join(", ")
            ),
            ModelError::ShapeMismatch {
                what,
                expected,
                got,
            } => {
                write!(f, "{what}: expected {expected} elements, got {got}")
            }
            ModelError::TokenOutOfRange { token, vocab } => {
                write!(f, "token {token} out of range for vocabulary of {vocab}")
            }
            ModelError::WrongInput(s) => write!(f, "wrong stage input: {s}"),
            ModelError::MissingTargets => write!(f, "the last stage needs targets"),
            ModelError::MissingGradient => write!(f, "this stage needs its output gradient"),
            ModelError::UnknownMicrobatch(id) => write!(f, "microbatch {id} is not held here"),
            ModelError::DuplicateMicrobatch(id) => {
                write!(f, "microbatch {id} is already in flight here")
            }
            ModelError::NothingAccumulated => write!(f, "optimizer step with no gradient"),
            ModelError::BadState(s) => write!(f, "bad stage state: {s}"),
            ModelError::DeviceUnavailable(s) => write!(f, "device unavailable: {s}"),
            ModelError::Device(s) => write!(f, "device error: {s}"),
            ModelError::Data(s) => write!(f, "training data: {s}"),
            ModelError::Checkpoint(s) => write!(f, "checkpoint: {s}"),
        }
    }
}

impl std::error::Error for ModelError {}
