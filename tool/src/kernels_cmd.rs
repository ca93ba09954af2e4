//! `gwtf bench kernels`: the memory-bound kernels' bandwidth against a copy
//! measured in the same run (memcpy on the CPU, device-to-device on the GPU),
//! and the training rate of the small model on the CPU and, when present, the GPU.

use clap::Args;
use gwtf::model::bench::{cpu_kernels, BenchOptions, KernelBench};
use gwtf::model::gpu::train_gpu;
use gwtf::model::train::{train, StepLog, TrainOptions};

use super::checks;

#[derive(Args)]
pub struct BenchKernelsArgs {
    /// f32 elements per buffer (default 8 Mi = 32 MiB; >= 1).
    #[arg(long, default_value_t = 8 << 20, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(1))]
    elements: usize,
    /// Minimum seconds of work per kernel (> 0).
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true,
          value_parser = checks::positive_float)]
    min_secs: f64,
    /// Training steps for the tokens/s figures, CPU and GPU (0 skips them).
    #[arg(long, default_value_t = 5, allow_negative_numbers = true,
          value_parser = checks::int_at_least::<usize>(0))]
    train_steps: usize,
    /// Model of the training figures: llama-small, llama-tiny or gpt-tiny.
    #[arg(long, default_value = "llama-small")]
    train_model: String,
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
    if !["gpt-tiny", "llama-tiny", "llama-small"].contains(&a.train_model.as_str()) {
        return Err(format!(
            "--train-model {}: one of gpt-tiny, llama-tiny, llama-small",
            a.train_model
        )
        .into());
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
        let cfg = gwtf::model::preset(&a.train_model)?;
        let mut o = TrainOptions::for_config(&cfg);
        o.steps = a.train_steps;
        o.warmup = 1;
        let name = format!("train {}", a.train_model);
        let cpu = steady_tokens_per_s(&train(&cfg, &o, |_| {})?);
        if a.json {
            println!(
                "{}",
                serde_json::json!({"device": "cpu", "name": name, "steps": a.train_steps, "tokens_per_s": cpu})
            );
        } else {
            println!(
                "cpu   {name}: {cpu:.0} tokens/s over {} steps",
                a.train_steps
            );
        }
        // The same training on CUDA device 0 (cuBLAS + our kernels, all on the device).
        match train_gpu(&cfg, &o, |_| {}) {
            Ok(logs) => {
                let gpu = steady_tokens_per_s(&logs);
                if a.json {
                    println!(
                        "{}",
                        serde_json::json!({"device": "cuda", "name": name, "steps": a.train_steps,
                            "tokens_per_s": gpu, "ratio_vs_cpu": gpu / cpu.max(1e-9)})
                    );
                } else {
                    println!(
                        "cuda  {name}: {gpu:.0} tokens/s over {} steps ({:.1}x the CPU)",
                        a.train_steps,
                        gpu / cpu.max(1e-9)
                    );
                }
            }
            Err(e) => {
                if a.json {
                    println!(
                        "{}",
                        serde_json::json!({"device": "cuda", "name": name, "skipped": e.to_string()})
                    );
                } else {
                    println!("cuda  {name} skipped: {e}");
                }
            }
        }
    }
    Ok(())
}

/// Mean tokens/s of the steps after the first (which includes allocation and, on a GPU,
/// the first use of every kernel); the only step's if there is one.
fn steady_tokens_per_s(logs: &[StepLog]) -> f64 {
    let rest = &logs[logs.len().min(1)..];
    if rest.is_empty() {
        logs.last().map(|l| l.tokens_per_s).unwrap_or(0.0)
    } else {
        rest.iter().map(|l| l.tokens_per_s).sum::<f64>() / rest.len() as f64
    }
}
