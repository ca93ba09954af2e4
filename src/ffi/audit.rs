//! `gwtf_audit`: the run audit ([`crate::swarm::audit`]) for operators in C,
//! C++ or Go. An operator that starts `gwtf node` processes (or embedded
//! peers that print the same event lines) tells the audit what it did
//! (launched, killed, exited) and hands it every line its nodes print; at
//! the end it asks for the verdict: every microbatch counted exactly once,
//! the replicas of each stage agree, recovery times, the loss against a
//! reference, as the JSON `gwtf demo --json` writes.

use std::ffi::c_char;

use parking_lot::Mutex;

use super::boundary::{
    copy_str_out, free_handle, guard, guard_handle, require_out, write_out, FfiError, FfiHandle,
    FfiResult, HandleHeader,
};
use super::error::gwtf_error;
use super::node::c_str;
use super::peer::GWTF_STAGE_AUTO;
use super::status::gwtf_status;
use crate::swarm::audit::{parse_line, Entry, Facts, Plan, What};

/// The most model stages an audit accepts (a swarm's relay stages plus the
/// holders' two pieces).
pub const GWTF_AUDIT_MAX_STAGES: u32 = 4096;

/// The most reference losses `gwtf_audit_summary` reads.
pub const GWTF_AUDIT_MAX_REFERENCE: usize = 1 << 24;

/// A run audit (opaque). Made by `gwtf_audit_new`, freed by
/// `gwtf_audit_free`.
pub struct gwtf_audit {
    header: HandleHeader,
    model_stages: u32,
    facts: Mutex<Facts>,
}

impl FfiHandle for gwtf_audit {
    const MAGIC: u64 = 0x6777_7466_6175_6474; // "gwtfaudt"
    const NAME: &'static str = "gwtf_audit";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

/// Seconds since the run started: finite and not negative.
fn when(t: f64) -> FfiResult<f64> {
    if t.is_finite() && t >= 0.0 {
        Ok(t)
    } else {
        Err(FfiError::invalid(format!(
            "t is {t}: seconds since the run started, finite and >= 0"
        )))
    }
}

fn flag(v: u32, what: &str) -> FfiResult<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        x => Err(FfiError::invalid(format!("{what} is {x}: 0 or 1"))),
    }
}

fn push(a: &gwtf_audit, t: f64, what: What) -> FfiResult<()> {
    let t = when(t)?;
    a.facts.lock().push(&Entry { t, what });
    Ok(())
}

/// Creates an audit of a run of a model cut into `model_stages` stages
/// (`gwtf node --stages`: the relay stages plus 2).
///
/// Ownership: the caller owns `*out_audit` and frees it with
/// `gwtf_audit_free`.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER` (`out_audit`),
/// `GWTF_STATUS_INVALID_ARGUMENT` (`model_stages` below 3 or above
/// `GWTF_AUDIT_MAX_STAGES`).
#[no_mangle]
pub extern "C" fn gwtf_audit_new(
    model_stages: u32,
    out_audit: *mut *mut gwtf_audit,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_audit, "out_audit")?;
        if !(3..=GWTF_AUDIT_MAX_STAGES).contains(&model_stages) {
            return Err(FfiError::invalid(format!(
                "model_stages is {model_stages}: a swarm has 3..={GWTF_AUDIT_MAX_STAGES} \
                 (its relay stages plus the data holders' two)"
            )));
        }
        let a = gwtf_audit {
            header: HandleHeader::new(gwtf_audit::MAGIC),
            model_stages,
            facts: Mutex::new(Facts::new(model_stages)),
        };
        // SAFETY: checked non-NULL by require_out.
        unsafe { write_out(out_audit, a.into_raw()) };
        Ok(())
    })
}

/// The operator started node `node` at `t` seconds into the run: a data
/// holder (`holder` 1) or a relay, a joiner (`joiner` 1) or a founding
/// member, told `stage` (a relay's stage, or `GWTF_STAGE_AUTO` when the
/// protocol picks it).
///
/// Ownership: nothing is kept but the values.
///
/// Thread safety: any thread; calls on one audit are serialized.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (a
/// flag not 0 or 1, `t` negative or not finite, a stage below -1),
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_audit_launched(
    audit: *const gwtf_audit,
    t: f64,
    node: u64,
    holder: u32,
    joiner: u32,
    stage: i32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, audit, |a| {
        let stage = match stage {
            GWTF_STAGE_AUTO => None,
            s if s >= 0 => Some(s as u32),
            s => {
                return Err(FfiError::invalid(format!(
                    "stage is {s}: a stage, or GWTF_STAGE_AUTO"
                )))
            }
        };
        let what = What::Launched {
            node,
            holder: flag(holder, "holder")?,
            joiner: flag(joiner, "joiner")?,
            stage,
        };
        push(a, t, what)
    })
}

/// Node `node` printed `line` (one line of its stdout, without or with its
/// newline) at `t` seconds into the run. A line that is not an event
/// (`gwtf node --json`'s schema) is counted as garbage for that node, never
/// refused.
///
/// Ownership: `line` is only read during the call.
///
/// Thread safety: any thread; calls on one audit are serialized.
///
/// Errors: `GWTF_STATUS_NULL_POINTER` (`audit`, `line`),
/// `GWTF_STATUS_INVALID_ARGUMENT` (`t`), `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_audit_line(
    audit: *const gwtf_audit,
    t: f64,
    node: u64,
    line: *const c_char,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, audit, |a| {
        // Not UTF-8 is garbage, as any other line that is not an event.
        let event = match c_str(line, "line") {
            Ok(text) => parse_line(text),
            Err(e) if e.status == gwtf_status::NullPointer => return Err(e),
            Err(_) => None,
        };
        push(a, t, What::Line { node, event })
    })
}

/// The operator killed node `node` (SIGKILL or the like) at `t`.
///
/// Ownership: nothing is kept but the values.
///
/// Thread safety: any thread; calls on one audit are serialized.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`
/// (`t`), `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_audit_killed(
    audit: *const gwtf_audit,
    t: f64,
    node: u64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, audit, |a| {
        let what = What::Killed {
            node,
            aim: "operator".into(),
            joiner: None,
            carrying: None,
        };
        push(a, t, what)
    })
}

/// Node `node`'s process ended at `t`: with `exit_code` (`by_signal` 0), or
/// by a signal (`by_signal` 1; `exit_code` is ignored).
///
/// Ownership: nothing is kept but the values.
///
/// Thread safety: any thread; calls on one audit are serialized.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`
/// (`t`, `by_signal`), `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_audit_exited(
    audit: *const gwtf_audit,
    t: f64,
    node: u64,
    exit_code: i32,
    by_signal: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, audit, |a| {
        let code = (!flag(by_signal, "by_signal")?).then_some(exit_code);
        push(a, t, What::Exited { node, code })
    })
}

/// The verdict on the run so far, as JSON (the object `gwtf demo --json`
/// writes: `ok`, `failures`, `iterations`, `lost_microbatches`,
/// `double_counted_microbatches`, `replicas_agree`, `loss_first`,
/// `loss_last`, recovery times, ...), for a run of `model` planned for
/// `iterations` iterations of `microbatches` microbatches per data holder
/// (`gwtf node --microbatches`), that took `wall_s` seconds. `reference` (may be NULL when `reference_len` is 0):
/// the single-process losses of the same microbatches, one per iteration,
/// which the swarm's are held to. `*out_ok` (may be NULL) receives 1 when
/// the run passed, else 0. `*out_len` (may be NULL) receives the JSON's
/// length without the NUL, also when the buffer is too small: call with
/// `buf` NULL and `buf_len` 0 to learn it.
///
/// Ownership: `buf` is caller memory of `buf_len` bytes; `model` and
/// `reference` are only read during the call.
///
/// Thread safety: any thread; calls on one audit are serialized.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`
/// (`model` not UTF-8, `wall_s` negative or not finite, a reference loss
/// not finite), `GWTF_STATUS_LIMIT_EXCEEDED` (`reference_len` above
/// `GWTF_AUDIT_MAX_REFERENCE`), `GWTF_STATUS_BUFFER_TOO_SMALL`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_audit_summary(
    audit: *const gwtf_audit,
    model: *const c_char,
    iterations: u64,
    microbatches: u64,
    reference: *const f64,
    reference_len: usize,
    wall_s: f64,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
    out_ok: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, audit, |a| {
        let model = c_str(model, "model")?.to_string();
        if !(wall_s.is_finite() && wall_s >= 0.0) {
            return Err(FfiError::invalid(format!(
                "wall_s is {wall_s}: seconds, finite and >= 0"
            )));
        }
        if reference_len > GWTF_AUDIT_MAX_REFERENCE {
            return Err(FfiError::new(
                gwtf_status::LimitExceeded,
                format!("{reference_len} reference losses (most: {GWTF_AUDIT_MAX_REFERENCE})"),
            ));
        }
        let reference: Option<Vec<f64>> = if reference_len == 0 {
            None
        } else if reference.is_null() {
            return Err(FfiError::null("reference (with reference_len > 0)"));
        } else {
            // SAFETY: non-NULL; the caller passes reference_len values.
            let r = unsafe { std::slice::from_raw_parts(reference, reference_len) };
            if let Some(i) = r.iter().position(|x| !x.is_finite()) {
                return Err(FfiError::invalid(format!(
                    "reference[{i}] is {}: a loss is finite",
                    r[i]
                )));
            }
            Some(r.to_vec())
        };
        let plan = Plan {
            model,
            stages: a.model_stages,
            iterations,
            microbatches,
        };
        let summary = a.facts.lock().summary(&plan, reference.as_deref(), wall_s);
        let json = serde_json::to_string(&summary)
            .map_err(|e| FfiError::invalid(format!("the summary does not serialize: {e}")))?;
        // SAFETY: the caller passes a buffer of buf_len bytes (or NULL, 0).
        unsafe { copy_str_out(&json, buf, buf_len, out_len)? };
        if !out_ok.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_ok, u32::from(summary.ok)) };
        }
        Ok(())
    })
}

/// Frees an audit. `gwtf_audit_free(NULL)` does nothing.
///
/// Ownership: takes ownership of `audit`; it must not be used afterwards.
///
/// Thread safety: no other thread may use `audit` during or after this call.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_audit_free(audit: *mut gwtf_audit) {
    // SAFETY: the caller passes NULL or a pointer from gwtf_audit_new, once.
    unsafe { free_handle(audit) }
}
