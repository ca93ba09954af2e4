//! Every CUDA kernel against its CPU twin, and GPU training against CPU
//! training, on a real device.
//!
//! Without a GPU every test is recorded as skipped (common/skip.rs); with
//! `GWTF_REQUIRE_GPU=1` (set when running on a GPU machine) a missing device
//! fails instead, so a GPU run cannot skip silently. Exact kernels (bf16,
//! int8, average, AdamW, RoPE, embedding, residual and bias adds,
//! cross-entropy backward) must match bit for bit; the others within the
//! tolerances stated in common/backend_check.rs (cuBLAS and tree-ordered
//! reductions sum in another order, libdevice expf/tanhf differ by an ulp or
//! two). The same op and training checks run without a GPU on the emulated
//! device (tests/cuda_emulated.rs).
#![cfg(feature = "cuda")]

#[path = "common/skip.rs"]
mod skip;

#[path = "common/backend_check.rs"]
mod backend_check;

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};
use gwtf::cuda::gpu::{elementwise_grid, per_row_grid, Gpu, KernelArg::*};
use gwtf::model::gpu::{Backend, CudaBackend};
use gwtf::model::{kernels as cpu, ops, AdamW};
use std::sync::Arc;

fn skip_or_fail(e: &dyn std::fmt::Display) {
    if std::env::var_os("GWTF_REQUIRE_GPU").is_some() {
        panic!("GWTF_REQUIRE_GPU is set but: {e}");
    }
    skip::skipped(&format!("no GPU: {e}"));
}

fn gpu_or_skip() -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) => {
            skip_or_fail(&e);
            None
        }
    }
}

/// The training backend: our kernels and cuBLAS on device 0.
fn backend_or_skip() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            skip_or_fail(&e);
            None
        }
    }
}

/// Deterministic test data with a spread of magnitudes, signs and a few specials.
fn data(n: usize, seed: u64, specials: bool) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            let v = ((u - 0.5) * 8.0) as f32 * if i % 97 == 0 { 1000.0 } else { 1.0 };
            if specials && i % 1009 == 5 {
                [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0][i % 5]
            } else {
                v
            }
        })
        .collect()
}

fn up<T: DeviceRepr>(g: &Gpu, x: &[T]) -> CudaSlice<T> {
    g.stream().clone_htod(x).unwrap()
}
fn zeros<T: DeviceRepr + ValidAsZeroBits>(g: &Gpu, n: usize) -> CudaSlice<T> {
    g.stream().alloc_zeros(n).unwrap()
}
fn down<T: DeviceRepr + Clone + Default>(g: &Gpu, x: &CudaSlice<T>) -> Vec<T> {
    g.stream().clone_dtoh(x).unwrap()
}
fn ptr<T>(g: &Gpu, x: &CudaSlice<T>) -> u64 {
    x.device_ptr(g.stream()).0
}

fn assert_close(what: &str, gpu: &[f32], cpu: &[f32], rel: f32, abs: f32) {
    assert_eq!(gpu.len(), cpu.len());
    for (i, (&a, &b)) in gpu.iter().zip(cpu).enumerate() {
        let ok = (a - b).abs() <= abs + rel * b.abs() || (a.is_nan() && b.is_nan());
        assert!(ok, "{what}[{i}]: gpu {a} cpu {b}");
    }
}

fn assert_bits(what: &str, gpu: &[f32], cpu: &[f32]) {
    for (i, (a, b)) in gpu.iter().zip(cpu).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}[{i}]: gpu {a} cpu {b}");
    }
}

#[test]
fn bf16_and_int8_match_cpu_bit_for_bit() {
    let Some(g) = gpu_or_skip() else { return };
    let n = (1 << 20) + 13;
    let x = data(n, 1, true);
    let dx = up(&g, &x);
    let mut want16 = vec![0u16; n];
    cpu::f32_to_bf16(&mut want16, &x);
    let d16 = zeros::<u16>(&g, n);
    unsafe { g.f32_to_bf16(ptr(&g, &dx), ptr(&g, &d16), n as u64) }.unwrap();
    assert_eq!(down(&g, &d16), want16);
    let dback = zeros::<f32>(&g, n);
    unsafe { g.bf16_to_f32(ptr(&g, &d16), ptr(&g, &dback), n as u64) }.unwrap();
    let mut want = vec![0f32; n];
    cpu::bf16_to_f32(&mut want, &want16);
    assert_bits("bf16_to_f32", &down(&g, &dback), &want);

    for block in [1usize, 32, 64, 1000, 4096] {
        let nb = cpu::int8_blocks(n, block);
        let (mut q, mut s) = (vec![0i8; n], vec![0f32; nb]);
        cpu::quantize_int8(&mut q, &mut s, &x, block).unwrap();
        let (dq, ds) = (zeros::<i8>(&g, n), zeros::<f32>(&g, nb));
        unsafe {
            g.quantize_int8(
                ptr(&g, &dx),
                ptr(&g, &dq),
                ptr(&g, &ds),
                n as u64,
                block as u32,
            )
        }
        .unwrap();
        assert_eq!(down(&g, &dq), q, "codes, block {block}");
        assert_bits("scales", &down(&g, &ds), &s);
        let dout = zeros::<f32>(&g, n);
        unsafe {
            g.dequantize_int8(
                ptr(&g, &dq),
                ptr(&g, &ds),
                ptr(&g, &dout),
                n as u64,
                block as u32,
            )
        }
        .unwrap();
        let mut back = vec![0f32; n];
        cpu::dequantize_int8(&mut back, &q, &s, block).unwrap();
        assert_bits("dequantize", &down(&g, &dout), &back);
    }
}

#[test]
fn weighted_average_and_adamw_match_cpu_bit_for_bit() {
    let Some(g) = gpu_or_skip() else { return };
    let n = 300_001;
    let xs: Vec<Vec<f32>> = (0..5).map(|j| data(n, 10 + j, false)).collect();
    let w = [3.0f32, 1.0, 0.0, 7.5, 2.0];
    let dxs: Vec<_> = xs.iter().map(|x| up(&g, x)).collect();
    let ptrs: Vec<u64> = dxs.iter().map(|d| ptr(&g, d)).collect();
    let dout = zeros::<f32>(&g, n);
    unsafe { g.weighted_average(&ptrs, &w, ptr(&g, &dout), n as u64) }.unwrap();
    let mut want = vec![0f32; n];
    let refs: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
    cpu::weighted_average(&mut want, &refs, &w).unwrap();
    assert_bits("weighted_average", &down(&g, &dout), &want);

    let opt = AdamW::default();
    let (mut p, grad) = (data(n, 20, false), data(n, 21, false));
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let (dp, dg, dm, dv) = (up(&g, &p), up(&g, &grad), up(&g, &m), up(&g, &v));
    for t in 1..=3u64 {
        cpu::adamw_update(&mut p, &grad, &mut m, &mut v, &opt, t, 0.5, true);
        let ti = t as i32;
        let (bc1, bc2) = (1.0 - opt.beta1.powi(ti), 1.0 - opt.beta2.powi(ti));
        unsafe {
            g.launch(
                "gwtf_adamw",
                elementwise_grid(n as u64),
                &[
                    Ptr(ptr(&g, &dp)),
                    Ptr(ptr(&g, &dg)),
                    Ptr(ptr(&g, &dm)),
                    Ptr(ptr(&g, &dv)),
                    U64(n as u64),
                    F32(opt.lr),
                    F32(opt.beta1),
                    F32(opt.beta2),
                    F32(opt.eps),
                    F32(opt.weight_decay),
                    F32(bc1),
                    F32(bc2),
                    F32(0.5),
                ],
            )
        }
        .unwrap();
    }
    assert_bits("adamw params", &down(&g, &dp), &p);
    assert_bits("adamw m", &down(&g, &dm), &m);
    assert_bits("adamw v", &down(&g, &dv), &v);
}

#[test]
fn norms_activations_rope_softmax_match_cpu() {
    let Some(g) = gpu_or_skip() else { return };
    let (rows, c) = (257usize, 384usize);
    let x = data(rows * c, 30, false);
    let w = data(c, 31, false);
    let b = data(c, 32, false);
    let dout = data(rows * c, 33, false);
    let (dx, dw, db, dd) = (up(&g, &x), up(&g, &w), up(&g, &b), up(&g, &dout));
    let eps = 1e-5f32;

    // RMSNorm forward / backward.
    let (mut out, mut rstd) = (vec![0f32; rows * c], vec![0f32; rows]);
    ops::rmsnorm_forward(&mut out, &mut rstd, &x, &w, c, eps as f64);
    let (gout, grstd) = (zeros::<f32>(&g, rows * c), zeros::<f32>(&g, rows));
    unsafe {
        g.launch(
            "gwtf_rmsnorm_forward",
            per_row_grid(rows as u64),
            &[
                Ptr(ptr(&g, &gout)),
                Ptr(ptr(&g, &grstd)),
                Ptr(ptr(&g, &dx)),
                Ptr(ptr(&g, &dw)),
                U64(rows as u64),
                U32(c as u32),
                F32(eps),
            ],
        )
    }
    .unwrap();
    assert_close("rmsnorm out", &down(&g, &gout), &out, 1e-5, 1e-5);
    let (mut dinp, mut dwt) = (vec![0f32; rows * c], vec![0f32; c]);
    ops::rmsnorm_backward(&mut dinp, &mut dwt, &dout, &x, &w, &rstd, c);
    let (gdinp, gdw) = (zeros::<f32>(&g, rows * c), zeros::<f32>(&g, c));
    unsafe {
        g.launch(
            "gwtf_rmsnorm_backward",
            per_row_grid(rows as u64),
            &[
                Ptr(ptr(&g, &gdinp)),
                Ptr(ptr(&g, &gdw)),
                Ptr(ptr(&g, &dd)),
                Ptr(ptr(&g, &dx)),
                Ptr(ptr(&g, &dw)),
                Ptr(ptr(&g, &grstd)),
                U64(rows as u64),
                U32(c as u32),
            ],
        )
    }
    .unwrap();
    assert_close("rmsnorm dinp", &down(&g, &gdinp), &dinp, 1e-4, 1e-4);
    assert_close("rmsnorm dw", &down(&g, &gdw), &dwt, 1e-3, 1e-2);

    // LayerNorm forward.
    let (mut out, mut mean, mut rs) = (vec![0f32; rows * c], vec![0f32; rows], vec![0f32; rows]);
    ops::layernorm_forward(&mut out, &mut mean, &mut rs, &x, &w, &b, c, eps as f64);
    let (gout, gmean, grs) = (
        zeros::<f32>(&g, rows * c),
        zeros::<f32>(&g, rows),
        zeros::<f32>(&g, rows),
    );
    unsafe {
        g.launch(
            "gwtf_layernorm_forward",
            per_row_grid(rows as u64),
            &[
                Ptr(ptr(&g, &gout)),
                Ptr(ptr(&g, &gmean)),
                Ptr(ptr(&g, &grs)),
                Ptr(ptr(&g, &dx)),
                Ptr(ptr(&g, &dw)),
                Ptr(ptr(&g, &db)),
                U64(rows as u64),
                U32(c as u32),
                F32(eps),
            ],
        )
    }
    .unwrap();
    assert_close("layernorm out", &down(&g, &gout), &out, 1e-4, 1e-4);

    // GELU and SwiGLU.
    let n = rows * c;
    let mut out = vec![0f32; n];
    ops::gelu_forward(&mut out, &x);
    let gout = zeros::<f32>(&g, n);
    unsafe {
        g.launch(
            "gwtf_gelu_forward",
            elementwise_grid(n as u64),
            &[Ptr(ptr(&g, &gout)), Ptr(ptr(&g, &dx)), U64(n as u64)],
        )
    }
    .unwrap();
    assert_close("gelu", &down(&g, &gout), &out, 1e-5, 1e-6);
    let h = c / 2;
    let mut out = vec![0f32; rows * h];
    ops::swiglu_forward(&mut out, &x, h);
    let gout = zeros::<f32>(&g, rows * h);
    unsafe {
        g.launch(
            "gwtf_swiglu_forward",
            elementwise_grid((rows * h) as u64),
            &[
                Ptr(ptr(&g, &gout)),
                Ptr(ptr(&g, &dx)),
                U64(rows as u64),
                U32(h as u32),
            ],
        )
    }
    .unwrap();
    assert_close("swiglu", &down(&g, &gout), &out, 1e-5, 1e-6);

    // RoPE (table computed as the CPU twin does).
    let (seq, hs, heads) = (16usize, 32usize, 8usize);
    let width = 3 * heads * hs;
    let rrows = 4 * seq;
    let xr = data(rrows * width, 34, false);
    let mut want = vec![0f32; rrows * width];
    ops::rope_forward(&mut want, &xr, seq, width, 2 * heads, hs, 10000.0);
    let half = hs / 2;
    let mut cs = Vec::with_capacity(seq * half * 2);
    for t in 0..seq {
        for j in 0..half {
            let theta = t as f64 * 10000f64.powf(-2.0 * j as f64 / hs as f64);
            cs.push(theta.cos() as f32);
            cs.push(theta.sin() as f32);
        }
    }
    let (dxr, dcs, gout) = (up(&g, &xr), up(&g, &cs), zeros::<f32>(&g, rrows * width));
    unsafe {
        g.launch(
            "gwtf_rope",
            elementwise_grid((rrows * width) as u64),
            &[
                Ptr(ptr(&g, &gout)),
                Ptr(ptr(&g, &dxr)),
                Ptr(ptr(&g, &dcs)),
                U64(rrows as u64),
                U32(seq as u32),
                U32(width as u32),
                U32(2 * heads as u32),
                U32(hs as u32),
                I32(0),
            ],
        )
    }
    .unwrap();
    assert_bits("rope", &down(&g, &gout), &want);

    // Softmax + cross-entropy.
    let (r, v) = (33usize, 1000usize);
    let logits = data(r * v, 35, false);
    let targets: Vec<u32> = (0..r as u32).map(|i| (i * 37) % v as u32).collect();
    let mut probs = vec![0f32; r * v];
    let loss = ops::crossentropy_forward(&mut probs, &logits, &targets, v);
    let (dl, dt) = (up(&g, &logits), up(&g, &targets));
    let (gp, gl) = (zeros::<f32>(&g, r * v), zeros::<f32>(&g, r));
    unsafe {
        g.launch(
            "gwtf_crossentropy_forward",
            per_row_grid(r as u64),
            &[
                Ptr(ptr(&g, &gp)),
                Ptr(ptr(&g, &gl)),
                Ptr(ptr(&g, &dl)),
                Ptr(ptr(&g, &dt)),
                U64(r as u64),
                U32(v as u32),
            ],
        )
    }
    .unwrap();
    assert_close("softmax probs", &down(&g, &gp), &probs, 1e-4, 1e-7);
    let gloss: f64 = down(&g, &gl).iter().map(|&l| l as f64).sum::<f64>() / r as f64;
    assert!(
        (gloss - loss).abs() < 1e-4 * loss.abs().max(1.0),
        "loss gpu {gloss} cpu {loss}"
    );
}

#[test]
fn every_layer_op_matches_its_cpu_twin() {
    let Some(be) = backend_or_skip() else { return };
    backend_check::check_every_op(&be);
}

#[test]
fn gpu_training_matches_cpu_training() {
    let Some(be) = backend_or_skip() else { return };
    let be = Arc::new(be);
    for name in ["gpt-tiny", "llama-tiny"] {
        let worst = backend_check::check_training(be.clone(), name, 3);
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "{name} on {}: largest relative loss difference over 3 steps {worst:e}",
            be.describe()
        );
    }
}
