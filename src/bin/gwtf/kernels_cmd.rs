//! `gwtf bench kernels`: the memory-bound kernels' bandwidth against a copy
//! measured in the same run (memcpy on the CPU, device-to-device on the GPU),
//! and the training rate of the small model.

use clap::Args;
use gwtf::model::bench::{cpu_kernels, BenchOptions, KernelBench};
use gwtf::model::train::{train, TrainOptions};

#[derive(Args)]
pub struct BenchKernelsArgs {
    /// f32 elements per buffer (default 8 Mi = 32 MiB).
    #[arg(long, default_value_t = 8 << 20)]
    elements: usize,
    /// Minimum seconds of work per kernel.
    #[arg(long, default_value_t = 0.5)]
    min_secs: f64,
    /// Training steps of llama-small for the tokens/s figure (0 skips it).
    #[arg(long, default_value_t = 5)]
    train_steps: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

fn print_rows(device: &str, rows: &[KernelBench], json: bool) {
    for r in rows {
        if json {
            let mut v = serde_json::to_value(r).unwrap_or_default();
            v["device"] = device.into();
            println!("{v}");
        } else {
            println!(
                "{device:<5} {:<24} {:>9.2} GB/s   copy {:>7.2} GB/s   ratio {:>5.2}",
                r.name, r.gb_per_s, r.memcpy_gb_per_s, r.ratio
            );
        }
    }
}

#[cfg(feature = "cuda")]
fn gpu_rows(opts: &BenchOptions) -> Result<Vec<KernelBench>, Box<dyn std::error::Error>> {
    let gpu = gwtf::cuda::gpu::Gpu::new(0)?;
    super::kernels_gpu::gpu_kernels(&gpu, opts)
}

#[cfg(not(feature = "cuda"))]
fn gpu_rows(_: &BenchOptions) -> Result<Vec<KernelBench>, Box<dyn std::error::Error>> {
    Err("CUDA support is not built into this gwtf".into())
}

pub fn run(a: BenchKernelsArgs) -> super::CliResult {
    if a.elements == 0 || a.min_secs.is_nan() || a.min_secs <= 0.0 {
        return Err("--elements and --min-secs must be > 0".into());
    }
    let opts = BenchOptions {
        elements: a.elements,
        min_secs: a.min_secs,
        ..Default::default()
    };
    if !a.json {
        println!(
            "CPU kernels vs memcpy, {} MiB buffers, {} thread(s), interleaved:",
            (a.elements * 4) >> 20,
            rayon::current_num_threads()
        );
    }
    print_rows("cpu", &cpu_kernels(&opts), a.json);

    match gpu_rows(&opts) {
        Ok(rows) => print_rows("cuda", &rows, a.json),
        Err(e) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"device": "cuda", "skipped": e.to_string()})
                );
            } else {
                println!("cuda  skipped: {e}");
            }
        }
    }

    if a.train_steps > 0 {
        let cfg = gwtf::model::preset("llama-small")?;
        let mut o = TrainOptions::for_config(&cfg);
        o.steps = a.train_steps;
        o.warmup = 1;
        let logs = train(&cfg, &o, |_| {})?;
        // The first step includes warm-up (allocation); report the rest.
        let rest = &logs[logs.len().min(1)..];
        let tps = if rest.is_empty() {
            logs.last().map(|l| l.tokens_per_s).unwrap_or(0.0)
        } else {
            rest.iter().map(|l| l.tokens_per_s).sum::<f64>() / rest.len() as f64
        };
        if a.json {
            println!(
                "{}",
                serde_json::json!({"device": "cpu", "name": "train llama-small", "steps": a.train_steps, "tokens_per_s": tps})
            );
        } else {
            println!(
                "cpu   train llama-small: {tps:.0} tokens/s over {} steps",
                a.train_steps
            );
        }
    }
    Ok(())
}
