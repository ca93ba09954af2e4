//! GPU half of `gwtf bench kernels`: each memory-bound kernel's bandwidth
//! against a device-to-device copy of the same buffer, interleaved.

use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr};
use gwtf::cuda::gpu::Gpu;
use gwtf::model::bench::{BenchOptions, KernelBench};

/// At least 1 GiB of f32 per buffer, so that launch overhead stays small.
const MIN_GPU_ELEMENTS: usize = 256 << 20;

pub fn gpu_kernels(
    gpu: &Gpu,
    o: &BenchOptions,
) -> Result<Vec<KernelBench>, Box<dyn std::error::Error>> {
    let n = o.elements.max(MIN_GPU_ELEMENTS);
    let block = o.int8_block as u32;
    let s = gpu.stream();
    let x: CudaSlice<f32> = s.clone_htod(&vec![1.25f32; n])?;
    let mut y: CudaSlice<f32> = s.alloc_zeros(n)?;
    let z: CudaSlice<f32> = s.clone_htod(&vec![0.5f32; n])?;
    let h: CudaSlice<u16> = s.alloc_zeros(n)?;
    let q: CudaSlice<i8> = s.alloc_zeros(n)?;
    let sc: CudaSlice<f32> = s.alloc_zeros(n.div_ceil(block as usize))?;
    let p = |b: &CudaSlice<f32>| b.device_ptr(s).0;
    let (px, pz) = (p(&x), p(&z));
    let (ph, pq, psc) = (h.device_ptr(s).0, q.device_ptr(s).0, sc.device_ptr(s).0);
    let py = y.device_ptr(s).0;
    let nn = n as u64;
    let f = 4 * n as u64; // bytes of one f32 buffer
    type Op<'a> = (
        &'static str,
        u64,
        Box<dyn Fn() -> Result<(), Box<dyn std::error::Error>> + 'a>,
    );
    // SAFETY (all closures): every pointer is a live allocation of n elements above.
    let ops: Vec<Op> = vec![
        (
            "f32_to_bf16",
            f + f / 2,
            Box::new(move || Ok(unsafe { gpu.f32_to_bf16(px, ph, nn) }?)),
        ),
        (
            "bf16_to_f32",
            f / 2 + f,
            Box::new(move || Ok(unsafe { gpu.bf16_to_f32(ph, py, nn) }?)),
        ),
        (
            "quantize_int8",
            f + f / 4 + 4 * nn.div_ceil(block as u64),
            Box::new(move || Ok(unsafe { gpu.quantize_int8(px, pq, psc, nn, block) }?)),
        ),
        (
            "dequantize_int8",
            f / 4 + 4 * nn.div_ceil(block as u64) + f,
            Box::new(move || Ok(unsafe { gpu.dequantize_int8(pq, psc, py, nn, block) }?)),
        ),
        (
            "weighted_average(2)",
            3 * f,
            Box::new(move || Ok(unsafe { gpu.weighted_average(&[px, pz], &[1.0, 3.0], py, nn) }?)),
        ),
    ];
    // Warm-up, then rounds of: one copy, then each kernel once.
    s.memcpy_dtod(&x, &mut y)?;
    s.synchronize()?;
    for (_, _, op) in &ops {
        op()?;
    }
    let mut copy_secs = 0.0;
    let mut secs = vec![0.0f64; ops.len()];
    let mut rounds = 0u64;
    let start = Instant::now();
    while rounds < 5 || start.elapsed().as_secs_f64() < o.min_secs * (ops.len() + 1) as f64 {
        let t = Instant::now();
        s.memcpy_dtod(&x, &mut y)?;
        s.synchronize()?;
        copy_secs += t.elapsed().as_secs_f64();
        for (k, (_, _, op)) in ops.iter().enumerate() {
            let t = Instant::now();
            op()?;
            secs[k] += t.elapsed().as_secs_f64();
        }
        rounds += 1;
    }
    let copy_gbps = (2 * f * rounds) as f64 / copy_secs / 1e9;
    let mut rows = vec![KernelBench {
        name: format!("device-to-device copy ({})", gpu.name()),
        bytes_per_call: 2 * f,
        calls: rounds,
        secs: copy_secs,
        gb_per_s: copy_gbps,
        memcpy_gb_per_s: copy_gbps,
        ratio: 1.0,
    }];
    for ((name, bytes, _), t) in ops.iter().zip(secs) {
        let gbps = (bytes * rounds) as f64 / t / 1e9;
        rows.push(KernelBench {
            name: name.to_string(),
            bytes_per_call: *bytes,
            calls: rounds,
            secs: t,
            gb_per_s: gbps,
            memcpy_gb_per_s: copy_gbps,
            ratio: gbps / copy_gbps,
        });
    }
    Ok(rows)
}
