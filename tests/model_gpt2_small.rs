//! The `gpt2-small` preset (GPT-2 small's shape, 163M parameters with its
//! untied head) trains and samples through the tool, as the small presets
//! do: a few steps, slow in a debug build. That it computes GPT-2 itself is
//! checked against Hugging Face's model in `python/tests/test_gpt2_preset.py`.
mod common;

use serde_json::Value;
use std::process::Command;

fn gwtf() -> Command {
    Command::new(common::gwtf_exe())
}

#[test]
fn gpt2_small_trains_saves_and_samples() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = gwtf()
        .args([
            "train",
            "--model",
            "gpt2-small",
            "--steps",
            "2",
            "--batch",
            "1",
        ])
        .args(["--seq", "8", "--heldout-sequences", "1", "--json", "--save"])
        .arg(&ck)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(steps.len(), 2, "{stdout}");
    let loss = |i: usize| steps[i]["loss"].as_f64().unwrap();
    // A random 50257-way head starts near ln(50257) = 10.8; one step on the
    // same bytes lowers it.
    assert!((loss(0) - 10.8).abs() < 1.0, "{stdout}");
    assert!(loss(1) < loss(0), "{stdout}");
    assert!(steps[1]["heldout_loss"].as_f64().unwrap().is_finite());
    let cfg = std::fs::read_to_string(ck.join("config.json")).unwrap();
    assert!(cfg.contains("gpt2-small"), "{cfg}");
    // Sampling draws bytes (ids below 256) from the 50257-way head.
    let out = gwtf()
        .args(["sample", "--prompt", "ab", "--probs", "--checkpoint"])
        .arg(&ck)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let probs = v["probs"].as_array().unwrap();
    assert_eq!(probs.len(), 256);
    let sum: f64 = probs.iter().map(|p| p.as_f64().unwrap()).sum();
    // The bytes' share of the 50257-way distribution.
    assert!(sum > 0.0 && sum <= 1.0 + 1e-4, "{sum}");
}
