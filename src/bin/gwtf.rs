//! `gwtf`: the libgwtf command-line tool.
use clap::{Parser, Subcommand};

#[path = "gwtf/flow_cmd.rs"]
mod flow_cmd;
#[path = "gwtf/train_cmd.rs"]
mod train_cmd;

type CliResult = Result<(), Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(name = "gwtf", version, about = "libgwtf: churn-tolerant decentralized training")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the library version and ABI version.
    Version,
    /// Routing solver: solve DIMACS min-cost flow files and GWTF routing scenarios.
    Flow {
        #[command(subcommand)]
        cmd: flow_cmd::FlowCmd,
    },
    /// Train the reference model in one process (stages run one after another).
    Train(train_cmd::TrainArgs),
    /// Benchmarks that print ratios against a reference measured in the same run.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Min-cost flow: ours (cold and incremental repair) against OR-tools.
    Flow(flow_cmd::BenchFlowArgs),
}

fn main() {
    let cli = Cli::parse();
    let result: CliResult = match cli.cmd {
        Cmd::Version => {
            println!("gwtf {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Cmd::Flow { cmd } => flow_cmd::run(cmd),
        Cmd::Train(args) => train_cmd::run(args),
        Cmd::Bench { what } => match what {
            BenchCmd::Flow(args) => flow_cmd::bench(args),
        },
    };
    if let Err(e) = result {
        eprintln!("gwtf: error: {e}");
        std::process::exit(1);
    }
}
