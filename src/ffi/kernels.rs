//! Activation compression and aggregation kernels for C trainers, on host
//! buffers (the CPU twins) and on device buffers (CUDA, through `gwtf_gpu`).
//!
//! Semantics are identical on both sides (see src/model/kernels.rs): bf16 is
//! round-to-nearest-even; int8 is blockwise symmetric with one f32 scale per
//! block (`scale = absmax / 127`); the average weights are normalised to sum 1.

use std::ffi::c_void;

use super::boundary::{guard, guard_handle, FfiError, FfiHandle, FfiResult, HandleHeader};
use super::error::gwtf_error;
use super::status::gwtf_status;
use crate::cuda::gpu::{Gpu, GpuError};
use crate::model::kernels as cpu;
use parking_lot::Mutex;

/// The most elements one call accepts (2^40: 4 TiB of f32), checked first.
const MAX_ELEMENTS: usize = 1 << 40;

/// A host slice from C: (NULL, 0) is the empty slice; NULL with n > 0 is an error.
///
/// # Safety
/// `ptr` must be NULL or valid for `n` reads of T for the duration of the call.
unsafe fn host_slice<'a, T>(ptr: *const T, n: usize, what: &str) -> FfiResult<&'a [T]> {
    if n > MAX_ELEMENTS {
        return Err(FfiError::new(
            gwtf_status::LimitExceeded,
            format!("{what}: {n} elements is more than the limit of {MAX_ELEMENTS}"),
        ));
    }
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(FfiError::null(what));
    }
    // SAFETY: non-NULL, and the caller promises n valid elements.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// # Safety
/// As [`host_slice`], for writes.
unsafe fn host_slice_mut<'a, T>(ptr: *mut T, n: usize, what: &str) -> FfiResult<&'a mut [T]> {
    // SAFETY: same contract; the caller also promises exclusive access.
    let s = unsafe { host_slice(ptr as *const T, n, what)? };
    // SAFETY: the pointer came in as *mut with exclusive access for the call.
    Ok(unsafe { std::slice::from_raw_parts_mut(s.as_ptr() as *mut T, s.len()) })
}

fn check_block(n: usize, block: u32, scales_len: usize) -> FfiResult<()> {
    if block == 0 {
        return Err(FfiError::invalid("block must be > 0"));
    }
    let need = n.div_ceil(block as usize);
    if scales_len != need {
        return Err(FfiError::new(
            gwtf_status::BufferTooSmall,
            format!("scales_len is {scales_len} but {n} values in blocks of {block} need {need}"),
        ));
    }
    Ok(())
}

fn model_err(e: crate::model::ModelError) -> FfiError {
    FfiError::invalid(e.to_string())
}

/// Converts `n` floats to bf16 (round to nearest, ties to even) on the CPU.
///
/// Ownership: `in` and `out` are caller buffers of `n` elements, only used
/// during the call; (NULL, 0) is an empty buffer.
///
/// Thread safety: may be called from any thread; buffers must not overlap.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_LIMIT_EXCEEDED`.
#[no_mangle]
pub extern "C" fn gwtf_quantize_bf16_host(
    input: *const f32,
    out: *mut u16,
    n: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        // SAFETY: per the documented contract.
        let (x, o) = unsafe { (host_slice(input, n, "in")?, host_slice_mut(out, n, "out")?) };
        cpu::f32_to_bf16(o, x);
        Ok(())
    })
}

/// Converts `n` bf16 values back to floats (exact) on the CPU.
///
/// Ownership: caller buffers of `n` elements, used only during the call.
///
/// Thread safety: may be called from any thread; buffers must not overlap.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_LIMIT_EXCEEDED`.
#[no_mangle]
pub extern "C" fn gwtf_dequantize_bf16_host(
    input: *const u16,
    out: *mut f32,
    n: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        // SAFETY: per the documented contract.
        let (x, o) = unsafe { (host_slice(input, n, "in")?, host_slice_mut(out, n, "out")?) };
        cpu::bf16_to_f32(o, x);
        Ok(())
    })
}

/// Blockwise int8 quantization of `n` floats on the CPU: `codes` gets `n`
/// values, `scales` one f32 per block of `block` values
/// (`scales_len` must be `ceil(n / block)`).
///
/// Ownership: caller buffers, used only during the call.
///
/// Thread safety: may be called from any thread; buffers must not overlap.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT`
/// (block 0), `GWTF_STATUS_BUFFER_TOO_SMALL` (wrong `scales_len`),
/// `GWTF_STATUS_LIMIT_EXCEEDED`.
#[no_mangle]
pub extern "C" fn gwtf_quantize_int8_host(
    input: *const f32,
    codes: *mut i8,
    scales: *mut f32,
    scales_len: usize,
    n: usize,
    block: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        check_block(n, block, scales_len)?;
        // SAFETY: per the documented contract.
        let (x, q, s) = unsafe {
            (
                host_slice(input, n, "in")?,
                host_slice_mut(codes, n, "codes")?,
                host_slice_mut(scales, scales_len, "scales")?,
            )
        };
        cpu::quantize_int8(q, s, x, block as usize).map_err(model_err)
    })
}

/// Inverse of `gwtf_quantize_int8_host`: `out[i] = codes[i] * scales[i / block]`.
///
/// Ownership: caller buffers, used only during the call.
///
/// Thread safety: may be called from any thread; buffers must not overlap.
///
/// Errors: as `gwtf_quantize_int8_host`.
#[no_mangle]
pub extern "C" fn gwtf_dequantize_int8_host(
    codes: *const i8,
    scales: *const f32,
    scales_len: usize,
    out: *mut f32,
    n: usize,
    block: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        check_block(n, block, scales_len)?;
        // SAFETY: per the documented contract.
        let (q, s, o) = unsafe {
            (
                host_slice(codes, n, "codes")?,
                host_slice(scales, scales_len, "scales")?,
                host_slice_mut(out, n, "out")?,
            )
        };
        cpu::dequantize_int8(o, q, s, block as usize).map_err(model_err)
    })
}

/// Weighted average of `count` buffers of `n` floats on the CPU:
/// `out = sum_j (weights[j] / sum(weights)) * inputs[j]` (stage aggregation,
/// weights = microbatches each replica processed).
///
/// Ownership: `inputs` is an array of `count` pointers to caller buffers; all
/// are only read during the call. `out` may not alias an input.
///
/// Thread safety: may be called from any thread.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_INVALID_ARGUMENT` (count 0,
/// negative or non-finite weights, weights summing to 0),
/// `GWTF_STATUS_LIMIT_EXCEEDED`.
#[no_mangle]
pub extern "C" fn gwtf_average_host(
    inputs: *const *const f32,
    weights: *const f32,
    count: usize,
    out: *mut f32,
    n: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        if count == 0 {
            return Err(FfiError::invalid("count must be > 0"));
        }
        // SAFETY: per the documented contract.
        let (ptrs, w, o) = unsafe {
            (
                host_slice(inputs, count, "inputs")?,
                host_slice(weights, count, "weights")?,
                host_slice_mut(out, n, "out")?,
            )
        };
        let mut bufs = Vec::with_capacity(count);
        for (j, &p) in ptrs.iter().enumerate() {
            // SAFETY: each input pointer is valid for n floats per the contract.
            bufs.push(unsafe { host_slice(p, n, &format!("inputs[{j}]"))? });
        }
        cpu::weighted_average(o, &bufs, w).map_err(model_err)
    })
}

/// A CUDA device with libgwtf's kernels loaded (opaque).
pub struct gwtf_gpu {
    header: HandleHeader,
    gpu: Mutex<Gpu>,
}

impl FfiHandle for gwtf_gpu {
    const MAGIC: u64 = 0x6777_7466_6770_7521; // "gwtfgpu!"
    const NAME: &'static str = "gwtf_gpu";
    fn header(&self) -> &HandleHeader {
        &self.header
    }
}

fn gpu_err(e: GpuError) -> FfiError {
    let status = match e {
        GpuError::Unavailable(_) => gwtf_status::CudaUnavailable,
        GpuError::Nvrtc(crate::cuda::nvrtc::NvrtcError::Unavailable(_)) => {
            gwtf_status::CudaUnavailable
        }
        GpuError::Invalid(_) => gwtf_status::InvalidArgument,
        _ => gwtf_status::CudaError,
    };
    FfiError::new(status, e.to_string())
}

/// Opens CUDA device `ordinal` (on its primary context, the one the CUDA
/// runtime API uses) and compiles libgwtf's kernels for it with NVRTC.
///
/// Ownership: the caller owns `*out_gpu` and frees it with `gwtf_gpu_free`.
///
/// Thread safety: any thread; the object serialises the calls made on it.
///
/// Errors: `GWTF_STATUS_CUDA_UNAVAILABLE` (no driver, no device, no NVRTC:
/// the message says which), `GWTF_STATUS_CUDA_ERROR`,
/// `GWTF_STATUS_INVALID_ARGUMENT` (no such ordinal), `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_gpu_new(
    ordinal: u32,
    out_gpu: *mut *mut gwtf_gpu,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard(out_err, || {
        super::boundary::require_out(out_gpu, "out_gpu")?;
        let gpu = Gpu::new(ordinal as usize).map_err(gpu_err)?;
        let h = gwtf_gpu {
            header: HandleHeader::new(gwtf_gpu::MAGIC),
            gpu: Mutex::new(gpu),
        };
        // SAFETY: checked non-NULL.
        unsafe { super::boundary::write_out(out_gpu, h.into_raw()) };
        Ok(())
    })
}

/// Frees a `gwtf_gpu`. `gwtf_gpu_free(NULL)` does nothing.
///
/// Ownership: takes ownership of `gpu`.
///
/// Thread safety: no other thread may use `gpu` during or after this call.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_gpu_free(gpu: *mut gwtf_gpu) {
    // SAFETY: NULL or a pointer from gwtf_gpu_new, once.
    unsafe { super::boundary::free_handle(gpu) }
}

fn device_ptr(p: *const c_void, n: usize, what: &str) -> FfiResult<u64> {
    if n > MAX_ELEMENTS {
        return Err(FfiError::new(
            gwtf_status::LimitExceeded,
            format!("{what}: {n} elements is more than the limit of {MAX_ELEMENTS}"),
        ));
    }
    if p.is_null() && n > 0 {
        return Err(FfiError::null(what));
    }
    Ok(p as u64)
}

/// Runs a device operation on a gwtf_gpu (the handle is checked first).
fn with_gpu(
    out_err: *mut *mut gwtf_error,
    gpu: *const gwtf_gpu,
    op: impl FnOnce(&Gpu) -> FfiResult<()>,
) -> gwtf_status {
    guard_handle(out_err, gpu, |g| op(&g.gpu.lock()))
}

/// `gwtf_quantize_bf16_host` on device memory: `in` holds `n` floats and `out`
/// `n` uint16 on `gpu`'s device. Returns when the kernel has finished.
///
/// Ownership: the device buffers stay the caller's.
///
/// Thread safety: calls on one `gwtf_gpu` are serialised.
///
/// Errors: `GWTF_STATUS_NULL_POINTER`, `GWTF_STATUS_CUDA_ERROR`,
/// `GWTF_STATUS_LIMIT_EXCEEDED`, `GWTF_STATUS_POISONED`.
#[no_mangle]
pub extern "C" fn gwtf_quantize_bf16_device(
    gpu: *const gwtf_gpu,
    input: *const c_void,
    out: *mut c_void,
    n: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_gpu(out_err, gpu, |g| {
        let (i, o) = (device_ptr(input, n, "in")?, device_ptr(out, n, "out")?);
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller promises device buffers of n elements.
        unsafe { g.f32_to_bf16(i, o, n as u64) }.map_err(gpu_err)
    })
}

/// `gwtf_dequantize_bf16_host` on device memory.
///
/// Ownership: the device buffers stay the caller's.
///
/// Thread safety: calls on one `gwtf_gpu` are serialised.
///
/// Errors: as `gwtf_quantize_bf16_device`.
#[no_mangle]
pub extern "C" fn gwtf_dequantize_bf16_device(
    gpu: *const gwtf_gpu,
    input: *const c_void,
    out: *mut c_void,
    n: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_gpu(out_err, gpu, |g| {
        let (i, o) = (device_ptr(input, n, "in")?, device_ptr(out, n, "out")?);
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller promises device buffers of n elements.
        unsafe { g.bf16_to_f32(i, o, n as u64) }.map_err(gpu_err)
    })
}

/// `gwtf_quantize_int8_host` on device memory (`scales_len` must be
/// `ceil(n / block)`).
///
/// Ownership: the device buffers stay the caller's.
///
/// Thread safety: calls on one `gwtf_gpu` are serialised.
///
/// Errors: as `gwtf_quantize_int8_host`, plus `GWTF_STATUS_CUDA_ERROR`.
#[no_mangle]
pub extern "C" fn gwtf_quantize_int8_device(
    gpu: *const gwtf_gpu,
    input: *const c_void,
    codes: *mut c_void,
    scales: *mut c_void,
    scales_len: usize,
    n: usize,
    block: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_gpu(out_err, gpu, |g| {
        check_block(n, block, scales_len)?;
        let i = device_ptr(input, n, "in")?;
        let q = device_ptr(codes, n, "codes")?;
        let s = device_ptr(scales, scales_len, "scales")?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller promises device buffers of the documented sizes.
        unsafe { g.quantize_int8(i, q, s, n as u64, block) }.map_err(gpu_err)
    })
}

/// `gwtf_dequantize_int8_host` on device memory.
///
/// Ownership: the device buffers stay the caller's.
///
/// Thread safety: calls on one `gwtf_gpu` are serialised.
///
/// Errors: as `gwtf_quantize_int8_device`.
#[no_mangle]
pub extern "C" fn gwtf_dequantize_int8_device(
    gpu: *const gwtf_gpu,
    codes: *const c_void,
    scales: *const c_void,
    scales_len: usize,
    out: *mut c_void,
    n: usize,
    block: u32,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    with_gpu(out_err, gpu, |g| {
        check_block(n, block, scales_len)?;
        let q = device_ptr(codes, n, "codes")?;
        let s = device_ptr(scales, scales_len, "scales")?;
        let o = device_ptr(out, n, "out")?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller promises device buffers of the documented sizes.
        unsafe { g.dequantize_int8(q, s, o, n as u64, block) }.map_err(gpu_err)
    })
}

/// `gwtf_average_host` on device memory: `inputs` is a HOST array of `count`
/// DEVICE pointers, `weights` a host array of `count` floats, `out` a device
/// buffer of `n` floats.
///
/// Ownership: all buffers stay the caller's.
///
/// Thread safety: calls on one `gwtf_gpu` are serialised.
///
/// Errors: as `gwtf_average_host`, plus `GWTF_STATUS_CUDA_ERROR`.
#[no_mangle]
pub extern "C" fn gwtf_average_device(
    gpu: *const gwtf_gpu,
    inputs: *const *const c_void,
    weights: *const f32,
    count: usize,
    out: *mut c_void,
    n: usize,
    out_err: *mut *mut gwtf_error,
) -> gwtf_status {
    guard_handle(out_err, gpu, |g| {
        if count == 0 {
            return Err(FfiError::invalid("count must be > 0"));
        }
        // SAFETY: host arrays of `count` elements per the contract.
        let (ptrs, w) = unsafe {
            (
                host_slice(inputs, count, "inputs")?,
                host_slice(weights, count, "weights")?,
            )
        };
        let mut dev = Vec::with_capacity(count);
        for (j, &p) in ptrs.iter().enumerate() {
            dev.push(device_ptr(p, n, &format!("inputs[{j}]"))?);
        }
        let o = device_ptr(out, n, "out")?;
        crate::cuda::gpu::normalized_weights(w, count).map_err(gpu_err)?;
        if n == 0 {
            return Ok(());
        }
        let gpu = g.gpu.lock();
        // SAFETY: the caller promises device buffers of n floats.
        unsafe { gpu.weighted_average(&dev, w, o, n as u64) }.map_err(gpu_err)
    })
}
