//! `gwtf_cuda_info`: the CUDA probe for C callers.

use std::ffi::c_char;

use super::boundary::{
    copy_str_out, free_handle, guard, guard_handle, require_out, write_out, FfiError, FfiHandle,
    HandleHeader,
};
use super::enums::CEnum;
use super::error::gwtf_error;
use super::status::gwtf_status;
use crate::cuda::{probe, ProbeDetail, ProbeReport, ProbeState};

/// What `gwtf_cuda_probe` found (`GWTF_CUDA_STATE_*`, read with `gwtf_cuda_info_state`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_cuda_state {
    /// This build of libgwtf has no CUDA support.
    Disabled = 0,
    /// No CUDA driver library (libcuda) could be loaded.
    NoDriver = 1,
    /// The driver loaded but reports no device.
    NoDevice = 2,
    /// The driver loaded but initialisation or a device query failed.
    InitError = 3,
    /// At least one device is ready.
    Ready = 4,
}

impl From<ProbeState> for gwtf_cuda_state {
    fn from(s: ProbeState) -> Self {
        match s {
            ProbeState::Disabled => Self::Disabled,
            ProbeState::NoDriver => Self::NoDriver,
            ProbeState::NoDevice => Self::NoDevice,
            ProbeState::InitError => Self::InitError,
            ProbeState::Ready => Self::Ready,
        }
    }
}

/// How much `gwtf_cuda_probe` finds out (`GWTF_CUDA_PROBE_DETAIL_*`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum gwtf_cuda_probe_detail {
    /// Whether CUDA works and the device count only.
    CountOnly = 0,
    /// Also each device's name, memory and compute capability.
    Devices = 1,
}

impl CEnum for gwtf_cuda_probe_detail {
    const NAME: &'static str = "gwtf_cuda_probe_detail";
    const ALL: &'static [Self] = &[Self::CountOnly, Self::Devices];
    fn to_i32(self) -> i32 {
        self as i32
    }
}

/// Current version of `gwtf_cuda_probe_options` (what `_init` writes).
pub const GWTF_CUDA_PROBE_OPTIONS_VERSION: u32 = 1;

/// Options of `gwtf_cuda_probe`. Initialise with `gwtf_cuda_probe_options_init`,
/// then change fields. Fields are only ever appended; `version` tells the library
/// which fields the caller knows.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct gwtf_cuda_probe_options {
    /// Must be set (by `_init`) to `GWTF_CUDA_PROBE_OPTIONS_VERSION`.
    pub version: u32,
    /// A `GWTF_CUDA_PROBE_DETAIL_*` value. Default: `GWTF_CUDA_PROBE_DETAIL_DEVICES`.
    pub detail: i32,
}

/// The result of a CUDA probe (opaque).
pub struct gwtf_cuda_info {
    header: HandleHeader,
    report: ProbeReport,
}

impl FfiHandle for gwtf_cuda_info {
    const MAGIC: u64 = 0x6777_7466_6375_6461; // "gwtfcuda"
    const NAME: &'static str = "gwtf_cuda_info";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

/// Fills `opts` with the defaults of this library version.
///
/// Ownership: `opts` is caller memory; it is only written.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER` when `opts` is NULL.
#[no_mangle]
pub extern "C" fn gwtf_cuda_probe_options_init(opts: *mut gwtf_cuda_probe_options) -> gwtf_status {
    guard(std::ptr::null_mut(), || {
        require_out(opts, "opts")?;
        let defaults = gwtf_cuda_probe_options {
            version: GWTF_CUDA_PROBE_OPTIONS_VERSION,
            detail: gwtf_cuda_probe_detail::Devices as i32,
        };
        // SAFETY: checked non-NULL; the caller provides a writable struct.
        unsafe { write_out(opts, defaults) };
        Ok(())
    })
}

/// Probes for CUDA without ever crashing: no driver, no device and driver
/// errors are answers (read them with `gwtf_cuda_info_state`), not failures.
///
/// `opts` may be NULL for the defaults. On success `*out_info` receives a new
/// object describing what was found.
///
/// Ownership: `opts` is only read during the call. The caller owns `*out_info`
/// and frees it with `gwtf_cuda_info_free`. `*out_err`, when set, is the
/// caller's to free with `gwtf_error_free`.
///
/// Thread safety: may be called from any thread, also concurrently.
///
/// Errors: `GWTF_STATUS_NULL_POINTER` (out_info NULL),
/// `GWTF_STATUS_UNSUPPORTED_VERSION` (opts->version unknown),
/// `GWTF_STATUS_INVALID_ARGUMENT` (opts->detail out of range),
/// `GWTF_STATUS_PANIC`.
#[no_mangle]
pub extern "C" fn gwtf_cuda_probe(
    opts: *const gwtf_cuda_probe_options,
    out_info: *mut *mut gwtf_cuda_info,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        require_out(out_info, "out_info")?;
        let detail = if opts.is_null() {
            ProbeDetail::Devices
        } else {
            // SAFETY: non-NULL; the caller provides a readable options struct.
            let o = unsafe { &*opts };
            if o.version == 0 || o.version > GWTF_CUDA_PROBE_OPTIONS_VERSION {
                return Err(FfiError::new(
                    gwtf_status::UnsupportedVersion,
                    format!(
                        "gwtf_cuda_probe_options.version is {} but this library knows 1..={} (call gwtf_cuda_probe_options_init)",
                        o.version, GWTF_CUDA_PROBE_OPTIONS_VERSION
                    ),
                ));
            }
            match gwtf_cuda_probe_detail::from_c(o.detail)? {
                gwtf_cuda_probe_detail::CountOnly => ProbeDetail::CountOnly,
                gwtf_cuda_probe_detail::Devices => ProbeDetail::Devices,
            }
        };
        let info = gwtf_cuda_info {
            header: HandleHeader::new(gwtf_cuda_info::MAGIC),
            report: probe(detail),
        };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_info, info.into_raw()) };
        Ok(())
    })
}

/// What the probe found: a `GWTF_CUDA_STATE_*` value.
///
/// Ownership: `info` is only borrowed.
///
/// Thread safety: `gwtf_cuda_info` is immutable; any thread may read it.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (not a
/// live `gwtf_cuda_info`), `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_cuda_info_state(
    info: *const gwtf_cuda_info,
    out_state: *mut i32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, info, |i| {
        require_out(out_state, "out_state")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_state, gwtf_cuda_state::from(i.report.state) as i32) };
        Ok(())
    })
}

/// Number of CUDA devices found (0 unless the state is `GWTF_CUDA_STATE_READY`).
///
/// Ownership: `info` is only borrowed.
///
/// Thread safety: any thread may read a `gwtf_cuda_info`.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_cuda_info_device_count(
    info: *const gwtf_cuda_info,
    out_count: *mut u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, info, |i| {
        require_out(out_count, "out_count")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out_count, i.report.device_count) };
        Ok(())
    })
}

/// Copies device `ordinal`'s name into `buf` (NUL-terminated) and its total
/// memory into `*out_total_memory_bytes` (may be NULL).
///
/// `*out_len` (may be NULL) receives the name's length without the NUL, also
/// when the buffer is too small; call with `buf = NULL, buf_len = 0` to ask it.
///
/// Ownership: `buf` is caller memory of `buf_len` bytes.
///
/// Thread safety: any thread may read a `gwtf_cuda_info`.
///
/// Errors: `GWTF_STATUS_NOT_FOUND` (no such device, or probed with
/// `GWTF_CUDA_PROBE_DETAIL_COUNT_ONLY`), `GWTF_STATUS_BUFFER_TOO_SMALL`,
/// `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`,
/// `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_cuda_info_device_name(
    info: *const gwtf_cuda_info,
    ordinal: u32,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
    out_total_memory_bytes: *mut u64,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, info, |i| {
        let dev = i.report.devices.get(ordinal as usize).ok_or_else(|| {
            FfiError::new(
                gwtf_status::NotFound,
                format!(
                    "no device {ordinal}: {} device(s) with details",
                    i.report.devices.len()
                ),
            )
        })?;
        // SAFETY: the caller passes a buffer of buf_len bytes (or NULL, 0).
        unsafe { copy_str_out(&dev.name, buf, buf_len, out_len)? };
        if !out_total_memory_bytes.is_null() {
            // SAFETY: checked non-NULL.
            unsafe { write_out(out_total_memory_bytes, dev.total_memory_bytes) };
        }
        Ok(())
    })
}

/// A one-paragraph English summary of the probe (what `gwtf probe` prints),
/// including the CUDA error name when a driver call failed.
///
/// `*out_len` (may be NULL) receives the length without the NUL, also when the
/// buffer is too small.
///
/// Ownership: `buf` is caller memory of `buf_len` bytes.
///
/// Thread safety: any thread may read a `gwtf_cuda_info`.
///
/// Errors: `GWTF_STATUS_BUFFER_TOO_SMALL`, `GWTF_STATUS_NULL_POINTER`,
/// `GWTF_STATUS_INVALID_ARGUMENT`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_cuda_info_describe(
    info: *const gwtf_cuda_info,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, info, |i| {
        let text = i.report.to_string();
        // SAFETY: the caller passes a buffer of buf_len bytes (or NULL, 0).
        unsafe { copy_str_out(&text, buf, buf_len, out_len) }
    })
}

/// Frees a probe result. `gwtf_cuda_info_free(NULL)` does nothing; so does a
/// poisoned handle's free (it is freed normally).
///
/// Ownership: takes ownership of `info`; it must not be used afterwards.
///
/// Thread safety: no other thread may use `info` during or after this call.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_cuda_info_free(info: *mut gwtf_cuda_info) {
    // SAFETY: the caller passes NULL or a pointer from gwtf_cuda_probe, once.
    unsafe { free_handle(info) }
}

/// Test hook, in debug builds only and never declared in the header: panics
/// inside the boundary while using `info` (which may be NULL), to prove that a
/// panic comes back as `GWTF_STATUS_PANIC` and poisons the handle.
#[cfg(debug_assertions)]
#[no_mangle]
pub extern "C" fn gwtf_debug_panic(
    info: *const gwtf_cuda_info,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    if info.is_null() {
        guard(out_err, || panic!("deliberate test panic"))
    } else {
        guard_handle(out_err, info, |_| panic!("deliberate test panic"))
    }
}
