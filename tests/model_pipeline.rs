//! The stage pipeline against the unsplit model, microbatches in flight, accumulation,
//! export/import, replica averaging, validation and presets.
use gwtf::model::data::{generate_corpus, tokenize, Batcher};
use gwtf::model::*;

fn batch(seed: u64, b: usize, t: usize) -> (Vec<u32>, Vec<u32>) {
    let text = generate_corpus(seed, 4096);
    Batcher::new(tokenize(&text), seed)
        .unwrap()
        .next_batch(b, t)
        .unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Tolerance of the split-vs-unsplit comparison: the same ops run on the same data in the
/// same order, so results are expected to be bitwise equal; we allow 1e-6 of the largest
/// magnitude (relative) in case a BLAS thread split ever changes a summation order.
const SPLIT_TOL: f32 = 1e-6;

#[test]
fn pipeline_matches_unsplit_model() {
    for name in ["gpt-tiny", "llama-tiny"] {
        let mut cfg = preset(name).unwrap();
        cfg.n_layers = 3;
        let (b, t) = (3, 16);
        let (x, y) = batch(5, b, t);
        let mut whole = Pipeline::new(&cfg, 1, 42).unwrap();
        let l1 = whole.forward_backward(0, b, t, &x, &y).unwrap();
        assert!(
            l1 > 5.0 && l1 < 6.0,
            "initial loss {l1} should be near ln(256)=5.55"
        );
        for k in 2..=cfg.n_layers + 2 {
            let mut split = Pipeline::new(&cfg, k, 42).unwrap();
            assert_eq!(split.stages.len(), k);
            assert_eq!(
                split.params_flat(),
                whole.params_flat(),
                "{name} k={k}: same init"
            );
            let lk = split.forward_backward(0, b, t, &x, &y).unwrap();
            assert!(
                (lk - l1).abs() <= SPLIT_TOL * l1,
                "{name} k={k}: loss {lk} vs {l1}"
            );
            let e = max_rel(&split.grads_flat(), &whole.grads_flat());
            assert!(e <= SPLIT_TOL, "{name} k={k}: gradient rel error {e}");
        }
        // And after an optimizer step, the same parameters.
        let mut split = Pipeline::new(&cfg, 4, 42).unwrap();
        split.forward_backward(0, b, t, &x, &y).unwrap();
        whole.step(&AdamW::default()).unwrap();
        split.step(&AdamW::default()).unwrap();
        assert!(max_rel(&split.params_flat(), &whole.params_flat()) <= SPLIT_TOL);
    }
}

#[test]
fn microbatches_in_flight_and_accumulation() {
    let cfg = preset("llama-tiny").unwrap();
    let (b, t) = (2, 8);
    let data: Vec<_> = (0..3).map(|i| batch(100 + i, b, t)).collect();
    // Reference: one microbatch after another.
    let mut seq = Pipeline::new(&cfg, 4, 7).unwrap();
    let mut losses = vec![];
    for (i, (x, y)) in data.iter().enumerate() {
        losses.push(seq.forward_backward(i as u64, b, t, x, y).unwrap());
    }
    // Interleaved: all forwards first (three microbatches in flight at every stage), then
    // the backwards in another order.
    let mut p = Pipeline::new(&cfg, 4, 7).unwrap();
    for (i, (x, y)) in data.iter().enumerate() {
        let mut h = Vec::new();
        for (si, s) in p.stages.iter_mut().enumerate() {
            let input = if si == 0 {
                StageInput::Tokens(x)
            } else {
                StageInput::Hidden(&h)
            };
            match s
                .forward(10 + i as u64, b, t, input, (si == 3).then_some(&y[..]))
                .unwrap()
            {
                StageOutput::Hidden(v) => {
                    assert_eq!(v.len(), s.act_shape(b, t).numel());
                    h = v
                }
                StageOutput::Loss(l) => assert_eq!(l, losses[i]),
            }
        }
    }
    assert!(p.stages.iter().all(|s| s.in_flight() == 3));
    for mb in [11u64, 12, 10] {
        let mut g: Option<Vec<f32>> = None;
        for s in p.stages.iter_mut().rev() {
            g = s.backward(mb, g.as_deref()).unwrap();
        }
    }
    assert!(p
        .stages
        .iter()
        .all(|s| s.in_flight() == 0 && s.accumulated() == 3));
    // Sums in a different order: equal up to f32 round-off.
    let e = max_rel(&p.grads_flat(), &seq.grads_flat());
    assert!(e < 1e-5, "accumulated gradients differ: {e}");
    // Mean gradient = sum / 3.
    let s = &p.stages[1];
    let mean = s.mean_grads();
    for (m, g) in mean.iter().zip(s.grads()) {
        assert!((m * 3.0 - g).abs() <= 1e-6 * g.abs().max(1e-3));
    }
}

#[test]
fn errors_do_not_panic_or_corrupt() {
    let cfg = preset("gpt-tiny").unwrap();
    let mut p = Pipeline::new(&cfg, 4, 1).unwrap();
    let (x, y) = batch(1, 2, 8);
    let s0 = &mut p.stages[0];
    assert!(matches!(
        s0.backward(5, Some(&[0.0; 4])),
        Err(ModelError::UnknownMicrobatch(5))
    ));
    assert!(matches!(
        s0.forward(1, 2, 8, StageInput::Hidden(&[0.0; 512]), None),
        Err(ModelError::WrongInput(_))
    ));
    let bad: Vec<u32> = vec![300; 16];
    assert!(matches!(
        s0.forward(1, 2, 8, StageInput::Tokens(&bad), None),
        Err(ModelError::TokenOutOfRange { token: 300, .. })
    ));
    assert!(matches!(
        s0.forward(1, 2, 8, StageInput::Tokens(&x[..15]), None),
        Err(ModelError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        s0.forward(1, 2, 17, StageInput::Tokens(&x), None),
        Err(ModelError::InvalidConfig(_))
    ));
    let h = match s0.forward(1, 2, 8, StageInput::Tokens(&x), None).unwrap() {
        StageOutput::Hidden(h) => h,
        _ => unreachable!(),
    };
    assert!(matches!(
        s0.forward(1, 2, 8, StageInput::Tokens(&x), None),
        Err(ModelError::DuplicateMicrobatch(1))
    ));
    // Wrong gradient length: error, and the microbatch is still held.
    assert!(matches!(
        s0.backward(1, Some(&[0.0; 3])),
        Err(ModelError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        s0.backward(1, None),
        Err(ModelError::MissingGradient)
    ));
    assert_eq!(s0.in_flight(), 1);
    assert!(s0.discard(1));
    assert!(!s0.discard(1));
    let last = &mut p.stages[3];
    assert!(matches!(
        last.forward(2, 2, 8, StageInput::Hidden(&h), None),
        Err(ModelError::MissingTargets)
    ));
    last.forward(2, 2, 8, StageInput::Hidden(&h), Some(&y))
        .unwrap();
    assert!(matches!(
        last.backward(2, Some(&h)),
        Err(ModelError::WrongInput(_))
    ));
    assert!(matches!(
        p.stages[1].step(&AdamW::default()),
        Err(ModelError::NothingAccumulated)
    ));
    // Bad configs.
    let mut c = cfg.clone();
    c.n_heads = 5;
    assert!(matches!(
        Pipeline::new(&c, 4, 1),
        Err(ModelError::InvalidConfig(_))
    ));
    assert!(matches!(
        Pipeline::new(&cfg, cfg.n_layers + 3, 1),
        Err(ModelError::InvalidConfig(_))
    ));
    assert!(matches!(
        Pipeline::new(&cfg, 0, 1),
        Err(ModelError::InvalidConfig(_))
    ));
    assert!(matches!(
        preset("gpt-huge"),
        Err(ModelError::UnknownPreset(_))
    ));
    let msg = preset("nope").unwrap_err().to_string();
    assert!(msg.contains("llama-small"), "{msg}");
}

#[test]
fn export_import_and_replica_averaging() {
    let cfg = preset("llama-tiny").unwrap();
    let plan = StagePlan::new(&cfg, 4).unwrap();
    let (b, t) = (2, 8);
    let mut a = Pipeline::new(&cfg, 4, 3).unwrap();
    for i in 0..2 {
        let (x, y) = batch(i, b, t);
        a.forward_backward(i, b, t, &x, &y).unwrap();
        a.step(&AdamW::default()).unwrap();
    }
    // A joining replica downloads stage 2's state and then computes identically.
    let src = &a.stages[2];
    let mut joined = Stage::new(&cfg, &plan, 2, 999).unwrap();
    assert_ne!(joined.params(), src.params());
    joined.import_state(&src.export_state()).unwrap();
    assert_eq!(joined.params(), src.params());
    assert_eq!(joined.steps_taken(), 2);
    let mut other = Stage::new(&cfg, &plan, 2, 5).unwrap();
    other
        .import_params_bytes(&src.export_params_bytes())
        .unwrap();
    assert_eq!(other.params(), src.params());
    // Wrong stage / truncated buffers are refused without change.
    let mut s1 = Stage::new(&cfg, &plan, 1, 5).unwrap();
    let before = s1.params().to_vec();
    assert!(matches!(
        s1.import_state(&src.export_state()),
        Err(ModelError::BadState(_))
    ));
    assert!(s1.import_params_bytes(&[0u8; 7]).is_err());
    assert!(s1.import_params(&[0.0; 3]).is_err());
    assert_eq!(s1.params(), &before[..]);

    // Two replicas of one stage: weighted average of mean gradients, weights =
    // microbatches processed, equals the mean over all microbatches.
    let data: Vec<_> = (0..4).map(|i| batch(50 + i, b, t)).collect();
    let mut all = Pipeline::new(&cfg, 4, 8).unwrap();
    let mut r1 = Pipeline::new(&cfg, 4, 8).unwrap();
    let mut r2 = Pipeline::new(&cfg, 4, 8).unwrap();
    for (i, (x, y)) in data.iter().enumerate() {
        all.forward_backward(i as u64, b, t, x, y).unwrap();
        let r = if i == 0 { &mut r1 } else { &mut r2 };
        r.forward_backward(i as u64, b, t, x, y).unwrap();
    }
    for si in 0..4 {
        let (g1, g2) = (r1.stages[si].mean_grads(), r2.stages[si].mean_grads());
        let w = [
            r1.stages[si].accumulated() as f32,
            r2.stages[si].accumulated() as f32,
        ];
        assert_eq!(w, [1.0, 3.0]);
        let avg = average_replicas(&[&g1, &g2], &w).unwrap();
        let e = max_rel(&avg, &all.stages[si].mean_grads());
        assert!(e < 1e-5, "stage {si}: {e}");
        r1.stages[si].set_mean_grads(&avg).unwrap();
        r2.stages[si].set_mean_grads(&avg).unwrap();
    }
    let opt = AdamW::default();
    r1.step(&opt).unwrap();
    r2.step(&opt).unwrap();
    all.step(&opt).unwrap();
    assert_eq!(
        r1.params_flat(),
        r2.params_flat(),
        "replicas hold identical weights"
    );
    assert!(max_rel(&r1.params_flat(), &all.params_flat()) < 1e-5);
    assert!(average_replicas(&[&[1.0f32][..]], &[0.0]).is_err());
    assert!(average_replicas(&[&[1.0f32][..], &[1.0, 2.0][..]], &[1.0, 1.0]).is_err());
}

#[test]
fn presets_and_stage_costs() {
    assert_eq!(
        preset_names(),
        &[
            "gpt-tiny",
            "llama-tiny",
            "llama-small",
            "llama-124m",
            "gpt2-small",
            "llama-500m",
            "llama-1.5b"
        ]
    );
    for name in preset_names() {
        let cfg = preset(name).unwrap();
        cfg.validate().unwrap();
        let plan = StagePlan::new(&cfg, cfg.n_stages).unwrap();
        let costs = stage_costs(&cfg, &plan, cfg.batch, cfg.seq);
        assert_eq!(costs.len(), cfg.n_stages);
        let total: u64 = costs.iter().map(|c| c.params).sum();
        assert_eq!(total as usize, cfg.total_params(), "{name}");
        for c in &costs {
            assert_eq!(c.bwd_flops, 2 * c.fwd_flops);
            assert!(c.activation_bytes > 0);
            if c.index > 0 {
                assert!(c.fwd_flops > 0, "{name} stage {}", c.index);
            }
        }
        eprintln!(
            "{name}: {} params, {} stages, per-stage params {:?}",
            total,
            costs.len(),
            costs.iter().map(|c| c.params).collect::<Vec<_>>()
        );
    }
    let p = |n: &str| preset(n).unwrap().total_params() as f64;
    assert!((p("llama-small") / 10e6 - 1.0).abs() < 0.15);
    assert!((p("llama-124m") / 124e6 - 1.0).abs() < 0.1);
    assert!((p("llama-500m") / 500e6 - 1.0).abs() < 0.15);
    assert!((p("llama-1.5b") / 1.5e9 - 1.0).abs() < 0.1);
    // GPT-2 small: 124.4M with the head tied to the embedding, plus the untied head.
    let untied_head = 50257.0 * 768.0;
    assert!(((p("gpt2-small") - untied_head) / 124.4e6 - 1.0).abs() < 0.01);
    assert!((6..=8).contains(&preset("llama-124m").unwrap().n_stages));
    assert!((6..=8).contains(&preset("llama-1.5b").unwrap().n_stages));
    // Costs of the real stages agree with what a stage allocates.
    let cfg = preset("llama-tiny").unwrap();
    let plan = StagePlan::new(&cfg, 4).unwrap();
    for (c, s) in stage_costs(&cfg, &plan, 2, 8)
        .iter()
        .zip(Stage::all(&cfg, &plan, 1).unwrap())
    {
        assert_eq!(c.params as usize, s.num_params());
    }
    // FLOPs of a block by hand (llama-124m, one block, b=4, t=1024).
    let cfg = preset("llama-124m").unwrap();
    let plan = StagePlan::new(&cfg, cfg.n_stages).unwrap();
    let c1 = &stage_costs(&cfg, &plan, 4, 1024)[1];
    let (n, d, h, t) = (4096u64, 768u64, 1664u64, 1024u64);
    let mm = 2 * n * d * (3 * d + d + 2 * h) + 2 * n * h * d;
    let attn = 2 * 2 * 4 * 12 * (t * (t + 1) / 2) * 64;
    assert_eq!(c1.fwd_flops, 3 * (mm + attn));
}
