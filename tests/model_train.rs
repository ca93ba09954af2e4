//! Training a tiny model on the generated corpus for a fixed seed drives the loss down.
use gwtf::model::train::{train, TrainOptions};
use gwtf::model::{preset, Pipeline};

fn run(name: &str, stages: usize) -> (f32, f32) {
    let cfg = preset(name).unwrap();
    let mut o = TrainOptions::for_config(&cfg);
    o.steps = 120;
    o.lr = 1e-2;
    o.warmup = 5;
    o.stages = stages;
    o.seed = 3;
    o.corpus_bytes = 32 * 1024;
    let logs = train(&cfg, &o, |_| {}).unwrap();
    // Initial loss (before any update) against the mean of the last 10 steps
    // (single-microbatch losses are noisy).
    let first = logs[0].loss;
    let last = logs[logs.len() - 10..].iter().map(|l| l.loss).sum::<f32>() / 10.0;
    eprintln!("{name} x{stages}: first {first:.3} last {last:.3}");
    assert!(logs
        .iter()
        .all(|l| l.loss.is_finite() && l.tokens_per_s > 0.0));
    (first, last)
}

#[test]
fn tiny_models_learn() {
    for (name, stages) in [("gpt-tiny", 4), ("llama-tiny", 3)] {
        let (first, last) = run(name, stages);
        assert!(first > 5.0, "{name}: initial loss {first}");
        assert!(last < 0.7 * first, "{name}: loss {first} -> {last}");
    }
}

#[test]
fn training_is_deterministic() {
    let cfg = preset("llama-tiny").unwrap();
    let mut o = TrainOptions::for_config(&cfg);
    o.steps = 3;
    let a = train(&cfg, &o, |_| {}).unwrap();
    let b = train(&cfg, &o, |_| {}).unwrap();
    assert_eq!(
        a.iter().map(|l| l.loss).collect::<Vec<_>>(),
        b.iter().map(|l| l.loss).collect::<Vec<_>>()
    );
    let p1 = Pipeline::new(&cfg, 4, 9).unwrap().params_flat();
    let p2 = Pipeline::new(&cfg, 4, 9).unwrap().params_flat();
    assert_eq!(p1, p2);
}
