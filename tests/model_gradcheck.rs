//! Finite-difference gradient checks of every layer op, in f64 (the ops are generic), so the
//! tolerances can be tight and the checks are not flaky: central differences with
//! eps = 1e-6 have truncation error ~1e-12 and round-off ~1e-10 for these O(1) functions;
//! we require |analytic - numeric| <= 1e-6 * max(1, |analytic|).
//! Plus a check of the whole f32 model (every stage's parameters and the wiring of the
//! blocks) with looser, stated tolerances.
use gwtf::model::ops::*;
use gwtf::model::rng::Rng;
use gwtf::model::{preset, Pipeline};

const EPS: f64 = 1e-6;
const TOL: f64 = 1e-6;

fn randv(r: &mut Rng, n: usize, scale: f64) -> Vec<f64> {
    (0..n).map(|_| r.normal() * scale).collect()
}

/// Checks d(sum(w * f(x)))/dx against `grads` for each input tensor (all elements).
fn check(
    name: &str,
    inputs: &[Vec<f64>],
    f: &dyn Fn(&[Vec<f64>]) -> Vec<f64>,
    grads: &[Vec<f64>],
    w: &[f64],
) {
    let loss = |xs: &[Vec<f64>]| -> f64 { f(xs).iter().zip(w).map(|(a, b)| a * b).sum() };
    let mut xs = inputs.to_vec();
    let mut worst = 0.0f64;
    for (ti, g) in grads.iter().enumerate() {
        assert_eq!(g.len(), xs[ti].len(), "{name}: grad {ti} length");
        for i in 0..xs[ti].len() {
            let orig = xs[ti][i];
            xs[ti][i] = orig + EPS;
            let lp = loss(&xs);
            xs[ti][i] = orig - EPS;
            let lm = loss(&xs);
            xs[ti][i] = orig;
            let num = (lp - lm) / (2.0 * EPS);
            let err = (num - g[i]).abs() / g[i].abs().max(1.0);
            worst = worst.max(err);
            assert!(
                err <= TOL,
                "{name}: input {ti} element {i}: analytic {} numeric {num} (err {err:e})",
                g[i]
            );
        }
    }
    eprintln!("{name}: worst relative error {worst:e}");
}

#[test]
fn gradcheck_linear() {
    let mut r = Rng::new(1);
    let (n, ic, oc) = (5, 7, 4);
    let x = randv(&mut r, n * ic, 1.0);
    let wt = randv(&mut r, oc * ic, 0.5);
    let b = randv(&mut r, oc, 0.5);
    let w = randv(&mut r, n * oc, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let mut o = vec![0.0; n * oc];
        matmul_forward(&mut o, &xs[0], &xs[1], Some(&xs[2]), n, ic, oc);
        o
    };
    let (mut dx, mut dw, mut db) = (vec![0.0; n * ic], vec![0.0; oc * ic], vec![0.0; oc]);
    matmul_backward(&mut dx, &mut dw, Some(&mut db), &w, &x, &wt, n, ic, oc);
    check("linear", &[x, wt, b], &f, &[dx, dw, db], &w);
}

#[test]
fn gradcheck_layernorm() {
    let mut r = Rng::new(2);
    let (n, c) = (4, 9);
    let x = randv(&mut r, n * c, 2.0);
    let g = randv(&mut r, c, 1.0);
    let b = randv(&mut r, c, 1.0);
    let w = randv(&mut r, n * c, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let (mut o, mut m, mut s) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut o, &mut m, &mut s, &xs[0], &xs[1], &xs[2], c, 1e-5);
        o
    };
    let (mut o, mut m, mut s) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&mut o, &mut m, &mut s, &x, &g, &b, c, 1e-5);
    let (mut dx, mut dg, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
    layernorm_backward(&mut dx, &mut dg, &mut db, &w, &x, &g, &m, &s, c);
    check("layernorm", &[x, g, b], &f, &[dx, dg, db], &w);
}

#[test]
fn gradcheck_rmsnorm() {
    let mut r = Rng::new(3);
    let (n, c) = (4, 10);
    let x = randv(&mut r, n * c, 2.0);
    let g = randv(&mut r, c, 1.0);
    let w = randv(&mut r, n * c, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let (mut o, mut s) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut o, &mut s, &xs[0], &xs[1], c, 1e-5);
        o
    };
    let (mut o, mut s) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut o, &mut s, &x, &g, c, 1e-5);
    let (mut dx, mut dg) = (vec![0.0; n * c], vec![0.0; c]);
    rmsnorm_backward(&mut dx, &mut dg, &w, &x, &g, &s, c);
    check("rmsnorm", &[x, g], &f, &[dx, dg], &w);
}

#[test]
fn gradcheck_gelu() {
    let mut r = Rng::new(4);
    let x = randv(&mut r, 64, 2.0);
    let w = randv(&mut r, 64, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let mut o = vec![0.0; 64];
        gelu_forward(&mut o, &xs[0]);
        o
    };
    let mut dx = vec![0.0; 64];
    gelu_backward(&mut dx, &x, &w);
    check("gelu", &[x], &f, &[dx], &w);
}

#[test]
fn gradcheck_swiglu() {
    let mut r = Rng::new(5);
    let (n, h) = (3, 8);
    let x = randv(&mut r, n * 2 * h, 2.0);
    let w = randv(&mut r, n * h, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let mut o = vec![0.0; n * h];
        swiglu_forward(&mut o, &xs[0], h);
        o
    };
    let mut dx = vec![0.0; n * 2 * h];
    swiglu_backward(&mut dx, &x, &w, h);
    check("swiglu", &[x], &f, &[dx], &w);
}

#[test]
fn gradcheck_rope() {
    let mut r = Rng::new(6);
    // 2 sequences of 5 positions, rows of 3 heads of size 4 (first 2 rotated, last copied).
    let (b, t, hs) = (2, 5, 4);
    let width = 3 * hs;
    let x = randv(&mut r, b * t * width, 1.0);
    let w = randv(&mut r, b * t * width, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let mut o = vec![0.0; b * t * width];
        rope_forward(&mut o, &xs[0], t, width, 2, hs, 100.0);
        o
    };
    let mut dx = vec![0.0; b * t * width];
    rope_backward(&mut dx, &w, t, width, 2, hs, 100.0);
    check("rope", std::slice::from_ref(&x), &f, &[dx], &w);
    // Position 0 is not rotated; the copied head is untouched; norms are preserved.
    let o = f(std::slice::from_ref(&x));
    assert_eq!(&o[..width], &x[..width]);
    for row in 0..b * t {
        assert_eq!(
            &o[row * width + 2 * hs..(row + 1) * width],
            &x[row * width + 2 * hs..(row + 1) * width]
        );
        let n0: f64 = x[row * width..row * width + 2 * hs]
            .iter()
            .map(|v| v * v)
            .sum();
        let n1: f64 = o[row * width..row * width + 2 * hs]
            .iter()
            .map(|v| v * v)
            .sum();
        assert!((n0 - n1).abs() < 1e-12 * n0.max(1.0));
    }
}

#[test]
fn gradcheck_attention_causal() {
    let mut r = Rng::new(7);
    let (b, t, c, nh) = (2, 5, 8, 2);
    let qkv = randv(&mut r, b * t * 3 * c, 1.0);
    let w = randv(&mut r, b * t * c, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let (mut o, mut a) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
        attention_forward(&mut o, &mut a, &xs[0], b, t, c, nh);
        o
    };
    let (mut o, mut a) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
    attention_forward(&mut o, &mut a, &qkv, b, t, c, nh);
    // Probabilities: rows sum to 1, zero above the diagonal.
    for bh in 0..b * nh {
        for ti in 0..t {
            let row = &a[(bh * t + ti) * t..(bh * t + ti + 1) * t];
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
            assert!(row[ti + 1..].iter().all(|&p| p == 0.0));
        }
    }
    let mut d = vec![0.0; b * t * 3 * c];
    attention_backward(&mut d, &w, &qkv, &a, b, t, c, nh);
    check("attention", std::slice::from_ref(&qkv), &f, &[d], &w);
    // Causality: changing the last position changes no earlier output.
    let mut q2 = qkv.clone();
    for v in &mut q2[(t - 1) * 3 * c..t * 3 * c] {
        *v += 1.0;
    }
    let o2 = f(&[q2]);
    assert_eq!(&o[..(t - 1) * c], &o2[..(t - 1) * c]);
    assert_ne!(&o[(t - 1) * c..t * c], &o2[(t - 1) * c..t * c]);
}

#[test]
fn gradcheck_softmax_crossentropy() {
    let mut r = Rng::new(8);
    let (n, v) = (6, 11);
    let logits = randv(&mut r, n * v, 2.0);
    let targets: Vec<u32> = (0..n).map(|i| ((i * 7) % v) as u32).collect();
    let f = |xs: &[Vec<f64>]| {
        let mut p = vec![0.0; n * v];
        vec![crossentropy_forward(&mut p, &xs[0], &targets, v)]
    };
    let mut p = vec![0.0; n * v];
    let l = crossentropy_forward(&mut p, &logits, &targets, v);
    // reference loss
    let mut refl = 0.0;
    for i in 0..n {
        let row = &logits[i * v..(i + 1) * v];
        let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
        refl += lse - row[targets[i] as usize];
    }
    assert!((l - refl / n as f64).abs() < 1e-12);
    let mut d = vec![0.0; n * v];
    crossentropy_backward(&mut d, &p, &targets, v, 1.0);
    check("crossentropy", &[logits], &f, &[d], &[1.0]);
}

#[test]
fn gradcheck_embedding() {
    let mut r = Rng::new(9);
    let (vocab, c, t, b) = (7, 4, 3, 2);
    let wte = randv(&mut r, vocab * c, 1.0);
    let wpe = randv(&mut r, t * c, 1.0);
    let tokens: Vec<u32> = vec![1, 3, 3, 0, 6, 1];
    let w = randv(&mut r, b * t * c, 1.0);
    let f = |xs: &[Vec<f64>]| {
        let mut o = vec![0.0; b * t * c];
        encoder_forward(&mut o, &tokens, &xs[0], Some(&xs[1]), t, c);
        o
    };
    let (mut dwte, mut dwpe) = (vec![0.0; vocab * c], vec![0.0; t * c]);
    encoder_backward(&mut dwte, Some(&mut dwpe), &w, &tokens, t, c);
    check("embedding", &[wte, wpe], &f, &[dwte, dwpe], &w);
}

/// The whole f32 model, every stage: for each parameter tensor, the element with the
/// largest gradient and two others are perturbed. Parameters are first re-drawn at O(0.1-1)
/// scale (with the default 0.02 init the residual stream is so small that a
/// finite-difference step large enough for f32 is far outside the linear range).
/// eps = 5e-3; tolerance |num - ana| <= 0.03 |ana| + 5e-4 (f32 round-off of the loss,
/// ~1e-6, divided by 2 eps is ~1e-4).
#[test]
fn gradcheck_whole_model_f32() {
    for name in ["gpt-tiny", "llama-tiny"] {
        let mut cfg = preset(name).unwrap();
        cfg.n_layers = 2;
        let (b, t) = (2, 6);
        let mut p = Pipeline::new(&cfg, 4, 11).unwrap();
        let mut r = Rng::new(99);
        for s in &mut p.stages {
            let mut params = s.params().to_vec();
            for (spec, range) in s.tensors().to_vec() {
                let norm = spec.name.contains("_w") && range.len() == cfg.d_model;
                for x in &mut params[range] {
                    *x = if norm {
                        1.0 + 0.1 * r.normal() as f32
                    } else {
                        0.3 * r.normal() as f32
                    };
                }
            }
            s.import_params(&params).unwrap();
        }
        let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 37 + 5) % 256) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| ((i * 91 + 3) % 256) as u32).collect();
        p.forward_backward(0, b, t, &tokens, &targets).unwrap();
        let eps = 5e-3f32;
        let mut checked = 0;
        let mut worst = 0.0f32;
        for si in 0..p.stages.len() {
            let tensors = p.stages[si].tensors().to_vec();
            let grads = p.stages[si].grads().to_vec();
            for (spec, range) in tensors {
                let gi = &grads[range.clone()];
                let imax = (0..gi.len())
                    .max_by(|&a, &b| gi[a].abs().total_cmp(&gi[b].abs()))
                    .unwrap();
                for k in [imax, gi.len() / 3, gi.len() - 1] {
                    let idx = range.start + k;
                    let mut params = p.stages[si].params().to_vec();
                    let orig = params[idx];
                    params[idx] = orig + eps;
                    p.stages[si].import_params(&params).unwrap();
                    let lp = p.eval_loss(b, t, &tokens, &targets).unwrap();
                    params[idx] = orig - eps;
                    p.stages[si].import_params(&params).unwrap();
                    let lm = p.eval_loss(b, t, &tokens, &targets).unwrap();
                    params[idx] = orig;
                    p.stages[si].import_params(&params).unwrap();
                    let num = (lp - lm) / (2.0 * eps);
                    let ana = grads[idx];
                    worst = worst.max((num - ana).abs() / (0.03 * ana.abs() + 5e-4));
                    assert!(
                        (num - ana).abs() <= 0.03 * ana.abs() + 5e-4,
                        "{name} stage {si} {} [{k}]: analytic {ana} numeric {num}",
                        spec.name
                    );
                    checked += 1;
                }
            }
        }
        eprintln!("{name}: {checked} parameters checked, worst error / tolerance {worst}");
        assert!(checked > 20);
    }
}
