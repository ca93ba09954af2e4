//! `gwtf flow ...` and `gwtf bench flow` (owned by the routing-solver work).
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum FlowCmd {
    /// Solve a DIMACS min-cost flow file.
    Solve { file: std::path::PathBuf },
}

#[derive(Args)]
pub struct BenchFlowArgs {}

pub fn run(_cmd: FlowCmd) -> super::CliResult {
    Err("not implemented yet".into())
}

pub fn bench(_args: BenchFlowArgs) -> super::CliResult {
    Err("not implemented yet".into())
}
