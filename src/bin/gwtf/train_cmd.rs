//! `gwtf train` (owned by the reference-trainer work).
use clap::Args;

#[derive(Args)]
pub struct TrainArgs {}

pub fn run(_args: TrainArgs) -> super::CliResult {
    Err("not implemented yet".into())
}
