//! `gwtf sample`: generates text from a checkpoint written by `gwtf train
//! --save` or by a swarm's data holder (`gwtf node --save`).
use clap::Args;
use gwtf::model::checkpoint;
use gwtf::model::data::tokenize;
use gwtf::model::sample::{generate, pipeline_from_checkpoint, render_bytes, SampleOptions};
use std::path::PathBuf;

#[derive(Args)]
pub struct SampleArgs {
    /// Checkpoint directory (written by `gwtf train --save`), or a
    /// directory of a swarm's checkpoints (`gwtf node --save`: its newest).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Text to continue (the model sees its last max_seq bytes).
    #[arg(long)]
    prompt: String,
    /// Bytes to generate.
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Softmax temperature; 0 is greedy (always the most likely byte).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Seed of the draws: the same seed gives the same text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the model's probabilities of the next byte after the prompt
    /// (JSON: `{"probs": [256 numbers]}`) instead of generating.
    #[arg(long)]
    probs: bool,
}

/// Prints the prompt and its continuation; bytes that are not printable text are shown
/// as escapes (`\xNN`), so that what the model produced is visible as is.
pub fn run(a: SampleArgs) -> super::CliResult {
    if a.prompt.is_empty() {
        return Err("--prompt must not be empty".into());
    }
    if !a.temperature.is_finite() || a.temperature < 0.0 {
        return Err(format!("--temperature {} must be >= 0", a.temperature).into());
    }
    let ck = checkpoint::load(&a.checkpoint)?;
    let mut p = pipeline_from_checkpoint(&ck)?;
    if a.probs {
        let t = tokenize(&a.prompt);
        let max_seq = ck.config.model.max_seq;
        let probs = p.next_token_probs(&t[t.len().saturating_sub(max_seq)..])?;
        let probs = gwtf::model::sample::byte_probs(&probs);
        println!("{}", serde_json::json!({ "probs": probs }));
        return Ok(());
    }
    let out = generate(
        &mut p,
        &tokenize(&a.prompt),
        &SampleOptions {
            tokens: a.tokens,
            temperature: a.temperature,
            seed: a.seed,
        },
    )?;
    let bytes: Vec<u8> = out.iter().map(|&t| t.min(255) as u8).collect();
    println!(
        "{}{}",
        render_bytes(a.prompt.as_bytes()),
        render_bytes(&bytes)
    );
    Ok(())
}
