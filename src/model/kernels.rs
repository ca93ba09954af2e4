//! CPU twins of the kernels the CUDA side implements, with the exact semantics the GPU
//! kernels must match. All are plain functions over slices, parallel over chunks (rayon).
//!
//! - [`f32_to_bf16`] / [`bf16_to_f32`]: round-to-nearest-even; NaN stays NaN (quieted, sign
//!   kept), ±inf stays ±inf, finite values beyond the bf16 range round to ±inf.
//! - [`quantize_int8`] / [`dequantize_int8`]: blockwise symmetric int8, one f32 scale per
//!   block: `scale = absmax / 127` over the block's finite values, `q = clamp(rne(x / scale),
//!   -127, 127)`; an all-zero block has scale 0 and codes 0. NaN encodes as 0, +inf as 127,
//!   -inf as -127 (infinities do not take part in absmax). `x' = q * scale`, so for finite
//!   inputs `|x - x'| <= scale / 2` (plus one rounding of the product).
//! - [`weighted_average`]: `out = sum_j (w_j / sum w) * in_j`, summed in order j = 0..N.
//! - [`adamw_update`]: fused AdamW with bias correction and decoupled weight decay.
use super::ModelError;
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// One f32 to bf16 bits, round-to-nearest-even.
#[inline]
pub fn f32_to_bf16_one(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

/// One bf16 to f32 (exact).
#[inline]
pub fn bf16_to_f32_one(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `out[i] = bf16(inp[i])`. Panics if lengths differ.
pub fn f32_to_bf16(out: &mut [u16], inp: &[f32]) {
    assert_eq!(out.len(), inp.len(), "f32_to_bf16: length mismatch");
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = f32_to_bf16_one(x);
            }
        });
}

/// `out[i] = f32(inp[i])`. Panics if lengths differ.
pub fn bf16_to_f32(out: &mut [f32], inp: &[u16]) {
    assert_eq!(out.len(), inp.len(), "bf16_to_f32: length mismatch");
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = bf16_to_f32_one(x);
            }
        });
}

/// Number of blocks (scales) for `n` values in blocks of `block`.
pub fn int8_blocks(n: usize, block: usize) -> usize {
    n.div_ceil(block.max(1))
}

/// Round to nearest, ties to even, of |y| <= 2^22 (here |y| <= 127), as an integer:
/// adding 1.5 * 2^23 leaves the rounding to the FPU's default mode and puts the integer in
/// the low mantissa bits (no libm call and no saturating float->int cast, so the loop
/// vectorizes; `round_ties_even` is a libcall on baseline x86-64).
#[inline(always)]
fn rne_small(y: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    (y + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

#[inline(always)]
fn quant_block_body(q: &mut [i8], x: &[f32]) -> f32 {
    // Eight independent lanes so the reduction vectorizes (maxps); non-finite -> 0.
    let mut lanes = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            let a = c[i].abs();
            let a = if a < f32::INFINITY { a } else { 0.0 };
            lanes[i] = if a > lanes[i] { a } else { lanes[i] };
        }
    }
    for &v in chunks.remainder() {
        let a = v.abs();
        let a = if a < f32::INFINITY { a } else { 0.0 };
        lanes[0] = if a > lanes[0] { a } else { lanes[0] };
    }
    let absmax = lanes.iter().fold(0.0f32, |m, &a| if a > m { a } else { m });
    let scale = absmax / 127.0;
    for (q, &v) in q.iter_mut().zip(x) {
        // NaN input and 0/0 (all-zero block) give NaN here -> code 0; +-inf saturate.
        let y = v / scale;
        let y = if y.is_nan() { 0.0 } else { y };
        *q = rne_small(y.clamp(-127.0, 127.0)) as i8;
    }
    scale
}

/// The same loop compiled for AVX2 (8 lanes), chosen at run time. IEEE
/// division, min/max and the rounding trick give identical bits on any
/// instruction set (Rust never contracts into FMA), so only speed changes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quant_block_avx2(q: &mut [i8], x: &[f32]) -> f32 {
    quant_block_body(q, x)
}

fn quant_block(q: &mut [i8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { quant_block_avx2(q, x) };
        }
    }
    quant_block_body(q, x)
}

/// Blockwise int8 quantization of `inp` into `codes` (same length) and `scales`
/// (`int8_blocks(len, block)` entries). The last block may be shorter.
pub fn quantize_int8(
    codes: &mut [i8],
    scales: &mut [f32],
    inp: &[f32],
    block: usize,
) -> Result<(), ModelError> {
    check_int8(codes.len(), scales.len(), inp.len(), block)?;
    // Parallel over groups of whole blocks (~CHUNK values), sequential inside a group.
    let per = (CHUNK / block).max(1);
    codes
        .par_chunks_mut(block * per)
        .zip(scales.par_chunks_mut(per))
        .zip(inp.par_chunks(block * per))
        .for_each(|((q, s), x)| {
            for ((q, s), x) in q.chunks_mut(block).zip(s.iter_mut()).zip(x.chunks(block)) {
                *s = quant_block(q, x);
            }
        });
    Ok(())
}

/// Inverse of [`quantize_int8`]: `out[i] = codes[i] * scales[i / block]`.
pub fn dequantize_int8(
    out: &mut [f32],
    codes: &[i8],
    scales: &[f32],
    block: usize,
) -> Result<(), ModelError> {
    check_int8(codes.len(), scales.len(), out.len(), block)?;
    let per = (CHUNK / block).max(1);
    out.par_chunks_mut(block * per)
        .zip(scales.par_chunks(per))
        .zip(codes.par_chunks(block * per))
        .for_each(|((o, s), q)| {
            for ((o, &s), q) in o.chunks_mut(block).zip(s).zip(q.chunks(block)) {
                for (o, &q) in o.iter_mut().zip(q) {
                    *o = q as f32 * s;
                }
            }
        });
    Ok(())
}

fn check_int8(codes: usize, scales: usize, n: usize, block: usize) -> Result<(), ModelError> {
    if block == 0 {
        return Err(ModelError::InvalidConfig(
            "int8 block size must be > 0".into(),
        ));
    }
    if codes != n {
        return Err(ModelError::ShapeMismatch {
            what: "int8 codes",
            expected: n,
            got: codes,
        });
    }
    let nb = int8_blocks(n, block);
    if scales != nb {
        return Err(ModelError::ShapeMismatch {
            what: "int8 scales",
            expected: nb,
            got: scales,
        });
    }
    Ok(())
}

/// `out = sum_j (weights[j] / sum(weights)) * inputs[j]`. Weights must be finite, >= 0 and
/// sum to > 0; all inputs must have `out.len()` elements.
pub fn weighted_average(
    out: &mut [f32],
    inputs: &[&[f32]],
    weights: &[f32],
) -> Result<(), ModelError> {
    if inputs.is_empty() || inputs.len() != weights.len() {
        return Err(ModelError::InvalidConfig(format!(
            "weighted_average: {} inputs, {} weights",
            inputs.len(),
            weights.len()
        )));
    }
    if weights.iter().any(|w| !w.is_finite() || *w < 0.0) {
        return Err(ModelError::InvalidConfig(
            "weights must be finite and >= 0".into(),
        ));
    }
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    if total <= 0.0 {
        return Err(ModelError::InvalidConfig("weights sum to 0".into()));
    }
    for x in inputs {
        if x.len() != out.len() {
            return Err(ModelError::ShapeMismatch {
                what: "weighted_average input",
                expected: out.len(),
                got: x.len(),
            });
        }
    }
    let nw: Vec<f32> = weights.iter().map(|&w| (w as f64 / total) as f32).collect();
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, o)| {
        let base = ci * CHUNK;
        let len = o.len();
        let x0 = &inputs[0][base..base + len];
        for (o, &x) in o.iter_mut().zip(x0) {
            *o = nw[0] * x;
        }
        for (x, &w) in inputs.iter().zip(&nw).skip(1) {
            for (o, &x) in o.iter_mut().zip(&x[base..base + len]) {
                *o += w * x;
            }
        }
    });
    Ok(())
}

/// AdamW hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay (applied to tensors marked `decay`).
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// Fused AdamW step `t` (1-based) on one tensor:
/// `g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
/// p -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd * p)` where `wd` is
/// `opt.weight_decay` when `decay` else 0. Panics if lengths differ.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    opt: &AdamW,
    t: u64,
    grad_scale: f32,
    decay: bool,
) {
    let n = params.len();
    assert!(
        grads.len() == n && m.len() == n && v.len() == n,
        "adamw_update: length mismatch"
    );
    let t = t.max(1) as i32;
    let bc1 = 1.0 - opt.beta1.powi(t);
    let bc2 = 1.0 - opt.beta2.powi(t);
    let wd = if decay { opt.weight_decay } else { 0.0 };
    let (b1, b2, lr, eps) = (opt.beta1, opt.beta2, opt.lr, opt.eps);
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                let g = g[i] * grad_scale;
                let mi = b1 * m[i] + (1.0 - b1) * g;
                let vi = b2 * v[i] + (1.0 - b2) * g * g;
                m[i] = mi;
                v[i] = vi;
                let mhat = mi / bc1;
                let vhat = vi / bc2;
                p[i] -= lr * (mhat / (vhat.sqrt() + eps) + wd * p[i]);
            }
        });
}
