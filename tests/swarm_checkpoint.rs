//! Checkpoints of a swarm (`gwtf node --save DIR --save-every K`, a data
//! holder writing every stage's state of one iteration) and a swarm
//! resumed from one (`gwtf node --resume DIR`): `gwtf node` processes on
//! loopback. The checkpoint holds the weights the replicas printed, loads
//! in `gwtf sample` with the single-process model's probabilities, and a
//! resumed swarm trains on with the uninterrupted run's losses; a writer
//! killed in the middle of a checkpoint leaves no checkpoint half-written.
mod common;

use common::swarm_procs::{llama_tiny_args, llama_tiny_reference, Seen, Swarm};
use gwtf::model::checkpoint;
use gwtf::model::dataset::Dataset;
use gwtf::model::preset;
use gwtf::protocol::NodeId;
use gwtf::swarm::model_checkpoint::read_manifest;
use gwtf::swarm::model_trainer::{reference_run, ModelRun};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const MB: u32 = 3;
const SEED: u64 = 5;
const LONG: u32 = 12;
const PROMPT: &str = "The keeper of the light";

fn layout() -> Vec<(u32, u16)> {
    vec![(1, 0), (2, 0), (11, 1), (21, 2)]
}

/// The mean loss of each iteration final in `ev`.
fn losses(ev: &[Seen]) -> BTreeMap<u64, f64> {
    let mut by: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for e in ev.iter().filter(|e| e.event() == "iteration") {
        by.entry(e.u("iteration"))
            .or_default()
            .push(e.v["loss"].as_f64().unwrap());
    }
    by.into_iter()
        .map(|(k, l)| (k, l.iter().sum::<f64>() / l.len() as f64))
        .collect()
}

fn gwtf(args: &[&str]) -> std::process::Output {
    Command::new(common::gwtf_exe())
        .args(args)
        .output()
        .unwrap()
}

/// The probabilities `gwtf sample --probs` prints for the checkpoint in
/// `dir`.
fn sampled_probs(dir: &Path) -> Vec<f64> {
    let out = gwtf(&[
        "sample",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--probs",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p: Vec<f64> = (v["probs"].as_array().unwrap().iter())
        .map(|x| x.as_f64().unwrap())
        .collect();
    p
}

/// A holder writes checkpoints at iterations 4 and 9; the newest holds
/// the weights digests the replicas of each stage printed for iteration 9,
/// gives the single-process model's next-byte probabilities after 10
/// iterations in `gwtf sample`, is read by `gwtf train --resume`; a swarm
/// whose founding members all `--resume` from it runs iterations 10 and 11
/// with the uninterrupted run's losses.
#[test]
fn a_swarm_checkpoint_holds_the_replicas_weights_and_resumes_the_run() {
    let args = llama_tiny_args(LONG, MB, SEED, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let saved = tempfile::tempdir().unwrap();
    let dir = saved.path().join("ck");
    let d = dir.to_str().unwrap();
    let save: &[&str] = &["--save", d, "--save-every", "5"];
    let ev = {
        let swarm = Swarm::start(&layout(), &args, &[(1, save)]);
        swarm.until_done(&[1, 2])
    };
    let written: Vec<u64> = (ev.iter())
        .filter(|e| e.node == 1 && e.event() == "checkpoint")
        .map(|e| e.u("iteration"))
        .collect();
    assert_eq!(
        written,
        [4, 9],
        "{:?}",
        ev.iter()
            .filter(|e| e.event().starts_with("checkpoint"))
            .map(|e| &e.v)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("LATEST")).unwrap().trim(),
        "iteration-000009"
    );
    let newest = dir.join("iteration-000009");
    let m = read_manifest(&newest).unwrap();
    assert_eq!(m.iteration, 9);
    for s in &m.stages {
        let printed: Vec<&str> = (ev.iter())
            .filter(|e| {
                e.event() == "applied" && e.u("stage") == s.stage as u64 && e.u("iteration") == 9
            })
            .map(|e| e.s("weights_sha256"))
            .collect();
        assert!(
            !printed.is_empty(),
            "no replica of stage {} printed iteration 9",
            s.stage
        );
        assert!(
            printed.iter().all(|p| *p == s.weights_sha256),
            "stage {}: manifest {} printed {printed:?}",
            s.stage,
            s.weights_sha256
        );
    }
    let mut stages: Vec<u16> = m.stages.iter().map(|s| s.stage).collect();
    stages.sort_unstable();
    assert_eq!(stages, [0, 1, 2]);
    assert_eq!(checkpoint::load(&dir).unwrap().config.steps_done, 10);

    // The single-process model trained on the same microbatches.
    let run = ModelRun::new(preset("llama-tiny").unwrap(), 4, SEED, LONG as usize).unwrap();
    let docs = Dataset::synthetic(SEED, run.opts.corpus_bytes, run.opts.seq).train;
    let holders: Vec<(NodeId, &[Vec<u32>])> = vec![(1, &docs[..]), (2, &docs[..])];
    let (_, mut reference) = reference_run(&run, &holders, MB, 10, |_, _| {}).unwrap();
    let t: Vec<u32> = PROMPT.bytes().map(u32::from).collect();
    let want = reference
        .next_token_probs(&t[t.len().saturating_sub(run.cfg.max_seq)..])
        .unwrap();
    let got = sampled_probs(&dir);
    assert_eq!(got.len(), want.len());
    let off = (got.iter().zip(&want))
        .map(|(g, w)| (g - *w as f64).abs())
        .fold(0.0, f64::max);
    eprintln!("next-byte probabilities: swarm checkpoint vs single-process model, max difference {off:.2e}");
    assert!(off < 1e-5, "max difference {off}");
    let out = gwtf(&[
        "sample",
        "--checkpoint",
        d,
        "--prompt",
        PROMPT,
        "--tokens",
        "20",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // `gwtf train --resume` reads it (two steps more).
    let trained = saved.path().join("trained");
    let out = gwtf(&[
        "train",
        "--resume",
        d,
        "--steps",
        "2",
        "--save",
        trained.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(checkpoint::load(&trained).unwrap().config.steps_done, 12);

    // Every founding member resumes from it.
    let resume: &[&str] = &["--resume", d];
    let extra: Vec<(u32, &[&str])> = layout().iter().map(|&(id, _)| (id, resume)).collect();
    let ev = {
        let swarm = Swarm::start(&layout(), &args, &extra);
        swarm.until_done(&[1, 2])
    };
    let errors: Vec<_> = ev
        .iter()
        .filter(|e| e.event() == "error")
        .map(|e| &e.v)
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    let got = losses(&ev);
    let want = llama_tiny_reference(LONG, MB, SEED);
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), [10, 11], "{got:?}");
    for (k, l) in &got {
        let w = want[*k as usize] as f64;
        eprintln!("resumed iteration {k}: loss {l:.6}, uninterrupted {w:.6}");
        assert!((l - w).abs() <= 1e-4 * w.abs(), "iteration {k}: {l} vs {w}");
    }
}

/// The holder is SIGKILLed while a checkpoint is written (every file of
/// iteration 3's written, not yet named): what it leaves is the checkpoint
/// of iteration 1, whole, and a temporary directory no reader takes for a
/// checkpoint.
#[test]
fn a_writer_killed_mid_checkpoint_leaves_the_last_whole_one() {
    let args = llama_tiny_args(LONG, MB, SEED, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let saved = tempfile::tempdir().unwrap();
    let dir = saved.path().join("ck");
    let d = dir.to_str().unwrap();
    let save: &[&str] = &["--save", d, "--save-every", "2", "--save-pause-ms", "3000"];
    let mut swarm = Swarm::start(&layout(), &args, &[(1, save)]);
    swarm.until("the first checkpoint", |ev| {
        ev.iter().any(|e| e.node == 1 && e.event() == "checkpoint")
    });
    // The next one, paused with every file written.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let tmp = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no second checkpoint began"
        );
        let found = std::fs::read_dir(&dir).unwrap().flatten().find(|e| {
            e.file_name().to_string_lossy().starts_with(".tmp-")
                && e.path().join("manifest.json").exists()
        });
        if let Some(f) = found {
            break f.path();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    swarm.kill(1);
    let names: Vec<String> = (std::fs::read_dir(&dir).unwrap().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("iteration-"))
        .collect();
    assert_eq!(names, ["iteration-000001"], "{names:?}");
    assert!(tmp.exists());
    let ck = checkpoint::load(&dir).unwrap();
    assert_eq!(ck.config.steps_done, 2);
    assert_eq!(
        read_manifest(&dir.join("iteration-000001"))
            .unwrap()
            .iteration,
        1
    );
    // The temporary directory is no checkpoint of its own (no LATEST names
    // it, and it is not a name a reader takes).
    assert!(checkpoint::resolve(&dir)
        .unwrap()
        .ends_with("iteration-000001"));
}
