//! Bandwidth of the CPU kernels against memcpy, measured in the same run and interleaved
//! (one repetition of every kernel per round, rounds until each has run `min_secs`), so
//! that `gwtf bench kernels` can print ratios that do not depend on the machine.
use super::kernels::*;
use rayon::prelude::*;
use std::time::Instant;

/// Options of [`cpu_kernels`].
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// f32 elements per buffer (default 8 Mi = 32 MiB, beyond the caches).
    pub elements: usize,
    /// Minimum seconds of work per kernel (default 0.5).
    pub min_secs: f64,
    /// Block size of the int8 quantization (default 64).
    pub int8_block: usize,
    /// Inputs of the weighted average (default 4).
    pub average_inputs: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            elements: 8 << 20,
            min_secs: 0.5,
            int8_block: 64,
            average_inputs: 4,
        }
    }
}

/// One kernel's result.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelBench {
    /// Kernel name.
    pub name: String,
    /// Bytes read + written per call.
    pub bytes_per_call: u64,
    /// Calls timed.
    pub calls: u64,
    /// Seconds timed.
    pub secs: f64,
    /// Achieved bandwidth, GB/s (1e9 bytes).
    pub gb_per_s: f64,
    /// memcpy bandwidth measured in the same run (parallel copy over the same threads).
    pub memcpy_gb_per_s: f64,
    /// `gb_per_s / memcpy_gb_per_s`.
    pub ratio: f64,
}

/// Parallel copy: the reference (same thread pool and chunking as the kernels).
pub fn par_memcpy(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Measures every memory-bound kernel and memcpy, interleaved. The first entry is memcpy
/// itself (ratio 1).
pub fn cpu_kernels(o: &BenchOptions) -> Vec<KernelBench> {
    let n = o.elements.max(1024);
    let blk = o.int8_block.max(1);
    let na = o.average_inputs.max(1);
    let mut seed = 0x1234_5678u32;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) - 0.5
    };
    let src: Vec<f32> = (0..n).map(|_| rnd()).collect();
    let mut dst = vec![0f32; n];
    let mut bf = vec![0u16; n];
    let mut codes = vec![0i8; n];
    let mut scales = vec![0f32; int8_blocks(n, blk)];
    let avg_in: Vec<Vec<f32>> = (0..na)
        .map(|i| src.iter().map(|x| x + i as f32).collect())
        .collect();
    let weights: Vec<f32> = (0..na).map(|i| (i + 1) as f32).collect();
    let mut p = src.clone();
    let mut m = vec![0f32; n];
    let mut v = vec![0f32; n];
    let opt = AdamW::default();
    let n64 = n as u64;
    let names = [
        ("memcpy", 8 * n64),
        ("f32_to_bf16", 6 * n64),
        ("bf16_to_f32", 6 * n64),
        ("quantize_int8", 5 * n64 + 4 * scales.len() as u64),
        ("dequantize_int8", 5 * n64 + 4 * scales.len() as u64),
        ("weighted_average", 4 * (na as u64 + 1) * n64),
        ("adamw_update", 28 * n64),
    ];
    let mut secs = [0f64; 7];
    let mut calls = [0u64; 7];
    f32_to_bf16(&mut bf, &src); // warm up pages
    quantize_int8(&mut codes, &mut scales, &src, blk).ok();
    par_memcpy(&mut dst, &src);
    let mut step = 0u64;
    while secs.iter().any(|&s| s < o.min_secs) {
        for (k, s) in secs.iter_mut().enumerate() {
            let t = Instant::now();
            match k {
                0 => par_memcpy(&mut dst, &src),
                1 => f32_to_bf16(&mut bf, &src),
                2 => bf16_to_f32(&mut dst, &bf),
                3 => {
                    quantize_int8(&mut codes, &mut scales, &src, blk).ok();
                }
                4 => {
                    dequantize_int8(&mut dst, &codes, &scales, blk).ok();
                }
                5 => {
                    let refs: Vec<&[f32]> = avg_in.iter().map(|x| &x[..]).collect();
                    weighted_average(&mut dst, &refs, &weights).ok();
                }
                _ => {
                    step += 1;
                    adamw_update(&mut p, &src, &mut m, &mut v, &opt, step, 1.0, true);
                }
            }
            *s += t.elapsed().as_secs_f64();
            calls[k] += 1;
        }
    }
    std::hint::black_box((&dst, &bf, &codes, &p));
    let gbs = |k: usize| names[k].1 as f64 * calls[k] as f64 / secs[k] / 1e9;
    let mc = gbs(0);
    (0..7)
        .map(|k| KernelBench {
            name: names[k].0.to_string(),
            bytes_per_call: names[k].1,
            calls: calls[k],
            secs: secs[k],
            gb_per_s: gbs(k),
            memcpy_gb_per_s: mc,
            ratio: gbs(k) / mc,
        })
        .collect()
}
