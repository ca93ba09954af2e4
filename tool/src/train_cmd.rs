//! `gwtf train`: trains the reference model in one process (stages run one after another),
//! on the CPU or on a CUDA device, on the generated corpus or on text files; reports the
//! held-out loss; saves and resumes checkpoints.
use clap::{Args, ValueEnum};
use gwtf::model::checkpoint::{self, config_difference, Checkpoint, CheckpointConfig};
use gwtf::model::dataset::{DataDescription, DataSource, Dataset, MAX_HELDOUT_SEQUENCES};
use gwtf::model::train::{TrainModel, TrainOptions, Trainer};
use gwtf::model::{preset, ModelConfig, Pipeline, StepLog};
use std::path::PathBuf;

/// The presets a swarm trains here (`gwtf demo`, `gwtf bench swarm`).
pub const TRAINABLE: [&str; 3] = ["gpt-tiny", "llama-tiny", "llama-small"];

/// What `gwtf train` (one process) trains: the swarm's presets and
/// `gpt2-small`, GPT-2 small's shape (slow on a CPU; not yet run as a swarm).
pub const TRAINABLE_ALONE: [&str; 4] = ["gpt-tiny", "llama-tiny", "llama-small", "gpt2-small"];

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CPU kernels (rayon + matrixmultiply).
    Cpu,
    /// CUDA device 0: cuBLAS matrix multiplies and our NVRTC kernels, everything resident
    /// on the device.
    Cuda,
}

#[derive(Args)]
pub struct TrainArgs {
    /// Model preset: gpt-tiny, llama-tiny, llama-small or gpt2-small (GPT-2 small's
    /// shape, slow on a CPU) [default: llama-tiny, or the
    /// checkpoint's with --resume].
    #[arg(long)]
    model: Option<String>,
    /// Optimizer steps to run (with --resume: steps more).
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Horizon of the learning-rate schedule (linear warmup over a tenth of it, at most
    /// 20 steps, then cosine decay to 10% at this step, constant after) [default: the
    /// steps of this run, or the checkpoint's with --resume].
    #[arg(long)]
    schedule_steps: Option<usize>,
    /// Device.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Seed of initialisation, generated corpus and data order [default: 1].
    #[arg(long)]
    seed: Option<u64>,
    /// UTF-8 text files to train on, byte by byte (the last tenth of each is held out)
    /// [default: a generated English-like corpus, 64 KiB (512 KiB for llama-small), with
    /// a separately generated held-out text].
    #[arg(long, num_args = 1.., value_name = "FILE")]
    data: Vec<PathBuf>,
    /// Save a checkpoint in this directory at the end (config.json and one
    /// stage-K.safetensors per stage; see docs/CHECKPOINT.md).
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Continue the run saved in this directory (model, options, data, data order); an
    /// option given that differs from the checkpoint's is an error.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Print one JSON object per logged step instead of text (the last one also has
    /// heldout_loss, and checkpoint when saved).
    #[arg(long)]
    json: bool,
    /// Pipeline stages [default: the preset's].
    #[arg(long)]
    stages: Option<usize>,
    /// Peak learning rate [default: 1e-2 for d_model <= 64, else 1e-3].
    #[arg(long)]
    lr: Option<f32>,
    /// Sequences per microbatch [default: the preset's].
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence [default: the preset's].
    #[arg(long)]
    seq: Option<usize>,
    /// Microbatches accumulated per optimizer step [default: 1].
    #[arg(long)]
    accum: Option<usize>,
    /// Log every N steps (the first and last steps are always logged).
    #[arg(long, default_value_t = 1)]
    log_every: usize,
    /// Held-out sequences the final loss is evaluated on (at most
    /// 64; fewer for a large model on a CPU: each costs a forward).
    #[arg(long, value_name = "N", default_value_t = MAX_HELDOUT_SEQUENCES,
          allow_negative_numbers = true,
          value_parser = super::checks::int_in::<usize>(1, MAX_HELDOUT_SEQUENCES as i128))]
    heldout_sequences: usize,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The model and options of a fresh run.
fn fresh(a: &TrainArgs) -> Res<(ModelConfig, TrainOptions)> {
    let name = a.model.as_deref().unwrap_or("llama-tiny");
    let cfg = preset(name)?;
    if !TRAINABLE_ALONE.contains(&name) {
        return Err(format!(
            "--model {name}: only {} are trained here (the other presets are shapes \
             for the simulator)",
            TRAINABLE_ALONE.join(", ")
        )
        .into());
    }
    let mut o = TrainOptions::for_run(&cfg, a.schedule_steps.unwrap_or(a.steps));
    o.seed = a.seed.unwrap_or(1);
    o.accum = a.accum.unwrap_or(1);
    if let Some(lr) = a.lr {
        o.lr = lr;
    }
    o.stages = a.stages.unwrap_or(o.stages);
    o.batch = a.batch.unwrap_or(o.batch);
    o.seq = a.seq.unwrap_or(o.seq);
    Ok((cfg, o))
}

/// The model and options of a resumed run: the checkpoint's, checked against what was
/// asked for.
fn resumed(
    a: &TrainArgs,
    ck: &Checkpoint,
    dir: &std::path::Path,
) -> Res<(ModelConfig, TrainOptions)> {
    let c = &ck.config;
    let name = a.model.as_deref().unwrap_or(&c.model.name);
    let mut here = preset(name)?;
    if name != c.model.name {
        return Err(format!(
            "--model {name} does not match the checkpoint in {}, which holds {}",
            dir.display(),
            c.model.name
        )
        .into());
    }
    (here.n_stages, here.batch, here.seq) = (c.model.n_stages, c.model.batch, c.model.seq);
    if let Some(d) = config_difference(&c.model, &here) {
        return Err(format!("the checkpoint's {name} is not this build's {name} ({d})").into());
    }
    let mut o = c.options();
    let differs = |what: &str, asked: String, saved: String| -> Res<()> {
        Err(format!(
            "{what} {asked} differs from the checkpoint's {saved} (in {}); leave it out to \
             continue the saved run",
            dir.display()
        )
        .into())
    };
    let checks = [
        ("--seed", a.seed.map(|x| x.to_string()), o.seed.to_string()),
        (
            "--stages",
            a.stages.map(|x| x.to_string()),
            o.stages.to_string(),
        ),
        (
            "--batch",
            a.batch.map(|x| x.to_string()),
            o.batch.to_string(),
        ),
        ("--seq", a.seq.map(|x| x.to_string()), o.seq.to_string()),
        (
            "--accum",
            a.accum.map(|x| x.to_string()),
            o.accum.to_string(),
        ),
        ("--lr", a.lr.map(|x| x.to_string()), o.lr.to_string()),
    ];
    for (what, asked, saved) in checks {
        if let Some(asked) = asked {
            if asked != saved {
                differs(what, asked, saved)?;
            }
        }
    }
    if let Some(h) = a.schedule_steps {
        o.steps = h;
    }
    Ok((c.model_config()?, o))
}

/// The training data: `--data`, or the checkpoint's, or the generated corpus.
fn data(a: &TrainArgs, o: &TrainOptions, ck: Option<&Checkpoint>) -> Res<Dataset> {
    let src = if !a.data.is_empty() {
        DataSource::Files(a.data.clone())
    } else {
        match ck.map(|c| &c.config.data) {
            Some(DataDescription::Files { files }) => {
                DataSource::Files(files.iter().map(|f| PathBuf::from(&f.path)).collect())
            }
            Some(DataDescription::Synthetic { seed, bytes, .. }) => DataSource::Synthetic {
                seed: *seed,
                bytes: *bytes,
            },
            None => DataSource::Synthetic {
                seed: o.seed,
                bytes: o.corpus_bytes,
            },
        }
    };
    let d = Dataset::load(&src, o.seq)?;
    if let Some(ck) = ck {
        if !d.description.same_text(&ck.config.data) {
            return Err(format!(
                "the training data is not the checkpoint's: it was trained on {}; now {}",
                ck.config.data.summary(),
                d.description.summary()
            )
            .into());
        }
    }
    Ok(d)
}

pub fn run(a: TrainArgs) -> super::CliResult {
    if a.steps == 0 {
        return Err("--steps must be > 0".into());
    }
    let ck = match &a.resume {
        Some(dir) => Some(checkpoint::load(dir)?),
        None => None,
    };
    let (cfg, o) = match (&ck, &a.resume) {
        (Some(ck), Some(dir)) => resumed(&a, ck, dir)?,
        _ => fresh(&a)?,
    };
    let mut check = cfg.clone();
    check.n_stages = o.stages;
    check.batch = o.batch;
    check.seq = o.seq;
    check.validate()?;
    gwtf::model::train::check_options(&cfg, &o)?;
    let data = data(&a, &o, ck.as_ref())?;
    // The device is opened before anything is printed: the banner says where training
    // runs only once it can.
    match a.device {
        Device::Cpu => {
            let p = Pipeline::new(&cfg, o.stages, o.seed)?;
            drive(&a, &cfg, o, data, ck, p, "the CPU".into())
        }
        Device::Cuda => {
            #[cfg(feature = "cuda")]
            {
                use gwtf::model::gpu::{open_cuda, Backend, DevicePipeline};
                let backend = open_cuda()?;
                let name = format!("CUDA device 0 ({})", backend.describe());
                let p = DevicePipeline::new(backend, &cfg, o.stages, o.seed)?;
                drive(&a, &cfg, o, data, ck, p, name)
            }
            #[cfg(not(feature = "cuda"))]
            {
                Err(gwtf::model::gpu::no_cuda().into())
            }
        }
    }
}

/// Runs the steps on `model`, reports, saves.
fn drive<M: TrainModel>(
    a: &TrainArgs,
    cfg: &ModelConfig,
    o: TrainOptions,
    data: Dataset,
    ck: Option<Checkpoint>,
    model: M,
    device: String,
) -> super::CliResult {
    let summary = data.description.summary();
    let mut t = Trainer::new(model, o.clone(), data)?;
    if let Some(ck) = &ck {
        t.resume(&ck.stages, &ck.config.progress())?;
    }
    let start = t.progress().steps_done;
    if !a.json {
        println!(
            "gwtf train: {} ({} params, {} stages) on {device}, batch {} x seq {} x accum {}, \
             lr {}, seed {}",
            cfg.name,
            cfg.total_params(),
            o.stages,
            o.batch,
            o.seq,
            o.accum,
            o.lr,
            o.seed
        );
        println!("data: {summary}");
        if let Some(dir) = &a.resume {
            println!("resuming {} at step {start}", dir.display());
        }
    }
    let every = a.log_every.max(1);
    let last_step = start + a.steps;
    let mut pending: Option<StepLog> = None;
    let mut err: Option<serde_json::Error> = None;
    let logs = t.run(a.steps, |l| {
        if l.step % every != 0 && l.step != start + 1 && l.step != last_step {
            return;
        }
        if a.json {
            // The last line waits for the held-out loss.
            if l.step == last_step {
                pending = Some(l.clone());
            } else if let Err(e) = serde_json::to_string(l).map(|s| println!("{s}")) {
                err = Some(e);
            }
        } else {
            println!(
                "step {:>5}  loss {:.4}  lr {:.2e}  {:>9.0} tokens/s  {:>7.1}s",
                l.step, l.loss, l.lr, l.tokens_per_s, l.elapsed_s
            );
        }
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    let n_held = (t.data().heldout_windows(o.seq).len()).min(a.heldout_sequences);
    let heldout = t.heldout_loss_of(n_held)?;
    if let Some(dir) = &a.save {
        let (states, progress) = t.checkpoint_state()?;
        let mut c = CheckpointConfig::new(cfg, &o, &t.data().description, &progress)?;
        c.heldout_loss = Some(heldout);
        checkpoint::save(dir, &c, &states)?;
    }
    if a.json {
        if let Some(l) = pending {
            let mut v = serde_json::to_value(&l)?;
            v["heldout_loss"] = serde_json::json!(heldout);
            if let Some(dir) = &a.save {
                v["checkpoint"] = serde_json::json!(dir.display().to_string());
            }
            println!("{v}");
        }
    } else {
        if let (Some(f), Some(l)) = (logs.first(), logs.last()) {
            let tok = (o.batch * o.seq * o.accum * logs.len()) as f64;
            println!(
                "done: loss {:.4} -> {:.4} in {:.1}s ({:.0} tokens/s)",
                f.loss,
                l.loss,
                l.elapsed_s,
                tok / l.elapsed_s.max(1e-9)
            );
        }
        println!(
            "held-out loss {heldout:.4} ({n_held} sequences of {} tokens, at most \
             {MAX_HELDOUT_SEQUENCES}, never trained on)",
            o.seq
        );
        if let Some(dir) = &a.save {
            println!("saved checkpoint {} at step {last_step}", dir.display());
        }
    }
    Ok(())
}
