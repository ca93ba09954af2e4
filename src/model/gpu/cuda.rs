//! [`CudaBackend`]: our kernels and cuBLAS on a CUDA device ([`CudaRunner`]: the NVRTC
//! modules of [`Gpu`] and a [`Blas`] handle on the same stream).
use super::kernel::{KernelBackend, KernelRunner};
use crate::cuda::blas::{Blas, SgemmCall};
use crate::cuda::gpu::{Gpu, GpuError, KernelArg};
use crate::model::ModelError;
use cudarc::driver::{CudaSlice, DevicePtr};

/// [`KernelBackend`] on a CUDA device.
pub type CudaBackend = KernelBackend<CudaRunner>;

/// A CUDA device: every kernel compiled with NVRTC and loaded, a cuBLAS handle on the
/// device's stream.
pub struct CudaRunner {
    gpu: Gpu,
    blas: Blas,
}

pub(crate) fn gpu_err(e: GpuError) -> ModelError {
    match e {
        GpuError::Unavailable(s) => ModelError::DeviceUnavailable(s),
        e => ModelError::Device(e.to_string()),
    }
}

impl KernelBackend<CudaRunner> {
    /// Opens CUDA device `ordinal`: the probe, NVRTC compilation of every kernel, cuBLAS.
    /// No usable device, or no cuBLAS library, is [`ModelError::DeviceUnavailable`] with
    /// the reason (the probe's summary).
    pub fn new(ordinal: usize) -> Result<CudaBackend, ModelError> {
        let gpu = Gpu::new(ordinal).map_err(gpu_err)?;
        let blas = Blas::new(&gpu).map_err(gpu_err)?;
        Ok(KernelBackend::with_runner(CudaRunner { gpu, blas }))
    }
}

impl CudaRunner {
    /// The kernel launcher.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl KernelRunner for CudaRunner {
    type Mem = CudaSlice<u8>;

    fn describe(&self) -> String {
        self.gpu.name().to_string()
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<(CudaSlice<u8>, u64), ModelError> {
        // A zero-byte allocation is an error for the driver: take one byte at least.
        // cuMemAlloc aligns to 256 bytes.
        let slice: CudaSlice<u8> = self
            .gpu
            .stream()
            .alloc_zeros(bytes.max(1))
            .map_err(|e| ModelError::Device(format!("allocate {bytes} bytes: {:?}", e.0)))?;
        let addr = slice.device_ptr(self.gpu.stream()).0;
        Ok((slice, addr))
    }

    unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.gpu.copy_htod(dst, src) }.map_err(gpu_err)
    }

    unsafe fn download(&self, dst: &mut [u8], src: u64) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.gpu.copy_dtoh(dst, src) }.map_err(gpu_err)
    }

    unsafe fn memset_zero(&self, dst: u64, bytes: usize) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.gpu.memset_zero(dst, bytes) }.map_err(gpu_err)
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.gpu.copy_dtod(dst, src, bytes) }.map_err(gpu_err)
    }

    unsafe fn launch(&self, name: &str, grid: u32, args: &[KernelArg]) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.gpu.enqueue(name, grid, args) }.map_err(gpu_err)
    }

    unsafe fn sgemm(&self, call: &SgemmCall) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.blas.sgemm(call) }.map_err(gpu_err)
    }

    fn synchronize(&self) -> Result<(), ModelError> {
        self.gpu.synchronize().map_err(gpu_err)
    }
}
