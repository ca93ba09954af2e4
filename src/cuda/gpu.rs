//! Running the kernels on a CUDA device.
//!
//! [`Gpu`] owns a stream on the device's primary context (the one the CUDA
//! runtime API uses too, so a C++ trainer's `cudaMalloc` pointers are valid
//! here), compiles every kernel unit with NVRTC for the device's architecture
//! and launches them on raw device pointers. The named operations (and
//! `Gpu::launch`) enqueue their kernel and wait for it, so that the caller
//! may reuse the buffers as soon as they return; the trainer uses
//! `Gpu::enqueue` and the copies, which only queue work on the stream, and
//! waits once per step.

use std::fmt;

use super::nvrtc::NvrtcError;

/// Why a GPU operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuError {
    /// No usable device (the probe's summary says why).
    Unavailable(String),
    /// A kernel could not be compiled.
    Nvrtc(NvrtcError),
    /// A CUDA driver call failed (CUDA error name and context).
    Driver(String),
    /// A cuBLAS call failed (cuBLAS status name and context).
    Blas(String),
    /// The arguments do not describe a valid operation.
    Invalid(String),
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unavailable(why) => write!(f, "no usable CUDA device: {why}"),
            Self::Nvrtc(e) => write!(f, "{e}"),
            Self::Driver(e) => write!(f, "CUDA driver error: {e}"),
            Self::Blas(e) => write!(f, "cuBLAS error: {e}"),
            Self::Invalid(e) => write!(f, "invalid kernel arguments: {e}"),
        }
    }
}

impl std::error::Error for GpuError {}

impl From<NvrtcError> for GpuError {
    fn from(e: NvrtcError) -> Self {
        Self::Nvrtc(e)
    }
}

/// One kernel argument, by value (device pointers are `Ptr`).
#[derive(Clone, Copy, Debug)]
pub enum KernelArg {
    Ptr(u64),
    U64(u64),
    U32(u32),
    I32(i32),
    F32(f32),
}

/// Threads per block of every launch (a multiple of 32: the reductions need whole warps).
pub const BLOCK: u32 = 256;

/// The largest grid we launch; kernels loop (grid-stride) over the rest.
const MAX_GRID: u64 = 65_535;

/// Blocks for an elementwise kernel over `n` items.
pub fn elementwise_grid(n: u64) -> u32 {
    n.div_ceil(BLOCK as u64).clamp(1, MAX_GRID) as u32
}

/// Blocks for a kernel with one block per row (or per quantization block).
pub fn per_row_grid(rows: u64) -> u32 {
    rows.clamp(1, MAX_GRID) as u32
}

#[cfg(feature = "cuda")]
pub use imp::Gpu;

/// Without the `cuda` feature a `Gpu` cannot exist; the methods keep the
/// same signatures so that callers compile either way.
#[cfg(not(feature = "cuda"))]
pub struct Gpu {
    never: std::convert::Infallible,
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::missing_safety_doc)]
impl Gpu {
    pub fn new(_ordinal: usize) -> Result<Gpu, GpuError> {
        Err(GpuError::Unavailable(
            "CUDA support is not built into this libgwtf".into(),
        ))
    }
    pub fn name(&self) -> &str {
        match self.never {}
    }
    pub unsafe fn f32_to_bf16(&self, _: u64, _: u64, _: u64) -> Result<(), GpuError> {
        match self.never {}
    }
    pub unsafe fn bf16_to_f32(&self, _: u64, _: u64, _: u64) -> Result<(), GpuError> {
        match self.never {}
    }
    pub unsafe fn quantize_int8(
        &self,
        _: u64,
        _: u64,
        _: u64,
        _: u64,
        _: u32,
    ) -> Result<(), GpuError> {
        match self.never {}
    }
    pub unsafe fn dequantize_int8(
        &self,
        _: u64,
        _: u64,
        _: u64,
        _: u64,
        _: u32,
    ) -> Result<(), GpuError> {
        match self.never {}
    }
    pub unsafe fn weighted_average(
        &self,
        _: &[u64],
        _: &[f32],
        _: u64,
        _: u64,
    ) -> Result<(), GpuError> {
        match self.never {}
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::cuda::kernels::SOURCES;
    use crate::cuda::nvrtc::compile_ptx;
    use crate::cuda::probe::{probe, ProbeDetail, ProbeState};
    use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn driver(what: &str, e: cudarc::driver::DriverError) -> GpuError {
        GpuError::Driver(format!("{what}: {:?}", e.0))
    }

    /// A device with every kernel loaded.
    pub struct Gpu {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        functions: BTreeMap<&'static str, CudaFunction>,
        name: String,
    }

    impl Gpu {
        /// Opens device `ordinal` and compiles and loads every kernel unit.
        pub fn new(ordinal: usize) -> Result<Gpu, GpuError> {
            let report = probe(ProbeDetail::Devices);
            if report.state != ProbeState::Ready {
                return Err(GpuError::Unavailable(report.to_string()));
            }
            let dev = report.devices.get(ordinal).ok_or_else(|| {
                GpuError::Invalid(format!(
                    "device {ordinal} does not exist ({} found)",
                    report.device_count
                ))
            })?;
            let (major, minor) = dev.compute_capability;
            // NVRTC wants a 'static arch name; one per device model is leaked, at most a few.
            let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
            let ctx = CudaContext::new(ordinal).map_err(|e| driver("context", e))?;
            let stream = ctx.default_stream();
            let mut functions = BTreeMap::new();
            for unit in SOURCES {
                let ptx = compile_ptx(unit.file, &unit.full_source(), arch)?;
                let module = ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                    .map_err(|e| driver(unit.file, e))?;
                for &entry in unit.entries {
                    let f = module.load_function(entry).map_err(|e| driver(entry, e))?;
                    functions.insert(entry, f);
                }
            }
            Ok(Gpu {
                ctx,
                stream,
                functions,
                name: dev.name.clone(),
            })
        }

        /// The device's name.
        pub fn name(&self) -> &str {
            &self.name
        }

        /// The context (for tests and benchmarks that allocate device memory).
        pub fn context(&self) -> &Arc<CudaContext> {
            &self.ctx
        }

        /// The stream every kernel runs on.
        pub fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }

        /// Launches kernel `name` and waits for it.
        ///
        /// # Safety
        /// The arguments must match the kernel's parameters, and every `Ptr`
        /// must point to device memory of the size the kernel will touch.
        pub unsafe fn launch(
            &self,
            name: &str,
            grid: u32,
            args: &[KernelArg],
        ) -> Result<(), GpuError> {
            // SAFETY: forwarded to the caller's contract.
            unsafe { self.enqueue(name, grid, args) }?;
            self.stream.synchronize().map_err(|e| driver(name, e))
        }

        /// Queues kernel `name` on the stream without waiting for it: work on
        /// one stream runs in order, so later launches and copies see its
        /// results. Used by the trainer, which waits once per step.
        ///
        /// # Safety
        /// As [`Gpu::launch`], and the memory must stay allocated until the
        /// kernel has run (freeing it stream-ordered, as `CudaSlice` does on a
        /// device with memory pools, is enough).
        pub unsafe fn enqueue(
            &self,
            name: &str,
            grid: u32,
            args: &[KernelArg],
        ) -> Result<(), GpuError> {
            let f = self
                .functions
                .get(name)
                .ok_or_else(|| GpuError::Invalid(format!("no kernel named {name}")))?;
            let mut b = self.stream.launch_builder(f);
            for a in args {
                match a {
                    KernelArg::Ptr(v) | KernelArg::U64(v) => b.arg(v),
                    KernelArg::U32(v) => b.arg(v),
                    KernelArg::I32(v) => b.arg(v),
                    KernelArg::F32(v) => b.arg(v),
                };
            }
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: forwarded to the caller's contract.
            unsafe { b.launch(cfg) }.map_err(|e| driver(name, e))?;
            Ok(())
        }

        /// Queues `bytes` zero bytes at device address `dst`.
        ///
        /// # Safety
        /// `dst` must be device memory of at least `bytes` bytes.
        pub unsafe fn memset_zero(&self, dst: u64, bytes: usize) -> Result<(), GpuError> {
            self.ctx
                .bind_to_thread()
                .map_err(|e| driver("bind context", e))?;
            // SAFETY: caller's contract; the stream belongs to this context.
            unsafe {
                cudarc::driver::result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream())
            }
            .map_err(|e| driver("memset", e))
        }

        /// Copies host values to device address `dst` (for pageable host memory
        /// the copy is staged before this returns, so `src` may be reused).
        ///
        /// # Safety
        /// `dst` must be device memory of at least `src.len()` values of `T`.
        pub unsafe fn copy_htod<T: cudarc::driver::DeviceRepr>(
            &self,
            dst: u64,
            src: &[T],
        ) -> Result<(), GpuError> {
            self.ctx
                .bind_to_thread()
                .map_err(|e| driver("bind context", e))?;
            // SAFETY: caller's contract.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| driver("copy host to device", e))
        }

        /// Queues a device-to-device copy of `bytes` bytes.
        ///
        /// # Safety
        /// Both addresses must be device memory of at least `bytes` bytes, not
        /// overlapping.
        pub unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
            self.ctx
                .bind_to_thread()
                .map_err(|e| driver("bind context", e))?;
            // SAFETY: caller's contract.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
            }
            .map_err(|e| driver("copy device to device", e))
        }

        /// Waits for everything queued, then copies `dst.len()` values from
        /// device address `src` to the host.
        ///
        /// # Safety
        /// `src` must be device memory holding `dst.len()` values of `T`.
        pub unsafe fn copy_dtoh<T: cudarc::driver::DeviceRepr>(
            &self,
            dst: &mut [T],
            src: u64,
        ) -> Result<(), GpuError> {
            self.ctx
                .bind_to_thread()
                .map_err(|e| driver("bind context", e))?;
            // SAFETY: caller's contract.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| driver("copy device to host", e))?;
            self.stream
                .synchronize()
                .map_err(|e| driver("copy device to host", e))
        }

        /// Waits for everything queued on the stream.
        pub fn synchronize(&self) -> Result<(), GpuError> {
            self.stream
                .synchronize()
                .map_err(|e| driver("synchronize", e))
        }

        /// `out[i] = bf16(in[i])` on device pointers.
        ///
        /// # Safety
        /// `input` holds `n` f32 and `out` `n` u16 of device memory.
        pub unsafe fn f32_to_bf16(&self, input: u64, out: u64, n: u64) -> Result<(), GpuError> {
            use KernelArg::*;
            // SAFETY: caller's contract.
            unsafe {
                self.launch(
                    "gwtf_f32_to_bf16",
                    elementwise_grid(n),
                    &[Ptr(input), Ptr(out), U64(n)],
                )
            }
        }

        /// `out[i] = f32(in[i])` on device pointers.
        ///
        /// # Safety
        /// `input` holds `n` u16 and `out` `n` f32 of device memory.
        pub unsafe fn bf16_to_f32(&self, input: u64, out: u64, n: u64) -> Result<(), GpuError> {
            use KernelArg::*;
            // SAFETY: caller's contract.
            unsafe {
                self.launch(
                    "gwtf_bf16_to_f32",
                    elementwise_grid(n),
                    &[Ptr(input), Ptr(out), U64(n)],
                )
            }
        }

        /// Blockwise int8 quantization on device pointers.
        ///
        /// # Safety
        /// `input` holds `n` f32, `codes` `n` i8, `scales` `ceil(n/block)` f32.
        pub unsafe fn quantize_int8(
            &self,
            input: u64,
            codes: u64,
            scales: u64,
            n: u64,
            block: u32,
        ) -> Result<(), GpuError> {
            use KernelArg::*;
            if block == 0 {
                return Err(GpuError::Invalid("int8 block size must be > 0".into()));
            }
            let grid = per_row_grid(n.div_ceil(block as u64));
            // SAFETY: caller's contract.
            unsafe {
                self.launch(
                    "gwtf_quantize_int8",
                    grid,
                    &[Ptr(input), Ptr(codes), Ptr(scales), U64(n), U32(block)],
                )
            }
        }

        /// Blockwise int8 dequantization on device pointers.
        ///
        /// # Safety
        /// `codes` holds `n` i8, `scales` `ceil(n/block)` f32, `out` `n` f32.
        pub unsafe fn dequantize_int8(
            &self,
            codes: u64,
            scales: u64,
            out: u64,
            n: u64,
            block: u32,
        ) -> Result<(), GpuError> {
            use KernelArg::*;
            if block == 0 {
                return Err(GpuError::Invalid("int8 block size must be > 0".into()));
            }
            // SAFETY: caller's contract.
            unsafe {
                self.launch(
                    "gwtf_dequantize_int8",
                    elementwise_grid(n),
                    &[Ptr(codes), Ptr(scales), Ptr(out), U64(n), U32(block)],
                )
            }
        }

        /// `out = sum_j (w_j / sum w) * inputs[j]` on device pointers.
        ///
        /// # Safety
        /// Every input and `out` hold `n` f32 of device memory.
        pub unsafe fn weighted_average(
            &self,
            inputs: &[u64],
            weights: &[f32],
            out: u64,
            n: u64,
        ) -> Result<(), GpuError> {
            use KernelArg::*;
            let normalized = normalized_weights(weights, inputs.len())?;
            let d_ptrs = self
                .stream
                .clone_htod(inputs)
                .map_err(|e| driver("upload input pointers", e))?;
            let d_w = self
                .stream
                .clone_htod(&normalized)
                .map_err(|e| driver("upload weights", e))?;
            use cudarc::driver::DevicePtr;
            let (p_ptrs, _g1) = d_ptrs.device_ptr(&self.stream);
            let (p_w, _g2) = d_w.device_ptr(&self.stream);
            // SAFETY: caller's contract; the two small arrays live until the kernel is done.
            unsafe {
                self.launch(
                    "gwtf_weighted_average",
                    elementwise_grid(n),
                    &[
                        Ptr(p_ptrs),
                        Ptr(p_w),
                        U32(inputs.len() as u32),
                        Ptr(out),
                        U64(n),
                    ],
                )
            }
        }
    }
}

/// Weights normalised as the CPU twin does (in f64, then rounded to f32).
pub fn normalized_weights(weights: &[f32], inputs: usize) -> Result<Vec<f32>, GpuError> {
    if inputs == 0 || weights.len() != inputs {
        return Err(GpuError::Invalid(format!(
            "{inputs} inputs but {} weights",
            weights.len()
        )));
    }
    if inputs > u32::MAX as usize {
        return Err(GpuError::Invalid("too many inputs".into()));
    }
    if weights.iter().any(|w| !w.is_finite() || *w < 0.0) {
        return Err(GpuError::Invalid("weights must be finite and >= 0".into()));
    }
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    if total <= 0.0 {
        return Err(GpuError::Invalid("weights sum to 0".into()));
    }
    Ok(weights.iter().map(|&w| (w as f64 / total) as f32).collect())
}
