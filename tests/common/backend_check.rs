//! A backend of `gwtf::model::gpu` against the CPU: every layer op against the host backend
//! (the kernels' CPU twins in ops.rs), and training against the CPU trainer. Shared by
//! tests/cuda_gpu.rs (the CUDA device) and tests/cuda_emulated.rs (our kernels on a CPU
//! emulation of the device).
//!
//! Tolerances (fp32 everywhere): ops whose kernel adds in the CPU's order (embedding,
//! residual and bias adds, RoPE, AdamW, cross-entropy backward) must match bit for bit.
//! The others differ by summation order (cuBLAS blocking, tree-ordered block reductions,
//! atomics over rows) and by the device's expf/tanhf (an ulp or two): each value must be
//! within `rel * |cpu| + abs * max|cpu|`, with (rel, abs) from 1e-5 for single reductions
//! up to 1e-3 for attention's backward, where `datt - sum(att * datt)` cancels.
#![allow(dead_code)]

use gwtf::model::gpu::*;
use gwtf::model::train::{train, TrainOptions};
use gwtf::model::*;
use std::sync::Arc;

/// Deterministic values in [-scale, scale).
pub fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            ((u * 2.0 - 1.0) * scale as f64) as f32
        })
        .collect()
}

/// Each value within `rel * |want| + abs * max|want|`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let ok = (a - b).abs() <= rel * b.abs() + abs * scale;
        assert!(ok, "{what}[{i}]: device {a} cpu {b} (max |cpu| {scale})");
    }
}

pub fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}[{i}]: device {a} cpu {b}");
    }
}

/// The same values in a device buffer and a host buffer.
pub struct Twin<B: Backend> {
    pub dev: B::Buf,
    pub host: HostBuf<f32>,
}

pub struct Ops<'a, B: Backend> {
    pub dev: &'a B,
    pub host: HostBackend,
}

impl<'a, B: Backend> Ops<'a, B> {
    pub fn new(dev: &'a B) -> Self {
        Ops {
            dev,
            host: HostBackend,
        }
    }
    pub fn twin(&self, x: &[f32]) -> Twin<B> {
        Twin {
            dev: self.dev.upload(x).unwrap(),
            host: self.host.upload(x).unwrap(),
        }
    }
    pub fn rand(&self, n: usize, seed: u64, scale: f32) -> Twin<B> {
        self.twin(&data(n, seed, scale))
    }
    pub fn zeros(&self, n: usize) -> Twin<B> {
        self.twin(&vec![0.0; n])
    }
    pub fn ids(&self, x: &[u32], bound: usize) -> (B::Ids, HostBuf<u32>) {
        assert!(x.iter().all(|&i| (i as usize) < bound));
        (
            self.dev.upload_ids(x).unwrap(),
            self.host.upload_ids(x).unwrap(),
        )
    }
    /// Both buffers' values: (device, host).
    pub fn get(&self, t: &Twin<B>) -> (Vec<f32>, Vec<f32>) {
        (
            self.dev.download_buf(&t.dev).unwrap(),
            self.host.download_buf(&t.host).unwrap(),
        )
    }
    pub fn bits(&self, what: &str, t: &Twin<B>) {
        let (d, h) = self.get(t);
        assert_bits(what, &d, &h);
    }
    pub fn close(&self, what: &str, t: &Twin<B>, rel: f32, abs: f32) {
        let (d, h) = self.get(t);
        assert_close(what, &d, &h, rel, abs);
    }
}

/// Shorthands for the two sides' addresses.
fn d<B: Backend>(t: &Twin<B>) -> DPtr<f32> {
    t.dev.ptr()
}
fn h<B: Backend>(t: &Twin<B>) -> DPtr<f32> {
    t.host.ptr()
}

/// Every layer op of the backend against the host backend, on shapes that are not
/// multiples of the block size (and, for rows and positions, larger than it).
pub fn check_every_op<B: Backend>(dev: &B) {
    let o = Ops::new(dev);
    let hb = &o.host;
    // SAFETY (every unsafe block): all buffers are alive and belong to their backend; ids
    // are checked below their table's rows.
    unsafe {
        // Embedding forward/backward (repeated tokens, GPT positions and none).
        let (rows, seq, c, vocab) = (3 * 37, 37, 48, 50);
        let tok: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + i / 5) % 23).collect();
        let (dt, ht) = o.ids(&tok, vocab);
        let wte = o.rand(vocab * c, 1, 1.0);
        let wpe = o.rand(seq * c, 2, 1.0);
        for with_pos in [true, false] {
            let out = o.rand(rows * c, 3, 1.0);
            let (dp, hp) = (with_pos.then(|| d(&wpe)), with_pos.then(|| h(&wpe)));
            dev.encoder_forward(d(&out), dt.ptr(), d(&wte), dp, seq, c)
                .unwrap();
            hb.encoder_forward(h(&out), ht.ptr(), h(&wte), hp, seq, c)
                .unwrap();
            o.bits("encoder_forward", &out);
            let (dwte, dwpe) = (o.rand(vocab * c, 4, 1.0), o.rand(seq * c, 5, 1.0));
            let (dpe, hpe) = (with_pos.then(|| d(&dwpe)), with_pos.then(|| h(&dwpe)));
            dev.encoder_backward(d(&dwte), dpe, d(&out), dt.ptr(), seq, c)
                .unwrap();
            hb.encoder_backward(h(&dwte), hpe, h(&out), ht.ptr(), seq, c)
                .unwrap();
            o.bits("encoder_backward dwte", &dwte);
            o.bits("encoder_backward dwpe", &dwpe);
        }

        // Residual add.
        let (x, y) = (o.rand(1000, 6, 2.0), o.rand(1000, 7, 2.0));
        dev.add_inplace(d(&x), d(&y)).unwrap();
        hb.add_inplace(h(&x), h(&y)).unwrap();
        o.bits("add_inplace", &x);

        // Linear layers with and without bias (cuBLAS / sgemm plus the bias kernels).
        let (n, ic, oc) = (37, 48, 50);
        let (inp, w, b) = (
            o.rand(n * ic, 8, 1.0),
            o.rand(oc * ic, 9, 0.5),
            o.rand(oc, 10, 1.0),
        );
        for bias in [true, false] {
            let out = o.rand(n * oc, 11, 1.0);
            let (db, hbias) = (bias.then(|| d(&b)), bias.then(|| h(&b)));
            dev.matmul_forward(d(&out), d(&inp), d(&w), db, n, ic, oc)
                .unwrap();
            hb.matmul_forward(h(&out), h(&inp), h(&w), hbias, n, ic, oc)
                .unwrap();
            o.close("matmul_forward", &out, 1e-5, 1e-5);
            let dout = o.rand(n * oc, 12, 1.0);
            let (dinp, dw, dbias) = (
                o.rand(n * ic, 13, 1.0),
                o.rand(oc * ic, 14, 1.0),
                o.rand(oc, 15, 1.0),
            );
            let (ddb, hdb) = (bias.then(|| d(&dbias)), bias.then(|| h(&dbias)));
            dev.matmul_backward(d(&dinp), d(&dw), ddb, d(&dout), d(&inp), d(&w), n, ic, oc)
                .unwrap();
            hb.matmul_backward(h(&dinp), h(&dw), hdb, h(&dout), h(&inp), h(&w), n, ic, oc)
                .unwrap();
            o.close("matmul_backward dinp", &dinp, 1e-5, 1e-5);
            o.close("matmul_backward dw", &dw, 1e-5, 1e-5);
            o.bits("matmul_backward dbias", &dbias);
        }

        // Norms over rows wider than a block.
        let (rows, c) = (37, 300);
        let (inp, w, b) = (
            o.rand(rows * c, 16, 2.0),
            o.rand(c, 17, 1.5),
            o.rand(c, 18, 1.0),
        );
        let dout = o.rand(rows * c, 19, 1.0);
        let eps = 1e-5;
        let (out, mean, rstd) = (o.zeros(rows * c), o.zeros(rows), o.zeros(rows));
        dev.layernorm_forward(d(&out), d(&mean), d(&rstd), d(&inp), d(&w), d(&b), c, eps)
            .unwrap();
        hb.layernorm_forward(h(&out), h(&mean), h(&rstd), h(&inp), h(&w), h(&b), c, eps)
            .unwrap();
        o.close("layernorm_forward out", &out, 1e-5, 1e-6);
        o.close("layernorm_forward mean", &mean, 1e-5, 1e-6);
        o.close("layernorm_forward rstd", &rstd, 1e-5, 1e-6);
        let (dinp, dw, db) = (
            o.rand(rows * c, 20, 1.0),
            o.rand(c, 21, 1.0),
            o.rand(c, 22, 1.0),
        );
        // The backward reads the CPU's statistics on both sides.
        let (hm, hr) = (o.get(&mean).1, o.get(&rstd).1);
        let (mean, rstd) = (o.twin(&hm), o.twin(&hr));
        dev.layernorm_backward(
            d(&dinp),
            d(&dw),
            d(&db),
            d(&dout),
            d(&inp),
            d(&w),
            d(&mean),
            d(&rstd),
            c,
        )
        .unwrap();
        hb.layernorm_backward(
            h(&dinp),
            h(&dw),
            h(&db),
            h(&dout),
            h(&inp),
            h(&w),
            h(&mean),
            h(&rstd),
            c,
        )
        .unwrap();
        o.close("layernorm_backward dinp", &dinp, 1e-4, 1e-5);
        o.close("layernorm_backward dw", &dw, 1e-4, 1e-5);
        o.close("layernorm_backward db", &db, 1e-4, 1e-5);
        let (out, rstd) = (o.zeros(rows * c), o.zeros(rows));
        dev.rmsnorm_forward(d(&out), d(&rstd), d(&inp), d(&w), c, eps)
            .unwrap();
        hb.rmsnorm_forward(h(&out), h(&rstd), h(&inp), h(&w), c, eps)
            .unwrap();
        o.close("rmsnorm_forward out", &out, 1e-5, 1e-6);
        o.close("rmsnorm_forward rstd", &rstd, 1e-5, 1e-6);
        let rstd = o.twin(&o.get(&rstd).1);
        let (dinp, dw) = (o.rand(rows * c, 23, 1.0), o.rand(c, 24, 1.0));
        dev.rmsnorm_backward(d(&dinp), d(&dw), d(&dout), d(&inp), d(&w), d(&rstd), c)
            .unwrap();
        hb.rmsnorm_backward(h(&dinp), h(&dw), h(&dout), h(&inp), h(&w), h(&rstd), c)
            .unwrap();
        o.close("rmsnorm_backward dinp", &dinp, 1e-4, 1e-5);
        o.close("rmsnorm_backward dw", &dw, 1e-4, 1e-5);

        // GELU and SwiGLU, forward and backward.
        let (rows, hid) = (37, 60);
        let x = o.rand(rows * 2 * hid, 25, 4.0);
        let dy = o.rand(rows * 2 * hid, 26, 1.0);
        let (y, dx) = (o.zeros(rows * 2 * hid), o.rand(rows * 2 * hid, 27, 1.0));
        dev.gelu_forward(d(&y), d(&x)).unwrap();
        hb.gelu_forward(h(&y), h(&x)).unwrap();
        o.close("gelu_forward", &y, 1e-5, 1e-6);
        dev.gelu_backward(d(&dx), d(&x), d(&dy)).unwrap();
        hb.gelu_backward(h(&dx), h(&x), h(&dy)).unwrap();
        o.close("gelu_backward", &dx, 1e-4, 1e-5);
        let (y, dy) = (o.zeros(rows * hid), o.rand(rows * hid, 28, 1.0));
        let dx = o.rand(rows * 2 * hid, 29, 1.0);
        dev.swiglu_forward(d(&y), d(&x), hid).unwrap();
        hb.swiglu_forward(h(&y), h(&x), hid).unwrap();
        o.close("swiglu_forward", &y, 1e-5, 1e-6);
        dev.swiglu_backward(d(&dx), d(&x), d(&dy), hid).unwrap();
        hb.swiglu_backward(h(&dx), h(&x), h(&dy), hid).unwrap();
        o.close("swiglu_backward", &dx, 1e-4, 1e-5);

        // RoPE on fused qkv rows (q and k rotated, v copied), forward and backward.
        let (seq, heads, hs) = (19, 3, 16);
        let width = 3 * heads * hs;
        let rows = 2 * seq;
        let x = o.rand(rows * width, 30, 2.0);
        let y = o.zeros(rows * width);
        dev.rope_forward(d(&y), d(&x), seq, width, 2 * heads, hs, 10000.0)
            .unwrap();
        hb.rope_forward(h(&y), h(&x), seq, width, 2 * heads, hs, 10000.0)
            .unwrap();
        o.bits("rope_forward", &y);
        let dx = o.rand(rows * width, 31, 1.0);
        dev.rope_backward(d(&dx), d(&y), seq, width, 2 * heads, hs, 10000.0)
            .unwrap();
        hb.rope_backward(h(&dx), h(&y), seq, width, 2 * heads, hs, 10000.0)
            .unwrap();
        o.bits("rope_backward", &dx);

        // Attention: a batch of short sequences, and one sequence longer than a block.
        for (b, t, c, nh) in [(2, 19, 48, 3), (1, 300, 16, 2)] {
            let what = format!("attention b{b} t{t} c{c} nh{nh}");
            let qkv = o.rand(b * t * 3 * c, 32, 1.5);
            let (out, att) = (o.zeros(b * t * c), o.rand(b * nh * t * t, 33, 1.0));
            dev.attention_forward(d(&out), d(&att), d(&qkv), b, t, c, nh)
                .unwrap();
            hb.attention_forward(h(&out), h(&att), h(&qkv), b, t, c, nh)
                .unwrap();
            o.close(&format!("{what}: forward out"), &out, 1e-4, 1e-5);
            o.close(&format!("{what}: forward att"), &att, 1e-4, 1e-6);
            // The backward reads the CPU's probabilities on both sides.
            let att = o.twin(&o.get(&att).1);
            let dout = o.rand(b * t * c, 34, 1.0);
            let dqkv = o.rand(b * t * 3 * c, 35, 1.0);
            dev.attention_backward(d(&dqkv), d(&dout), d(&qkv), d(&att), b, t, c, nh)
                .unwrap();
            hb.attention_backward(h(&dqkv), h(&dout), h(&qkv), h(&att), b, t, c, nh)
                .unwrap();
            o.close(&format!("{what}: backward"), &dqkv, 1e-3, 1e-4);
        }

        // Softmax + cross-entropy over a vocabulary wider than a block.
        let (rows, v) = (37, 300);
        let tg: Vec<u32> = (0..rows as u32).map(|i| (i * 37) % v as u32).collect();
        let (dtg, htg) = o.ids(&tg, v);
        let logits = o.rand(rows * v, 36, 4.0);
        let (probs, losses) = (o.zeros(rows * v), o.zeros(rows));
        dev.crossentropy_forward(d(&probs), d(&losses), d(&logits), dtg.ptr(), v)
            .unwrap();
        hb.crossentropy_forward(h(&probs), h(&losses), h(&logits), htg.ptr(), v)
            .unwrap();
        o.close("crossentropy_forward probs", &probs, 1e-4, 1e-7);
        o.close("crossentropy_forward losses", &losses, 1e-5, 1e-6);
        let probs = o.twin(&o.get(&probs).1);
        let dlogits = o.rand(rows * v, 37, 1.0);
        dev.crossentropy_backward(d(&dlogits), d(&probs), dtg.ptr(), v, 0.75)
            .unwrap();
        hb.crossentropy_backward(h(&dlogits), h(&probs), htg.ptr(), v, 0.75)
            .unwrap();
        o.bits("crossentropy_backward", &dlogits);

        // AdamW, three steps with and without decay.
        let n = 1003;
        let (p, g) = (o.rand(n, 38, 1.0), o.rand(n, 39, 1.0));
        let (m, vv) = (o.zeros(n), o.zeros(n));
        let opt = AdamW::default();
        for t in 1..=3u64 {
            let decay = t != 2;
            dev.adamw(d(&p), d(&g), d(&m), d(&vv), &opt, t, 0.5, decay)
                .unwrap();
            hb.adamw(h(&p), h(&g), h(&m), h(&vv), &opt, t, 0.5, decay)
                .unwrap();
        }
        o.bits("adamw params", &p);
        o.bits("adamw m", &m);
        o.bits("adamw v", &vv);

        // Memory ops.
        let (x, y) = (o.rand(77, 40, 1.0), o.rand(77, 41, 1.0));
        dev.copy(d(&x), d(&y)).unwrap();
        hb.copy(h(&x), h(&y)).unwrap();
        o.bits("copy", &x);
        dev.fill_zero(d(&x).sub(10, 20).unwrap()).unwrap();
        hb.fill_zero(h(&x).sub(10, 20).unwrap()).unwrap();
        o.bits("fill_zero", &x);
    }
}

/// Tolerance of the gradients of one microbatch against the CPU, per tensor: within
/// `1e-3 * max|cpu gradient of the tensor|` (fp32 sums in another order through a dozen
/// layers; a wrong or missing term is far larger).
pub const GRAD_TOL: f32 = 1e-3;

/// Tolerance of the training losses against the CPU, relative: 1e-3. The first step's
/// loss is the forward alone (agreeing to ~1e-6); later steps add AdamW updates computed
/// from gradients that differ in the last bits, and AdamW's normalisation turns the sign
/// of a gradient that is zero up to rounding into a full step of that weight, so the
/// losses drift apart slowly: ~1e-5 after 3 steps at lr 1e-2, well inside the tolerance.
pub const LOSS_TOL: f32 = 1e-3;

/// The backend trains like the CPU: same initial parameters, gradients of one microbatch
/// within [`GRAD_TOL`] per tensor (every stage), and `steps` training steps whose losses
/// agree within [`LOSS_TOL`]. Returns the largest relative loss difference seen.
pub fn check_training<B: Backend>(backend: Arc<B>, name: &str, steps: usize) -> f32 {
    let cfg = preset(name).unwrap();
    let mut o = TrainOptions::for_config(&cfg);
    o.steps = steps;
    o.lr = 1e-2;
    o.warmup = 1;

    // Gradients of one microbatch, stage by stage and tensor by tensor.
    let mut cpu = Pipeline::new(&cfg, o.stages, o.seed).unwrap();
    let mut dev = DevicePipeline::new(backend.clone(), &cfg, o.stages, o.seed).unwrap();
    assert_bits(
        &format!("{name}: initial parameters"),
        &dev.params_flat().unwrap(),
        &cpu.params_flat(),
    );
    let text = data::generate_corpus(3, 4096);
    let (x, y) = data::Batcher::new(data::tokenize(&text), 3)
        .unwrap()
        .next_batch(o.batch, o.seq)
        .unwrap();
    let lc = cpu.forward_backward(0, o.batch, o.seq, &x, &y).unwrap();
    let ld = dev
        .forward_backward(o.batch, o.seq, &[(x.clone(), y.clone())])
        .unwrap()[0];
    assert!(
        (ld - lc).abs() <= 1e-5 * lc,
        "{name}: loss of one microbatch: device {ld} cpu {lc}"
    );
    for (si, (cs, ds)) in cpu.stages.iter().zip(&dev.stages).enumerate() {
        let dg = ds.grads_to_host().unwrap();
        for (t, r) in cs.tensors() {
            let want = &cs.grads()[r.clone()];
            assert_close(
                &format!("{name} stage {si} gradient {}", t.name),
                &dg[r.clone()],
                want,
                0.0,
                GRAD_TOL,
            );
        }
    }

    // Training steps.
    let cpu_logs = train(&cfg, &o, |_| {}).unwrap();
    let dev_logs = train_on(backend, &cfg, &o, |_| {}).unwrap();
    let mut worst = 0.0f32;
    for (d, c) in dev_logs.iter().zip(&cpu_logs) {
        let rel = (d.loss - c.loss).abs() / c.loss;
        worst = worst.max(rel);
        assert!(
            rel <= LOSS_TOL,
            "{name} step {}: device loss {} cpu loss {}",
            d.step,
            d.loss,
            c.loss
        );
    }
    assert!(
        dev_logs[steps - 1].loss < dev_logs[0].loss,
        "{name}: the loss goes down: {dev_logs:?}"
    );
    worst
}
