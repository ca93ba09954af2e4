//! `gwtf train`: trains the reference model in one process (stages run one after another),
//! on the CPU or on a CUDA device.
use clap::{Args, ValueEnum};
use gwtf::model::gpu::train_gpu;
use gwtf::model::preset;
use gwtf::model::train::{train, TrainOptions};

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
    /// Model preset: gpt-tiny, llama-tiny or llama-small.
    #[arg(long, default_value = "llama-tiny")]
    model: String,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Device.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Seed of initialisation, corpus and sampling.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object per logged step instead of text.
    #[arg(long)]
    json: bool,
    /// Pipeline stages (default: the preset's).
    #[arg(long)]
    stages: Option<usize>,
    /// Peak learning rate (linear warmup, cosine decay to 10%).
    #[arg(long)]
    lr: Option<f32>,
    /// Sequences per microbatch (default: the preset's).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence (default: the preset's).
    #[arg(long)]
    seq: Option<usize>,
    /// Microbatches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// Log every N steps (the first and last steps are always logged).
    #[arg(long, default_value_t = 1)]
    log_every: usize,
}

pub fn run(a: TrainArgs) -> super::CliResult {
    let cfg = preset(&a.model)?;
    if !["gpt-tiny", "llama-tiny", "llama-small"].contains(&a.model.as_str()) {
        return Err(format!(
            "--model {}: only gpt-tiny, llama-tiny and llama-small are trained here \
             (the larger presets are shapes for the simulator)",
            a.model
        )
        .into());
    }
    if a.steps == 0 {
        return Err("--steps must be > 0".into());
    }
    let mut o = TrainOptions::for_config(&cfg);
    o.steps = a.steps;
    o.seed = a.seed;
    o.accum = a.accum;
    o.warmup = (a.steps / 10).clamp(1, 20);
    o.lr = a.lr.unwrap_or(if cfg.d_model <= 64 { 1e-2 } else { 1e-3 });
    if let Some(s) = a.stages {
        o.stages = s;
    }
    if let Some(b) = a.batch {
        o.batch = b;
    }
    if let Some(t) = a.seq {
        o.seq = t;
    }
    if cfg.d_model > 64 {
        o.corpus_bytes = 512 * 1024;
    }
    let mut check = cfg.clone();
    check.n_stages = o.stages;
    check.batch = o.batch;
    check.seq = o.seq;
    check.validate()?;
    let every = a.log_every.max(1);
    if !a.json {
        println!(
            "gwtf train: {} ({} params, {} stages) on {}, batch {} x seq {} x accum {}, lr {}, \
             seed {}",
            cfg.name,
            cfg.total_params(),
            o.stages,
            match a.device {
                Device::Cpu => "the CPU",
                Device::Cuda => "CUDA device 0",
            },
            o.batch,
            o.seq,
            o.accum,
            o.lr,
            o.seed
        );
    }
    let steps = o.steps;
    let mut err: Option<serde_json::Error> = None;
    let on_step = |l: &gwtf::model::StepLog| {
        if l.step % every != 0 && l.step != 1 && l.step != steps {
            return;
        }
        if a.json {
            match serde_json::to_string(l) {
                Ok(s) => println!("{s}"),
                Err(e) => err = Some(e),
            }
        } else {
            println!(
                "step {:>5}  loss {:.4}  lr {:.2e}  {:>9.0} tokens/s  {:>7.1}s",
                l.step, l.loss, l.lr, l.tokens_per_s, l.elapsed_s
            );
        }
    };
    let logs = match a.device {
        Device::Cpu => train(&cfg, &o, on_step)?,
        Device::Cuda => train_gpu(&cfg, &o, on_step)?,
    };
    if let Some(e) = err {
        return Err(e.into());
    }
    if !a.json {
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
    }
    Ok(())
}
