//! The device stage (`gwtf::model::gpu`) on the host backend, against the CPU stage.
//!
//! `HostBackend` runs the device stage's sequence of ops with the CPU twins of the
//! kernels, so it must compute exactly what the CPU `Stage` computes: same parameters,
//! bit-identical gradients and parameters after AdamW. This checks, on any machine, the
//! device stage's bookkeeping (tensor offsets, buffers, accumulation, stage split) that
//! the CUDA backend shares; tests/cuda_gpu.rs then compares the CUDA backend with the
//! host one op by op and the training losses with the CPU's.
use gwtf::model::data::{generate_corpus, tokenize, Batcher};
use gwtf::model::gpu::*;
use gwtf::model::train::{train, TrainOptions};
use gwtf::model::*;
use std::sync::Arc;

fn batches(seed: u64, k: usize, b: usize, t: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    let text = generate_corpus(seed, 4096);
    let mut data = Batcher::new(tokenize(&text), seed).unwrap();
    (0..k).map(|_| data.next_batch(b, t).unwrap()).collect()
}

fn assert_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: device {x} cpu {y}");
    }
}

/// The loss of a microbatch differs by the rounding of each position's loss to f32 on
/// the device side (the CPU keeps them in f64 until the mean): well under 1e-6 relative.
fn assert_loss(what: &str, dev: f32, cpu: f32) {
    assert!(
        (dev - cpu).abs() <= 1e-6 * cpu.abs(),
        "{what}: device loss {dev} cpu {cpu}"
    );
}

#[test]
fn host_device_pipeline_matches_the_cpu_pipeline_bit_for_bit() {
    for name in ["gpt-tiny", "llama-tiny"] {
        let mut cfg = preset(name).unwrap();
        cfg.n_layers = 3;
        // seq shorter than max_seq: positions and RoPE tables for a partial window.
        let (b, t) = (3, 12);
        for stages in [1, 2, 3, 5] {
            let what = format!("{name}, {stages} stages");
            let mut cpu = Pipeline::new(&cfg, stages, 7).unwrap();
            let mut dev = DevicePipeline::new(Arc::new(HostBackend), &cfg, stages, 7).unwrap();
            assert_eq!(dev.stages.len(), stages);
            assert_eq!(dev.num_params(), cpu.num_params());
            assert_bits(
                &format!("{what}: initial params"),
                &dev.params_flat().unwrap(),
                &cpu.params_flat(),
            );
            for step in 0..2u64 {
                let mbs = batches(100 + step, 2, b, t);
                let mut cpu_losses = Vec::new();
                for (i, (x, y)) in mbs.iter().enumerate() {
                    cpu_losses.push(cpu.forward_backward(i as u64, b, t, x, y).unwrap());
                }
                let dev_losses = dev.forward_backward(b, t, &mbs).unwrap();
                for (d, c) in dev_losses.iter().zip(&cpu_losses) {
                    assert_loss(&what, *d, *c);
                }
                assert_bits(
                    &format!("{what}: gradients of step {step}"),
                    &dev.grads_flat().unwrap(),
                    &cpu.grads_flat(),
                );
                for s in &dev.stages {
                    assert_eq!(s.accumulated(), 2);
                    assert_eq!(s.in_flight(), 0);
                }
                let opt = AdamW {
                    lr: 1e-2,
                    ..AdamW::default()
                };
                cpu.step(&opt).unwrap();
                dev.step(&opt).unwrap();
                assert_bits(
                    &format!("{what}: params after step {step}"),
                    &dev.params_flat().unwrap(),
                    &cpu.params_flat(),
                );
                assert!(dev.grads_flat().unwrap().iter().all(|&g| g == 0.0));
                for s in &dev.stages {
                    assert_eq!(s.steps_taken(), step + 1);
                    assert_eq!(s.accumulated(), 0);
                }
            }
        }
    }
}

#[test]
fn train_on_the_host_backend_matches_cpu_training() {
    for name in ["gpt-tiny", "llama-tiny"] {
        let cfg = preset(name).unwrap();
        let mut o = TrainOptions::for_config(&cfg);
        o.steps = 4;
        o.lr = 1e-2;
        o.warmup = 1;
        o.accum = 2;
        let cpu = train(&cfg, &o, |_| {}).unwrap();
        let mut seen = 0;
        let dev = train_on(Arc::new(HostBackend), &cfg, &o, |_| seen += 1).unwrap();
        assert_eq!(seen, 4);
        assert_eq!(dev.len(), cpu.len());
        for (d, c) in dev.iter().zip(&cpu) {
            assert_eq!(d.step, c.step);
            assert_eq!(d.lr, c.lr);
            assert_loss(&format!("{name} step {}", d.step), d.loss, c.loss);
        }
        assert!(dev[3].loss < dev[0].loss, "{name}: {dev:?}");
    }
}

#[test]
fn device_stage_checks_its_inputs_like_the_cpu_stage() {
    let cfg = preset("llama-tiny").unwrap();
    let be = Arc::new(HostBackend);
    let plan = StagePlan::new(&cfg, 3).unwrap();
    let mut stages = DeviceStage::all(&be, &cfg, &plan, 1).unwrap();
    let (b, t) = (2, 8);
    let n = b * t;
    let c = cfg.d_model;
    let (x, y) = batches(3, 1, b, t).remove(0);
    let tok = DeviceIds::upload(&*be, &x, cfg.vocab_size).unwrap();
    let tgt = DeviceIds::upload(&*be, &y, cfg.vocab_size).unwrap();
    let hidden = |len: usize| be.zeros(len).unwrap();

    // Ids are checked on the host before the upload.
    let mut bad = x.clone();
    bad[5] = 256;
    let e = DeviceIds::upload(&*be, &bad, cfg.vocab_size).err().unwrap();
    assert_eq!(
        e,
        ModelError::TokenOutOfRange {
            token: 256,
            vocab: 256
        }
    );
    // Ids checked against a larger table do not fit this vocabulary.
    let wide = DeviceIds::upload(&*be, &x, 1000).unwrap();
    let e = stages[0]
        .forward(0, b, t, DeviceInput::Tokens(wide), None)
        .err()
        .unwrap();
    assert!(matches!(e, ModelError::InvalidConfig(_)), "{e}");
    assert!(tok.slice(n - 1, 2).is_err());

    // Wrong kind of input, wrong shapes, bad microbatch shapes.
    let e = stages[0]
        .forward(0, b, t, DeviceInput::Hidden(hidden(n * c)), None)
        .err()
        .unwrap();
    assert_eq!(e, ModelError::WrongInput("stage 0 takes token ids"));
    let e = stages[1]
        .forward(0, b, t, DeviceInput::Tokens(tok.clone()), None)
        .err()
        .unwrap();
    assert_eq!(e, ModelError::WrongInput("this stage takes activations"));
    let e = stages[1]
        .forward(0, b, t, DeviceInput::Hidden(hidden(n * c - 1)), None)
        .err()
        .unwrap();
    assert!(matches!(e, ModelError::ShapeMismatch { .. }), "{e}");
    let e = stages[0]
        .forward(0, b, t + 1, DeviceInput::Tokens(tok.clone()), None)
        .err()
        .unwrap();
    assert!(matches!(e, ModelError::ShapeMismatch { .. }), "{e}");
    let e = stages[0]
        .forward(
            0,
            b,
            cfg.max_seq + 1,
            DeviceInput::Tokens(tok.clone()),
            None,
        )
        .err()
        .unwrap();
    assert!(matches!(e, ModelError::InvalidConfig(_)), "{e}");
    let e = stages[2]
        .forward(0, b, t, DeviceInput::Hidden(hidden(n * c)), None)
        .err()
        .unwrap();
    assert_eq!(e, ModelError::MissingTargets);
    assert!(stages.iter().all(|s| s.in_flight() == 0));

    // A real microbatch through the three stages, with the backward's checks.
    let DeviceOutput::Hidden(h0) = stages[0]
        .forward(9, b, t, DeviceInput::Tokens(tok.clone()), None)
        .unwrap()
    else {
        panic!("stage 0 returns activations")
    };
    let e = stages[0]
        .forward(9, b, t, DeviceInput::Tokens(tok.clone()), None)
        .err()
        .unwrap();
    assert_eq!(e, ModelError::DuplicateMicrobatch(9));
    let DeviceOutput::Hidden(h1) = stages[1]
        .forward(9, b, t, DeviceInput::Hidden(h0), None)
        .unwrap()
    else {
        panic!("stage 1 returns activations")
    };
    let DeviceOutput::Loss(rows) = stages[2]
        .forward(9, b, t, DeviceInput::Hidden(h1), Some(tgt))
        .unwrap()
    else {
        panic!("the last stage returns the losses")
    };
    let rows = be.download_buf(&rows).unwrap();
    assert_eq!(rows.len(), n);
    let mean = rows.iter().map(|&l| l as f64).sum::<f64>() / n as f64;
    assert!(mean > 5.0 && mean < 6.0, "initial loss {mean} near ln 256");

    assert_eq!(
        stages[2].backward(8, None).err().unwrap(),
        ModelError::UnknownMicrobatch(8)
    );
    let e = stages[2].backward(9, Some(hidden(n * c))).err().unwrap();
    assert!(matches!(e, ModelError::WrongInput(_)), "{e}");
    let g2 = stages[2].backward(9, None).unwrap().unwrap();
    assert_eq!(g2.len(), n * c);
    assert_eq!(
        stages[1].backward(9, None).err().unwrap(),
        ModelError::MissingGradient
    );
    let e = stages[1].backward(9, Some(hidden(3))).err().unwrap();
    assert!(matches!(e, ModelError::ShapeMismatch { .. }), "{e}");
    assert_eq!(
        stages[1].in_flight(),
        1,
        "a failed backward changes nothing"
    );
    let g1 = stages[1].backward(9, Some(g2)).unwrap().unwrap();
    assert!(stages[0].backward(9, Some(g1)).unwrap().is_none());
    for s in &stages {
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.accumulated(), 1);
        assert!(s.grads_to_host().unwrap().iter().any(|&g| g != 0.0));
    }

    // Discard, zero_grad, and a step with nothing accumulated.
    stages[0]
        .forward(10, b, t, DeviceInput::Tokens(tok), None)
        .unwrap();
    assert!(stages[0].discard(10));
    assert!(!stages[0].discard(10));
    stages[0].zero_grad().unwrap();
    assert!(stages[0].grads_to_host().unwrap().iter().all(|&g| g == 0.0));
    assert_eq!(
        stages[0].step(&AdamW::default()).err().unwrap(),
        ModelError::NothingAccumulated
    );
    let before = stages[1].params_to_host().unwrap();
    stages[1].step(&AdamW::default()).unwrap();
    assert_ne!(stages[1].params_to_host().unwrap(), before);
}

#[test]
fn pipeline_rejects_bad_microbatches() {
    let cfg = preset("gpt-tiny").unwrap();
    let mut dev = DevicePipeline::new(Arc::new(HostBackend), &cfg, 4, 1).unwrap();
    let (b, t) = (2, 8);
    let mut mbs = batches(4, 2, b, t);
    assert!(dev.forward_backward(b, t, &[]).is_err());
    mbs[1].1.pop();
    let e = dev.forward_backward(b, t, &mbs).err().unwrap();
    assert!(
        matches!(
            e,
            ModelError::ShapeMismatch {
                what: "targets",
                ..
            }
        ),
        "{e}"
    );
    mbs[1].1.push(300);
    let e = dev.forward_backward(b, t, &mbs).err().unwrap();
    assert_eq!(
        e,
        ModelError::TokenOutOfRange {
            token: 300,
            vocab: 256
        }
    );
    // Nothing was started by the failed calls.
    assert!(dev
        .stages
        .iter()
        .all(|s| s.in_flight() == 0 && s.accumulated() == 0));
    mbs[1].1.pop();
    mbs[1].1.push(1);
    let losses = dev.forward_backward(b, t, &mbs).unwrap();
    assert_eq!(losses.len(), 2);
    assert!(dev
        .stages
        .iter()
        .all(|s| s.in_flight() == 0 && s.accumulated() == 2));
}

#[test]
fn ops_check_shapes_and_overlaps() {
    let be = HostBackend;
    let a = be.upload(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let out = be.zeros(6).unwrap();
    let p = a.ptr();
    assert!(p.sub(4, 3).is_err());
    assert!(p.sub(usize::MAX, 2).is_err());
    let (lo, hi) = (p.sub(0, 3).unwrap(), p.sub(3, 3).unwrap());
    assert!(!lo.overlaps(hi));
    assert!(lo.overlaps(p.sub(2, 2).unwrap()));
    assert!(!lo.overlaps(p.sub(3, 0).unwrap()));
    unsafe {
        // Lengths that do not fit are errors, not out-of-bounds accesses.
        let e = be.add_inplace(out.ptr(), lo).err().unwrap();
        assert!(matches!(e, ModelError::ShapeMismatch { .. }), "{e}");
        let e = be
            .matmul_forward(out.ptr(), p, p, None, 2, 3, 2)
            .err()
            .unwrap();
        assert!(matches!(e, ModelError::ShapeMismatch { .. }), "{e}");
        // An output overlapping an input is refused.
        let e = be.add_inplace(lo, p.sub(1, 3).unwrap()).err().unwrap();
        assert!(matches!(e, ModelError::InvalidConfig(_)), "{e}");
        let e = be.gelu_forward(p, p).err().unwrap();
        assert!(matches!(e, ModelError::InvalidConfig(_)), "{e}");
        // And a valid op works on sub-ranges.
        be.add_inplace(lo, hi).unwrap();
    }
    assert_eq!(be.download_buf(&a).unwrap(), [5.0, 7.0, 9.0, 4.0, 5.0, 6.0]);
}

/// `set_moments` (the optimizer state that follows weights a joiner
/// imported first) replaces the AdamW moments and step count only, on the
/// CPU stage and the device stage alike: the parameters stay, and so do the
/// activations a forward kept for its backward (the same microbatch's
/// forward again is refused as a duplicate, where `set_state` would have
/// dropped them); moments of the wrong length change nothing.
#[test]
fn set_moments_replaces_the_optimizer_state_only() {
    let cfg = preset("llama-tiny").unwrap();
    let plan = StagePlan::new(&cfg, 3).unwrap();
    let (b, t) = (2, 8);
    let (x, _) = batches(5, 1, b, t).remove(0);
    let n = Stage::new(&cfg, &plan, 0, 1).unwrap().num_params();
    let m: Vec<f32> = (0..n).map(|i| i as f32 * 1e-6).collect();
    let v: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 1e-7).collect();

    let mut cpu = Stage::new(&cfg, &plan, 0, 1).unwrap();
    let before = cpu.state();
    cpu.forward(0, b, t, StageInput::Tokens(&x), None).unwrap();
    assert!(cpu.set_moments(9, &m[1..], &v).is_err());
    assert!(cpu.set_moments(9, &m, &v[1..]).is_err());
    assert_eq!(cpu.state(), before);
    cpu.set_moments(9, &m, &v).unwrap();
    let after = cpu.state();
    assert_eq!((after.step, &after.m, &after.v), (9, &m, &v));
    assert_eq!(after.params, before.params);
    let again = cpu.forward(0, b, t, StageInput::Tokens(&x), None);
    assert_eq!(again.err(), Some(ModelError::DuplicateMicrobatch(0)));

    let be = Arc::new(HostBackend);
    let mut dev = DeviceStage::all(&be, &cfg, &plan, 1).unwrap().remove(0);
    let before = dev.state().unwrap();
    let tok = DeviceIds::upload(&*be, &x, cfg.vocab_size).unwrap();
    dev.forward(0, b, t, DeviceInput::Tokens(tok.clone()), None)
        .unwrap();
    assert!(dev.set_moments(9, &m[1..], &v).is_err());
    assert_eq!(dev.state().unwrap(), before);
    dev.set_moments(9, &m, &v).unwrap();
    let after = dev.state().unwrap();
    assert_eq!((after.step, &after.m, &after.v), (9, &m, &v));
    assert_eq!(after.params, before.params);
    let again = dev.forward(0, b, t, DeviceInput::Tokens(tok), None);
    assert_eq!(again.err(), Some(ModelError::DuplicateMicrobatch(0)));
}
