//! `gwtf_stage`: one pipeline stage of the reference model, for C trainers
//! and the examples: forward and backward on flat buffers (the frames the
//! transport moves), gradient accumulation, AdamW step, parameter export and
//! import (a joining node downloads a stage this way).

use std::ffi::{c_char, CStr};

use super::boundary::{
    guard, guard_handle, require_out, write_out, FfiError, FfiHandle, FfiResult, HandleHeader,
};
use super::error::gwtf_error;
use super::status::gwtf_status;
use crate::model::{preset, AdamW, ModelError, Stage, StageInput, StageOutput, StagePlan};
use crate::swarm::model_trainer::ModelRun;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

/// Current version of `gwtf_stage_info` (what `gwtf_stage_info_init` writes).
pub const GWTF_STAGE_INFO_VERSION: u32 = 1;
/// Current version of `gwtf_adamw_options`.
pub const GWTF_ADAMW_OPTIONS_VERSION: u32 = 1;

/// What a stage is. Set `version` with `gwtf_stage_info_init` before
/// `gwtf_stage_get_info`: the library fills only the fields that version has.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct gwtf_stage_info {
    pub version: u32,
    /// 0-based index of this stage.
    pub index: u32,
    /// Stages the model is cut into.
    pub num_stages: u32,
    /// 1 when the stage takes token ids (the first), else 0.
    pub takes_tokens: u32,
    /// 1 when the stage computes the loss (the last), else 0.
    pub computes_loss: u32,
    /// Width of the activations between stages.
    pub d_model: u32,
    /// Vocabulary size (token ids must be below it).
    pub vocab_size: u32,
    /// Longest sequence a microbatch may have.
    pub max_seq: u32,
    /// Parameters of this stage.
    pub num_params: u64,
}

/// AdamW hyper-parameters for `gwtf_stage_step`; initialise with
/// `gwtf_adamw_options_init`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gwtf_adamw_options {
    pub version: u32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// One pipeline stage of the reference model (opaque).
pub struct gwtf_stage {
    header: HandleHeader,
    num_stages: u32,
    stage: Mutex<Stage>,
}

impl FfiHandle for gwtf_stage {
    const MAGIC: u64 = 0x6777_7466_7374_6731; // "gwtfstg1"
    const NAME: &'static str = "gwtf_stage";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

fn model_err(e: ModelError) -> FfiError {
    FfiError::invalid(e.to_string())
}

/// # Safety
/// NULL or valid for `n` reads; (NULL, 0) is empty.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> FfiResult<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(FfiError::null(what));
    }
    // SAFETY: per the function contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The AdamW of `opts` (NULL: the defaults), checked.
fn adamw_of(opts: *const gwtf_adamw_options) -> FfiResult<AdamW> {
    if opts.is_null() {
        return Ok(AdamW::default());
    }
    // SAFETY: non-NULL options struct per the contract.
    let o = unsafe { &*opts };
    if o.version == 0 || o.version > GWTF_ADAMW_OPTIONS_VERSION {
        return Err(FfiError::new(
            gwtf_status::UnsupportedVersion,
            format!(
                "gwtf_adamw_options.version {} (call gwtf_adamw_options_init)",
                o.version
            ),
        ));
    }
    let all = [o.lr, o.beta1, o.beta2, o.eps, o.weight_decay];
    if all.iter().any(|v| !v.is_finite() || *v < 0.0) || o.beta1 >= 1.0 || o.beta2 >= 1.0 {
        return Err(FfiError::invalid(
            "AdamW options must be finite and >= 0, with betas below 1",
        ));
    }
    Ok(AdamW {
        lr: o.lr,
        beta1: o.beta1,
        beta2: o.beta2,
        eps: o.eps,
        weight_decay: o.weight_decay,
    })
}

/// Copies `src` into a caller buffer after checking its length.
///
/// # Safety
/// `dst` NULL or valid for `dst_len` writes.
unsafe fn copy_out(src: &[f32], dst: *mut f32, dst_len: usize, what: &str) -> FfiResult<()> {
    if dst_len < src.len() {
        return Err(FfiError::new(
            gwtf_status::BufferTooSmall,
            format!("{what} holds {dst_len} floats, {} needed", src.len()),
        ));
    }
    if !src.is_empty() {
        if dst.is_null() {
            return Err(FfiError::null(what));
        }
        // SAFETY: checked length and non-NULL.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }
    Ok(())
}

/// Fills `info` with `version = GWTF_STAGE_INFO_VERSION` and zeros.
///
/// Ownership: caller memory, only written.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_stage_info_init(info: *mut gwtf_stage_info) -> gwtf_status {
    guard(std::ptr::null_mut(), || {
        require_out(info, "info")?;
        // SAFETY: checked non-NULL.
        unsafe {
            write_out(
                info,
                gwtf_stage_info {
                    version: GWTF_STAGE_INFO_VERSION,
                    ..Default::default()
                },
            )
        };
        Ok(())
    })
}

/// Fills `opts` with the reference trainer's AdamW defaults (lr 1e-3,
/// betas 0.9 / 0.95, eps 1e-8, weight decay 0.1).
///
/// Ownership: caller memory, only written.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_adamw_options_init(opts: *mut gwtf_adamw_options) -> gwtf_status {
    guard(std::ptr::null_mut(), || {
        require_out(opts, "opts")?;
        let d = AdamW::default();
        // SAFETY: checked non-NULL.
        unsafe {
            write_out(
                opts,
                gwtf_adamw_options {
                    version: GWTF_ADAMW_OPTIONS_VERSION,
                    lr: d.lr,
                    beta1: d.beta1,
                    beta2: d.beta2,
                    eps: d.eps,
                    weight_decay: d.weight_decay,
                },
            )
        };
        Ok(())
    })
}

/// Creates stage `index` of the reference model `preset` ("gpt-tiny",
/// "llama-tiny", "llama-small", ...) cut into `num_stages` stages, initialised
/// from `seed`. Any cut of the same preset and seed starts from the same model.
///
/// Ownership: `preset` is read during the call; the caller owns `*out_stage`
/// and frees it with `gwtf_stage_free`.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (unknown
/// preset, impossible cut, index out of range, preset not UTF-8).
#[no_mangle]
pub extern "C" fn gwtf_stage_new(
    preset_name: *const c_char,
    num_stages: u32,
    index: u32,
    seed: u64,
    out_stage: *mut *mut gwtf_stage,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_stage, "out_stage")?;
        let cfg = preset_of(preset_name)?;
        let plan = StagePlan::new(&cfg, num_stages as usize).map_err(model_err)?;
        if index as usize >= plan.len() {
            return Err(FfiError::invalid(format!(
                "stage index {index} but the model has {} stages",
                plan.len()
            )));
        }
        let stage = Stage::new(&cfg, &plan, index as usize, seed).map_err(model_err)?;
        let h = gwtf_stage {
            header: HandleHeader::new(gwtf_stage::MAGIC),
            num_stages: plan.len() as u32,
            stage: Mutex::new(stage),
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_stage, h.into_raw()) };
        Ok(())
    })
}

/// Describes a stage (see `gwtf_stage_info`).
///
/// Ownership: `stage` is borrowed; `info` is caller memory.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_UNSUPPORTED_VERSION`,
/// `GWTF_STATUS_INVALID_ARGUMENT`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_get_info(
    stage: *const gwtf_stage,
    info: *mut gwtf_stage_info,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        require_out(info, "info")?;
        // SAFETY: checked non-NULL.
        let version = unsafe { (*info).version };
        if version == 0 || version > GWTF_STAGE_INFO_VERSION {
            return Err(FfiError::new(
                gwtf_status::UnsupportedVersion,
                format!("gwtf_stage_info.version {version} (call gwtf_stage_info_init)"),
            ));
        }
        let s = h.stage.lock();
        let cfg = s.config();
        let spec = s.spec();
        let out = gwtf_stage_info {
            version,
            index: spec.index as u32,
            num_stages: h.num_stages,
            takes_tokens: spec.embedding as u32,
            computes_loss: spec.head as u32,
            d_model: cfg.d_model as u32,
            vocab_size: cfg.vocab_size as u32,
            max_seq: cfg.max_seq as u32,
            num_params: s.num_params() as u64,
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(info, out) };
        Ok(())
    })
}

/// Forward pass of microbatch `microbatch` (`batch` sequences of `seq`).
///
/// Input: the first stage takes `tokens` (`batch*seq` ids, `hidden` NULL);
/// the others take `hidden` (`batch*seq*d_model` floats, `tokens` NULL);
/// `input_len` is the element count. Output: the last stage needs `targets`
/// (`batch*seq` ids) and writes the mean loss to `*out_loss`; the others
/// write `batch*seq*d_model` floats to `out` (`*out_needed`, when not NULL,
/// receives that count, also on `GWTF_STATUS_BUFFER_TOO_SMALL`, which is
/// reported before any work). The activations the backward needs are kept
/// under `microbatch` until `gwtf_stage_backward` or `gwtf_stage_discard`.
///
/// Ownership: every buffer is the caller's and used only during the call.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (wrong
/// input kind or length, token out of range, microbatch already in flight),
/// `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_forward(
    stage: *mut gwtf_stage,
    microbatch: u64,
    batch: u32,
    seq: u32,
    tokens: *const u32,
    hidden: *const f32,
    input_len: usize,
    targets: *const u32,
    targets_len: usize,
    out: *mut f32,
    out_len: usize,
    out_needed: *mut usize,
    out_loss: *mut f32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let mut s = h.stage.lock();
        let (b, t) = (batch as usize, seq as usize);
        let spec = s.spec().clone();
        let n = b
            .checked_mul(t)
            .ok_or_else(|| FfiError::invalid("batch * seq overflows"))?;
        let needed = if spec.head {
            0
        } else {
            n.checked_mul(s.config().d_model)
                .ok_or_else(|| FfiError::invalid("output size overflows"))?
        };
        if !out_needed.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_needed, needed) };
        }
        if !spec.head && out_len < needed {
            return Err(FfiError::new(
                gwtf_status::BufferTooSmall,
                format!("out holds {out_len} floats, {needed} needed"),
            ));
        }
        if spec.head {
            require_out(out_loss, "out_loss")?;
        }
        // SAFETY (both): caller buffers of the stated lengths.
        let input = if spec.embedding {
            if !hidden.is_null() {
                return Err(FfiError::invalid(
                    "the first stage takes tokens, not hidden",
                ));
            }
            StageInput::Tokens(unsafe { slice(tokens, input_len, "tokens")? })
        } else {
            if !tokens.is_null() {
                return Err(FfiError::invalid("this stage takes hidden, not tokens"));
            }
            StageInput::Hidden(unsafe { slice(hidden, input_len, "hidden")? })
        };
        let tg = if spec.head {
            // SAFETY: caller buffer of targets_len ids.
            Some(unsafe { slice(targets, targets_len, "targets")? })
        } else {
            None
        };
        match s.forward(microbatch, b, t, input, tg).map_err(model_err)? {
            StageOutput::Loss(l) => {
                // SAFETY: checked non-NULL above (head stage).
                unsafe { write_out(out_loss, l) };
                Ok(())
            }
            // SAFETY: out holds out_len >= needed floats.
            StageOutput::Hidden(v) => unsafe { copy_out(&v, out, out_len, "out") },
        }
    })
}

/// Backward pass of `microbatch`: the last stage takes no `grad_output`
/// (NULL, 0); the others take the gradient of their output
/// (`batch*seq*d_model` floats). Every stage but the first writes the gradient
/// of its input to `grad_input` (`*out_needed` receives the count, also on
/// `GWTF_STATUS_BUFFER_TOO_SMALL`, which is reported before any work). The
/// parameter gradients are accumulated until `gwtf_stage_step`.
///
/// Ownership: caller buffers, used only during the call.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_NOT_FOUND` (no forward stored for `microbatch`),
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_backward(
    stage: *mut gwtf_stage,
    microbatch: u64,
    grad_output: *const f32,
    grad_output_len: usize,
    grad_input: *mut f32,
    grad_input_len: usize,
    out_needed: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let mut s = h.stage.lock();
        let (b, t) = s.saved_shape(microbatch).ok_or_else(|| {
            FfiError::new(
                gwtf_status::NotFound,
                format!("no forward of microbatch {microbatch} is stored"),
            )
        })?;
        let first = s.spec().embedding;
        let needed = if first { 0 } else { b * t * s.config().d_model };
        if !out_needed.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_needed, needed) };
        }
        if grad_input_len < needed {
            return Err(FfiError::new(
                gwtf_status::BufferTooSmall,
                format!("grad_input holds {grad_input_len} floats, {needed} needed"),
            ));
        }
        let go = if s.spec().head {
            None
        } else {
            // SAFETY: caller buffer of grad_output_len floats.
            Some(unsafe { slice(grad_output, grad_output_len, "grad_output")? })
        };
        match s.backward(microbatch, go).map_err(model_err)? {
            // SAFETY: grad_input holds grad_input_len >= needed floats.
            Some(g) => unsafe { copy_out(&g, grad_input, grad_input_len, "grad_input") },
            None => Ok(()),
        }
    })
}

/// Drops the stored forward of `microbatch` (its result will not be used:
/// a crash elsewhere, or a cancelled iteration). `*out_found` (may be NULL)
/// tells whether it was there.
///
/// Ownership: `stage` is borrowed.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_discard(
    stage: *mut gwtf_stage,
    microbatch: u64,
    out_found: *mut bool,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let found = h.stage.lock().discard(microbatch);
        if !out_found.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_found, found) };
        }
        Ok(())
    })
}

/// Applies one AdamW step with the mean of the accumulated gradients, then
/// clears them. `opts` NULL means the defaults of `gwtf_adamw_options_init`.
///
/// Ownership: `opts` is read during the call.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_UNSUPPORTED_VERSION`, `GWTF_STATUS_INVALID_ARGUMENT`
/// (non-finite or negative hyper-parameters, nothing accumulated),
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_step(
    stage: *mut gwtf_stage,
    opts: *const gwtf_adamw_options,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let opt = adamw_of(opts)?;
        let mut s = h.stage.lock();
        if s.accumulated() == 0 {
            return Err(FfiError::invalid(
                "no microbatch gradient accumulated since the last step",
            ));
        }
        s.step(&opt).map_err(model_err)
    })
}

/// Copies the stage's parameters (f32, in the stage's tensor order) into
/// `buf`; `*out_len` (may be NULL) receives the count, also on
/// `GWTF_STATUS_BUFFER_TOO_SMALL`.
///
/// Ownership: `buf` is caller memory.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_export_params(
    stage: *const gwtf_stage,
    buf: *mut f32,
    buf_len: usize,
    out_len: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let s = h.stage.lock();
        if !out_len.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_len, s.params().len()) };
        }
        // SAFETY: buf holds buf_len floats.
        unsafe { copy_out(s.params(), buf, buf_len, "buf") }
    })
}

/// Replaces the stage's parameters with `len` floats from `params` (a
/// same-stage peer's `gwtf_stage_export_params`).
///
/// Ownership: `params` is read during the call.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (wrong length), `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_import_params(
    stage: *mut gwtf_stage,
    params: *const f32,
    len: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        // SAFETY: params holds len floats.
        let p = unsafe { slice(params, len, "params")? };
        h.stage.lock().import_params(p).map_err(model_err)
    })
}

/// Frees a stage. `gwtf_stage_free(NULL)` does nothing.
///
/// Ownership: takes ownership of `stage`.
///
/// Thread safety: no other thread may use `stage` during or after this call.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_stage_free(stage: *mut gwtf_stage) {
    // SAFETY: NULL or a pointer from gwtf_stage_new, once.
    unsafe { super::boundary::free_handle(stage) }
}

/// Copies the parameter gradient accumulated since the last take (or step)
/// into `buf` and zeroes the accumulator: with one backward between two
/// takes, the gradient of one microbatch (a swarm trainer keeps each
/// microbatch's apart until its stage aggregates). `*out_len` (may be NULL)
/// receives the count, also on `GWTF_STATUS_BUFFER_TOO_SMALL` (reported
/// before anything changes).
///
/// Ownership: `buf` is caller memory.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_take_grads(
    stage: *mut gwtf_stage,
    buf: *mut f32,
    buf_len: usize,
    out_len: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let mut s = h.stage.lock();
        let n = s.num_params();
        if !out_len.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_len, n) };
        }
        // SAFETY: buf holds buf_len floats; checked before the take.
        unsafe { copy_out(s.grads(), buf, buf_len, "buf")? };
        s.take_grads();
        Ok(())
    })
}

/// One optimizer step with `mean` (`len` floats, one per parameter) as the
/// gradient, whatever was accumulated (which is dropped): a swarm member
/// applies its stage's all-reduced mean this way. `opts` NULL: the defaults.
///
/// Ownership: `mean` and `opts` are read during the call.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (wrong length, bad options),
/// `GWTF_STATUS_UNSUPPORTED_VERSION`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_apply_mean(
    stage: *mut gwtf_stage,
    mean: *const f32,
    len: usize,
    opts: *const gwtf_adamw_options,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let opt = adamw_of(opts)?;
        // SAFETY: mean holds len floats.
        let m = unsafe { slice(mean, len, "mean")? };
        let mut s = h.stage.lock();
        if m.len() != s.num_params() {
            return Err(FfiError::invalid(format!(
                "a mean of {} floats for {} parameters",
                m.len(),
                s.num_params()
            )));
        }
        s.set_mean_grads(m).map_err(model_err)?;
        s.step(&opt).map_err(model_err)
    })
}

/// The stage's whole state as bytes (parameters, AdamW moments, step
/// count: what a joining replica downloads) into `buf`; `*out_len` (may be
/// NULL) receives the length, also on `GWTF_STATUS_BUFFER_TOO_SMALL`.
///
/// Ownership: `buf` is caller memory.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_export_state(
    stage: *const gwtf_stage,
    buf: *mut u8,
    buf_len: usize,
    out_len: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        let st = h.stage.lock().export_state();
        if !out_len.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_len, st.len()) };
        }
        if buf_len < st.len() {
            return Err(FfiError::new(
                gwtf_status::BufferTooSmall,
                format!("buf holds {buf_len} bytes, {} needed", st.len()),
            ));
        }
        if buf.is_null() {
            return Err(FfiError::null("buf"));
        }
        // SAFETY: checked length and non-NULL.
        unsafe { std::ptr::copy_nonoverlapping(st.as_ptr(), buf, st.len()) };
        Ok(())
    })
}

/// Replaces the stage's whole state with `len` bytes from `state` (a
/// same-stage replica's `gwtf_stage_export_state`); checked before anything
/// changes. Drops the activations kept and the accumulated gradient.
///
/// Ownership: `state` is read during the call.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_INVALID_ARGUMENT` (not a state of this stage),
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_import_state(
    stage: *mut gwtf_stage,
    state: *const u8,
    len: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        // SAFETY: state holds len bytes.
        let b = unsafe { slice(state, len, "state")? };
        let mut s = h.stage.lock();
        let backup = s.state();
        if let Err(e) = s.import_state(b) {
            let _ = s.set_state(&backup);
            return Err(model_err(e));
        }
        let st = s.state();
        s.set_state(&st).map_err(model_err)
    })
}

/// The SHA-256 of the stage's state (`gwtf_stage_export_state`'s bytes)
/// into `out` (32 bytes): replicas that applied the same updates agree, and
/// `gwtf node` reports its weights this way.
///
/// Ownership: `out` is caller memory of 32 bytes.
///
/// Thread safety: calls on one stage are serialised.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_stage_state_digest(
    stage: *const gwtf_stage,
    out: *mut u8,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, stage, |h| {
        require_out(out, "out")?;
        let d: [u8; 32] = Sha256::digest(h.stage.lock().export_state()).into();
        // SAFETY: out holds 32 bytes per the contract.
        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), out, 32) };
        Ok(())
    })
}

/// Current version of `gwtf_model_run_info`.
pub const GWTF_MODEL_RUN_INFO_VERSION: u32 = 1;

/// What `gwtf node` trains with `--model preset --stages S --iterations N`
/// (see `gwtf_model_run_info_get`): a C trainer serving a stage of the same
/// swarm with `gwtf_stage` must use exactly these.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct gwtf_model_run_info {
    /// `GWTF_MODEL_RUN_INFO_VERSION` of the library that wrote it.
    pub version: u32,
    /// Relay stages (`S - 2`).
    pub relay_stages: u32,
    /// Sequences per microbatch, and tokens per sequence.
    pub batch: u32,
    pub seq: u32,
    pub d_model: u32,
    pub reserved0: u32,
    /// Bytes of an activation between stages (and of its gradient).
    pub activation_bytes: u64,
}

/// The preset a C string names.
fn preset_of(preset_name: *const c_char) -> FfiResult<crate::model::ModelConfig> {
    if preset_name.is_null() {
        return Err(FfiError::null("preset"));
    }
    // SAFETY: non-NULL, NUL-terminated per the contract.
    let name = unsafe { CStr::from_ptr(preset_name) }
        .to_str()
        .map_err(|_| FfiError::invalid("preset is not UTF-8"))?;
    preset(name).map_err(model_err)
}

fn model_run(preset_name: *const c_char, stages: u32, iterations: u32) -> FfiResult<ModelRun> {
    let cfg = preset_of(preset_name)?;
    ModelRun::new(cfg, stages as usize, 0, iterations as usize).map_err(model_err)
}

/// Describes the run `gwtf node --model preset --stages stages --iterations
/// iterations` trains (microbatch shape, activation size).
///
/// Ownership: `preset` is read during the call; `out` is caller memory.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (unknown
/// preset, fewer than 3 stages, impossible cut).
#[no_mangle]
pub extern "C" fn gwtf_model_run_info_get(
    preset_name: *const c_char,
    stages: u32,
    iterations: u32,
    out: *mut gwtf_model_run_info,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out, "out")?;
        let run = model_run(preset_name, stages, iterations)?;
        let v = gwtf_model_run_info {
            version: GWTF_MODEL_RUN_INFO_VERSION,
            relay_stages: stages - 2,
            batch: run.opts.batch as u32,
            seq: run.opts.seq as u32,
            d_model: run.cfg.d_model as u32,
            reserved0: 0,
            activation_bytes: run.activation_bytes() as u64,
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, v) };
        Ok(())
    })
}

/// The bytes protocol stage `stage` (0: the data holders) of that run
/// transfers to a joiner at most (`gwtf node`'s format: per piece its
/// length and state, then the length and the parameters from before the
/// last update), and the memory one microbatch in flight takes there (what
/// `gwtf node` gives the swarm as its sizes).
///
/// Ownership: `preset` is read during the call; outputs are caller memory.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_model_run_stage_bytes(
    preset_name: *const c_char,
    stages: u32,
    stage: u32,
    out_state_bytes: *mut u64,
    out_microbatch_bytes: *mut u64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_state_bytes, "out_state_bytes")?;
        require_out(out_microbatch_bytes, "out_microbatch_bytes")?;
        let run = model_run(preset_name, stages, 1)?;
        let st = u16::try_from(stage).map_err(|_| FfiError::invalid("stage too large"))?;
        let state = run.state_bytes(st).map_err(model_err)?;
        let mb = run.bytes_per_microbatch(st).map_err(model_err)?;
        // SAFETY: checked non-NULL.
        unsafe {
            write_out(out_state_bytes, state);
            write_out(out_microbatch_bytes, mb);
        }
        Ok(())
    })
}

/// The optimizer settings `gwtf node` applies iteration `iteration`'s
/// update with (the run's learning-rate schedule and weight decay).
///
/// Ownership: `preset` is read during the call; `out` is caller memory.
///
/// Thread safety: any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn gwtf_model_run_adamw(
    preset_name: *const c_char,
    stages: u32,
    iterations: u32,
    iteration: u32,
    out: *mut gwtf_adamw_options,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out, "out")?;
        let run = model_run(preset_name, stages, iterations)?;
        let a = run.adamw(iteration);
        let v = gwtf_adamw_options {
            version: GWTF_ADAMW_OPTIONS_VERSION,
            lr: a.lr,
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
            weight_decay: a.weight_decay,
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, v) };
        Ok(())
    })
}
