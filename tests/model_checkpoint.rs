//! Keeping a trained model: checkpoints (round trip, resume equals uninterrupted training,
//! damaged files), training on text files, sampling, and the `gwtf train` / `gwtf sample`
//! command line end to end. Tiny models and a few steps: fast on two cores.

mod common;

use common::*;
use gwtf::model::checkpoint::{self, CheckpointConfig};
use gwtf::model::dataset::{DataSource, Dataset};
use gwtf::model::gpu::{DevicePipeline, HostBackend};
use gwtf::model::sample::{generate, pipeline_from_checkpoint, SampleOptions};
use gwtf::model::train::{TrainModel, TrainOptions, Trainer};
use gwtf::model::{preset, ModelConfig, Pipeline, StageState};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn gwtf() -> Command {
    Command::new(common::gwtf_exe())
}

fn text_file() -> PathBuf {
    repo_root().join("tests/data/lighthouse.txt")
}

fn setup(
    name: &str,
    stages: usize,
    accum: usize,
    files: bool,
) -> (ModelConfig, TrainOptions, Dataset) {
    let cfg = preset(name).unwrap();
    let mut o = TrainOptions::for_config(&cfg);
    o.steps = 6;
    o.warmup = 2;
    o.lr = 1e-2;
    o.stages = stages;
    o.accum = accum;
    o.corpus_bytes = 8 * 1024;
    let src = if files {
        DataSource::Files(vec![text_file()])
    } else {
        DataSource::Synthetic {
            seed: o.seed,
            bytes: o.corpus_bytes,
        }
    };
    let data = Dataset::load(&src, o.seq).unwrap();
    (cfg, o, data)
}

/// A stage state as bits: index, step, params, m, v.
type Bits = (usize, u64, [Vec<u32>; 3]);

fn bits(s: &[StageState]) -> Vec<Bits> {
    let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    s.iter()
        .map(|s| (s.index, s.step, [b(&s.params), b(&s.m), b(&s.v)]))
        .collect()
}

fn save<M: TrainModel>(t: &Trainer<M>, cfg: &ModelConfig, dir: &Path) {
    let (states, progress) = t.checkpoint_state().unwrap();
    let c = CheckpointConfig::new(cfg, t.options(), &t.data().description, &progress).unwrap();
    checkpoint::save(dir, &c, &states).unwrap();
}

#[test]
fn save_and_load_round_trip_bit_exact() {
    let (cfg, o, data) = setup("gpt-tiny", 3, 1, false);
    let mut t = Trainer::new(
        Pipeline::new(&cfg, o.stages, o.seed).unwrap(),
        o.clone(),
        data,
    )
    .unwrap();
    t.run(3, |_| {}).unwrap();
    let dir = scratch("ckpt-round-trip");
    save(&t, &cfg, &dir);
    let ck = checkpoint::load(&dir).unwrap();
    let (states, progress) = t.checkpoint_state().unwrap();
    assert_eq!(bits(&ck.stages), bits(&states));
    assert!(ck.stages.iter().all(|s| s.step == 3));
    assert_eq!(ck.config.progress(), progress);
    assert_eq!(ck.config.options(), o);
    assert_eq!(ck.config.model_config().unwrap().d_model, cfg.d_model);
    // Saving the loaded state again gives the same bytes (stage files can be compared).
    let again = scratch("ckpt-round-trip-again");
    checkpoint::save(&again, &ck.config, &ck.stages).unwrap();
    for f in ["config.json", "stage-0.safetensors", "stage-2.safetensors"] {
        assert_eq!(
            std::fs::read(dir.join(f)).unwrap(),
            std::fs::read(again.join(f)).unwrap(),
            "{f}"
        );
    }
}

/// Runs `a` steps, saves, loads into a fresh model, runs `b` more; and `a + b` in one go.
fn resume_vs_straight<M: TrainModel>(
    cfg: &ModelConfig,
    o: &TrainOptions,
    data: &Dataset,
    new: impl Fn() -> M,
    dir: &Path,
) {
    let (a, b) = (4, 3);
    let mut o = o.clone();
    o.steps = a + b;
    let mut straight = Trainer::new(new(), o.clone(), data.clone()).unwrap();
    let logs = straight.run(a + b, |_| {}).unwrap();

    let mut first = Trainer::new(new(), o.clone(), data.clone()).unwrap();
    first.run(a, |_| {}).unwrap();
    save(&first, cfg, dir);
    drop(first);
    let ck = checkpoint::load(dir).unwrap();
    let mut second = Trainer::new(new(), ck.config.options(), data.clone()).unwrap();
    second.resume(&ck.stages, &ck.config.progress()).unwrap();
    let rest = second.run(b, |_| {}).unwrap();

    let loss_bits = |l: &[gwtf::model::StepLog]| {
        l.iter()
            .map(|l| (l.step, l.loss.to_bits(), l.lr.to_bits()))
            .collect::<Vec<_>>()
    };
    assert_eq!(loss_bits(&rest), loss_bits(&logs[a..]));
    assert_eq!(
        bits(&second.checkpoint_state().unwrap().0),
        bits(&straight.checkpoint_state().unwrap().0)
    );
    assert_eq!(second.progress(), straight.progress());
    assert_eq!(
        second.heldout_loss().unwrap().to_bits(),
        straight.heldout_loss().unwrap().to_bits()
    );
}

#[test]
fn resume_equals_uninterrupted_training() {
    // CPU pipeline: LLaMA on a text file with accumulation, GPT on the generated corpus.
    let (cfg, o, data) = setup("llama-tiny", 4, 2, true);
    let dir = scratch("ckpt-resume-llama");
    resume_vs_straight(
        &cfg,
        &o,
        &data,
        || Pipeline::new(&cfg, 4, o.seed).unwrap(),
        &dir,
    );
    let (cfg, o, data) = setup("gpt-tiny", 2, 1, false);
    let dir = scratch("ckpt-resume-gpt");
    resume_vs_straight(
        &cfg,
        &o,
        &data,
        || Pipeline::new(&cfg, 2, o.seed).unwrap(),
        &dir,
    );
    // The device pipeline (on the host backend) saves and restores the same way.
    let (cfg, o, data) = setup("llama-tiny", 3, 1, true);
    let dir = scratch("ckpt-resume-device");
    resume_vs_straight(
        &cfg,
        &o,
        &data,
        || DevicePipeline::new(Arc::new(HostBackend), &cfg, 3, o.seed).unwrap(),
        &dir,
    );
}

#[test]
fn a_checkpoint_for_another_model_is_refused() {
    let (cfg, o, data) = setup("llama-tiny", 4, 1, false);
    let t = Trainer::new(Pipeline::new(&cfg, 4, o.seed).unwrap(), o, data).unwrap();
    let dir = scratch("ckpt-other-model");
    save(&t, &cfg, &dir);
    let ck = checkpoint::load(&dir).unwrap();
    let mut three = Pipeline::new(&cfg, 3, 1).unwrap();
    let e = three.set_states(&ck.stages).unwrap_err().to_string();
    assert!(e.contains("4 stage states for a 3-stage pipeline"), "{e}");
    let gpt = preset("gpt-tiny").unwrap();
    let mut other = Pipeline::new(&gpt, 4, 1).unwrap();
    let e = other.set_states(&ck.stages).unwrap_err().to_string();
    assert!(e.contains("bad stage state"), "{e}");
}

fn corrupt(dir: &Path, file: &str, f: impl FnOnce(&mut Vec<u8>)) -> String {
    let mut b = std::fs::read(dir.join(file)).unwrap();
    f(&mut b);
    std::fs::write(dir.join(file), b).unwrap();
    checkpoint::load(dir).unwrap_err().to_string()
}

#[test]
fn damaged_checkpoints_are_clear_errors() {
    let (cfg, o, data) = setup("llama-tiny", 4, 1, false);
    let mut t = Trainer::new(Pipeline::new(&cfg, 4, o.seed).unwrap(), o, data).unwrap();
    t.run(1, |_| {}).unwrap();
    let good = scratch("ckpt-good");
    save(&t, &cfg, &good);
    let fresh = |name: &str| {
        let d = scratch(name);
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    };
    type Damage = Box<dyn FnOnce(&mut Vec<u8>)>;
    let cases: Vec<(&str, &str, Damage, &str)> = vec![
        (
            "truncated",
            "stage-1.safetensors",
            Box::new(|b| b.truncate(b.len() / 2)),
            "not a valid safetensors file",
        ),
        (
            "tiny",
            "stage-2.safetensors",
            Box::new(|b| b.truncate(5)),
            "not a valid safetensors file",
        ),
        (
            "empty",
            "stage-0.safetensors",
            Box::new(|b| b.clear()),
            "not a valid safetensors file",
        ),
        (
            "bitflip",
            "stage-3.safetensors",
            Box::new(|b| {
                let n = b.len() - 10;
                b[n] ^= 0x40;
            }),
            "checksum mismatch",
        ),
        (
            "header",
            "stage-1.safetensors",
            Box::new(|b| b[20] = b'!'),
            "not a valid safetensors file",
        ),
        (
            "config",
            "config.json",
            Box::new(|b| b.truncate(b.len() / 2)),
            "not a valid checkpoint config",
        ),
    ];
    for (name, file, f, want) in cases {
        let d = fresh(&format!("ckpt-{name}"));
        let e = corrupt(&d, file, f);
        assert!(e.starts_with("checkpoint: "), "{name}: {e}");
        assert!(e.contains(file), "{name}: {e}");
        assert!(e.contains(want), "{name}: {e}");
    }
    // A missing stage file, a stage file in another's place, one from another step.
    let d = fresh("ckpt-missing");
    std::fs::remove_file(d.join("stage-2.safetensors")).unwrap();
    let e = checkpoint::load(&d).unwrap_err().to_string();
    assert!(e.contains("stage-2.safetensors: cannot read"), "{e}");
    let d = fresh("ckpt-swapped");
    std::fs::copy(d.join("stage-1.safetensors"), d.join("stage-2.safetensors")).unwrap();
    let e = checkpoint::load(&d).unwrap_err().to_string();
    assert!(
        e.contains("stage-2.safetensors: metadata stage is \"1\", expected \"2\""),
        "{e}"
    );
    let later = scratch("ckpt-later");
    t.run(1, |_| {}).unwrap();
    save(&t, &cfg, &later);
    let d = fresh("ckpt-mixed");
    std::fs::copy(
        later.join("stage-3.safetensors"),
        d.join("stage-3.safetensors"),
    )
    .unwrap();
    let e = checkpoint::load(&d).unwrap_err().to_string();
    assert!(
        e.contains("metadata steps_done is \"2\", expected \"1\""),
        "{e}"
    );
    let e = checkpoint::load(&scratch("ckpt-nothing"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json: cannot read"), "{e}");
}

#[test]
fn sampling_is_deterministic_and_greedy_is_the_argmax() {
    let (cfg, o, data) = setup("llama-tiny", 4, 1, true);
    let mut t = Trainer::new(Pipeline::new(&cfg, 4, o.seed).unwrap(), o, data).unwrap();
    t.run(5, |_| {}).unwrap();
    let dir = scratch("ckpt-sample");
    save(&t, &cfg, &dir);
    let mut p = pipeline_from_checkpoint(&checkpoint::load(&dir).unwrap()).unwrap();
    let prompt: Vec<u32> = b"The keeper".iter().map(|&b| b as u32).collect();
    let opts = |temperature, seed| SampleOptions {
        tokens: 24,
        temperature,
        seed,
    };
    let a = generate(&mut p, &prompt, &opts(1.0, 7)).unwrap();
    assert_eq!(a.len(), 24);
    assert!(a.iter().all(|&x| x < 256));
    assert_eq!(a, generate(&mut p, &prompt, &opts(1.0, 7)).unwrap());
    assert_ne!(a, generate(&mut p, &prompt, &opts(1.0, 8)).unwrap());
    let g = generate(&mut p, &prompt, &opts(0.0, 1)).unwrap();
    assert_eq!(g, generate(&mut p, &prompt, &opts(0.0, 2)).unwrap());
    // Greedy: each token is the argmax of the model's distribution after the ones before.
    let mut ctx = prompt.clone();
    for &tok in &g {
        let start = ctx.len().saturating_sub(cfg.max_seq);
        let probs = p.next_token_probs(&ctx[start..]).unwrap();
        let best = probs
            .iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > probs[b] { i } else { b });
        assert_eq!(tok as usize, best);
        ctx.push(tok);
    }
    assert!(generate(&mut p, &[], &opts(0.0, 1)).is_err());
}

// ------------------------------------------------------------------------------------------
// The command line

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json_lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    stdout_of(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn cli_train_save_resume_and_sample() {
    let dir = scratch("cli-train");
    let data = text_file();
    let train = |extra: &[&str]| {
        let mut c = gwtf();
        c.args(["train", "--model", "llama-tiny", "--json", "--data"])
            .arg(&data)
            .args(extra);
        run_ok(&mut c)
    };
    // 5 steps in one go, and 3 + 2 through a checkpoint: the same files.
    let whole = dir.join("whole");
    let lines = json_lines(&train(&["--steps", "5", "--save", whole.to_str().unwrap()]));
    assert_eq!(lines.len(), 5);
    let last = &lines[4];
    assert_eq!(last["step"], 5);
    let held = last["heldout_loss"].as_f64().unwrap();
    assert!(held.is_finite() && held > 0.0 && held < 6.0, "{last}");
    assert_eq!(last["checkpoint"], whole.to_str().unwrap());
    let part = dir.join("part");
    train(&[
        "--steps",
        "3",
        "--schedule-steps",
        "5",
        "--save",
        part.to_str().unwrap(),
    ]);
    let resumed = dir.join("resumed");
    let mut c = gwtf();
    c.args(["train", "--json", "--steps", "2", "--resume"])
        .arg(&part)
        .arg("--save")
        .arg(&resumed);
    let lines = json_lines(&run_ok(&mut c));
    assert_eq!(lines[0]["step"], 4);
    assert_eq!(lines[1]["heldout_loss"].as_f64().unwrap(), held);
    for f in [
        "config.json",
        "stage-0.safetensors",
        "stage-1.safetensors",
        "stage-2.safetensors",
        "stage-3.safetensors",
    ] {
        assert_eq!(
            std::fs::read(whole.join(f)).unwrap(),
            std::fs::read(resumed.join(f)).unwrap(),
            "{f} differs between 5 steps and 3 + 2"
        );
    }
    // The human output reports the held-out loss and the checkpoint.
    let mut c = gwtf();
    c.args(["train", "--steps", "2", "--resume"]).arg(&whole);
    let text = stdout_of(&run_ok(&mut c));
    assert!(text.contains("resuming "), "{text}");
    assert!(text.contains("step     6"), "{text}");
    assert!(text.contains("held-out loss "), "{text}");
    // Options that contradict the checkpoint.
    for (args, want) in [
        (vec!["--model", "gpt-tiny"], "does not match the checkpoint"),
        (
            vec!["--seq", "8"],
            "--seq 8 differs from the checkpoint's 16",
        ),
        (
            vec!["--data", "README.md"],
            "the training data is not the checkpoint's",
        ),
    ] {
        let mut c = gwtf();
        c.current_dir(repo_root())
            .args(["train", "--steps", "1", "--resume"])
            .arg(&whole)
            .args(&args);
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(
            stderr_of(&out).contains(want),
            "{args:?}: {}",
            stderr_of(&out)
        );
        assert_eq!(stdout_of(&out), "");
    }
    // A checkpoint of another shape than this build's preset of that name.
    let edited = dir.join("edited");
    std::fs::create_dir_all(&edited).unwrap();
    for e in std::fs::read_dir(&whole).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), edited.join(e.file_name())).unwrap();
    }
    let c = std::fs::read_to_string(edited.join("config.json")).unwrap();
    let c = c.replace("\"rope_base\": 10000.0", "\"rope_base\": 500.0");
    std::fs::write(edited.join("config.json"), c).unwrap();
    let out = gwtf()
        .args(["train", "--steps", "1", "--resume"])
        .arg(&edited)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr_of(&out).contains("is not this build's llama-tiny (rope_base: 500.0 vs 10000.0)"),
        "{}",
        stderr_of(&out)
    );
    // Sampling: the prompt then the continuation; the same for a seed; greedy at 0.
    let sample = |extra: &[&str]| {
        let mut c = gwtf();
        c.args(["sample", "--checkpoint"])
            .arg(&whole)
            .args(["--prompt", "The light", "--tokens", "30"])
            .args(extra);
        stdout_of(&run_ok(&mut c))
    };
    let a = sample(&["--seed", "3"]);
    assert!(a.starts_with("The light"), "{a}");
    assert_eq!(a, sample(&["--seed", "3"]));
    assert_eq!(
        sample(&["--temperature", "0", "--seed", "1"]),
        sample(&["--temperature", "0", "--seed", "2"])
    );
    for (args, want) in [
        (vec!["--prompt", ""], "--prompt must not be empty"),
        (
            vec!["--prompt", "x", "--temperature=-1"],
            "--temperature -1 must be >= 0",
        ),
    ] {
        let mut c = gwtf();
        let out = c
            .args(["sample", "--checkpoint"])
            .arg(&whole)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(stderr_of(&out).contains(want), "{}", stderr_of(&out));
    }
    let out = gwtf()
        .args(["sample", "--prompt", "x", "--checkpoint"])
        .arg(dir.join("none"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr_of(&out).contains("config.json: cannot read"),
        "{}",
        stderr_of(&out)
    );
}

#[test]
fn cli_bad_training_files_are_named_before_training() {
    let dir = scratch("cli-bad-data");
    let bin = dir.join("binary.txt");
    std::fs::write(
        &bin,
        b"some text \xff\xfe then more text that is long enough to train on",
    )
    .unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "Too short.").unwrap();
    let missing = dir.join("missing.txt");
    for (file, want) in [
        (&missing, "missing.txt: cannot read: No such file"),
        (
            &bin,
            "binary.txt: not UTF-8 text (invalid byte at offset 10)",
        ),
        (&short, "short.txt: 10 bytes is too short"),
    ] {
        let out = gwtf()
            .args(["train", "--steps", "1", "--data"])
            .arg(text_file())
            .arg(file)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = stderr_of(&out);
        assert!(err.starts_with("gwtf: error: training data: "), "{err}");
        assert!(err.contains(want), "{err}");
        assert_eq!(
            stdout_of(&out),
            "",
            "nothing is printed before the data is read"
        );
    }
}

#[test]
fn cli_cuda_without_a_device_prints_no_banner() {
    // With the stand-in driver (present, no device): the error, and nothing on stdout.
    let out = gwtf()
        .args(["train", "--steps", "1", "--device", "cuda"])
        .env("LD_LIBRARY_PATH", stub_libcuda_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_of(&out),
        "gwtf: error: device unavailable: CUDA driver present but no device \
         (CUDA_ERROR_NO_DEVICE)\n"
    );
    assert_eq!(
        stdout_of(&out),
        "",
        "no banner claims a device it has not opened"
    );
}
