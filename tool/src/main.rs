//! `gwtf`: the libgwtf command-line tool. It lives in its own crate so that
//! the library (and every C, C++, Go or Python build of `libgwtf.so`) does not
//! compile its command-line, plotting and progress-bar dependencies.
use clap::{Parser, Subcommand};

mod allreduce_cmd;
mod bench_policies;
mod bench_swarm;
mod checks;
mod demo_chaos;
mod demo_cmd;
mod demo_procs;
mod demo_report;
mod flow_cmd;
mod kernels_cmd;
#[cfg(feature = "cuda")]
mod kernels_gpu;
mod node_cmd;
mod node_save;
mod sample_cmd;
mod sim_cmd;
mod sim_plot;
mod testbed_cmd;
mod train_cmd;
mod transport_cmd;

type CliResult = Result<(), Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(
    name = "gwtf",
    version = gwtf::VERSION,
    about = "libgwtf: churn-tolerant decentralized training"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// A local swarm of `gwtf node` processes trains while nodes crash (SIGKILL)
    /// and join; shows the progress, checks every microbatch was counted once and
    /// every stage's replicas agree, and compares the loss with one process.
    Demo(demo_cmd::DemoArgs),
    /// Print the library version and ABI version.
    Version,
    /// Is CUDA usable here? Reports no driver, no device / init error (with the
    /// CUDA error name), or the devices.
    Probe {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Exit with status 2 unless at least one CUDA device is ready.
        #[arg(long)]
        require_gpu: bool,
    },
    /// Routing solver: solve DIMACS min-cost flow files and GWTF routing scenarios.
    Flow {
        #[command(subcommand)]
        cmd: flow_cmd::FlowCmd,
    },
    /// Train the reference model in one process (stages run one after another).
    Train(train_cmd::TrainArgs),
    /// One swarm node (a data holder or a relay) in its own process: trains
    /// the model with the other nodes over TCP; SIGTERM/Ctrl-C leaves
    /// gracefully, SIGKILL is a crash the others survive.
    Node(Box<node_cmd::NodeArgs>),
    /// Create a node key file (or read an existing one) and print the node
    /// id that follows from it, for the founding members' --peer lists.
    Keygen(node_cmd::KeygenArgs),
    /// Generate text from a checkpoint saved by `gwtf train --save`.
    Sample(sample_cmd::SampleArgs),
    /// A diagnostic peer: accepts authenticated peers and sends every frame
    /// back unchanged; runs until SIGINT/SIGTERM; logs refused connections.
    Echo(transport_cmd::EchoArgs),
    /// Simulate GWTF, SWARM and the optimal routing under churn (deterministic).
    Sim(sim_cmd::SimArgs),
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
    /// Simulator: events per second and wall time of 1,000 / 10,000-node geo10 runs.
    Sim(sim_cmd::BenchSimArgs),
    /// Routing policies in the simulator: each one's time over the lower
    /// bound, and GWTF's over the baselines', per scenario x churn x seed.
    ///
    /// Every policy runs on every scenario x churn rate x seed (the runs of
    /// `gwtf sim`); the markdown tables give each run's training time over
    /// the lower bound computed in the same run (`t/bound`) and GWTF's over
    /// `swarm`'s and `swarm-plus`'s, a row per run, then the range over the
    /// seeds. The evaluation's tables (docs/EVALUATION.md) are its output.
    Policies(bench_policies::BenchPoliciesArgs),
    /// The stage all-reduce of N member processes on loopback TCP against
    /// torch.distributed's gloo all-reduce of the same members and bytes:
    /// seconds and the ratio gloo / ours.
    Allreduce(allreduce_cmd::BenchAllReduceArgs),
    /// Memory-bound kernels against a copy (CPU and, when present, GPU), and training tokens/s.
    Kernels(kernels_cmd::BenchKernelsArgs),
    /// Transport: framed zero-copy path against raw TCP (interleaved), GB/s,
    /// ratio, copies per frame, round-trip latency.
    Transport(transport_cmd::BenchTransportArgs),
    /// A local swarm of `gwtf node` processes against `gwtf train` on the
    /// same cores: throughput ratio, recovery time after SIGKILL, wasted
    /// compute.
    ///
    /// Throughput: tokens/s of the swarm without crashes (holders'
    /// `iteration` events, from the first iteration final to the last)
    /// against `gwtf train --accum HOLDERS*MICROBATCHES` (from its first
    /// step to its last); below 0.8 it says where the time goes (compute of
    /// all nodes from their `stats` against wall time and cores).
    ///
    /// Recovery: a relay (of each relay stage in turn, the one that carried
    /// a microbatch most recently) is SIGKILLed --kills times; a replacement
    /// then joins (`gwtf node --join`), and when it does not become active
    /// within --join-timeout-s the swarm is started afresh. Measured from
    /// the moment just before kill(2) to: the first survivor's `peer_lost`
    /// (detected); the first `recovered` event (a hop of a microbatch in
    /// flight through the victim sent elsewhere, or the microbatch
    /// restarted); the holder's `mb_done` of the last such microbatch (its
    /// backward is back, so the hop was redone elsewhere: an upper bound on
    /// the hop itself); the next iteration final. Median and max of each.
    ///
    /// Wasted compute: 1 - useful/compute summed over every node's last
    /// `stats` (a killed node's last report before the kill), without
    /// crashes and with a relay killed (and replaced) every --crash-every-s.
    Swarm(bench_swarm::BenchSwarmArgs),
    /// Real processes against the simulator: for each policy, the
    /// simulator's founding members (region, GPU speed, capacity) as `gwtf
    /// node --emulate` processes on loopback, each waiting the time its GPU
    /// would take while every tensor, gradient and state travels at its
    /// real size over links of the scenario's latency and bandwidth between
    /// their regions; seconds per iteration real against simulated, each
    /// baseline's ratio to GWTF in both, peak memory per node.
    Testbed(testbed_cmd::BenchTestbedArgs),
}

fn probe(json: bool, require_gpu: bool) -> CliResult {
    use gwtf::cuda::{ProbeDetail, ProbeState};
    let report = gwtf::cuda::probe(ProbeDetail::Devices);
    if json {
        let devices: Vec<_> = report
            .devices
            .iter()
            .map(|d| {
                serde_json::json!({
                    "ordinal": d.ordinal,
                    "name": d.name,
                    "total_memory_bytes": d.total_memory_bytes,
                    "compute_capability": format!("{}.{}", d.compute_capability.0, d.compute_capability.1),
                })
            })
            .collect();
        let obj = serde_json::json!({
            "state": report.state.as_str(),
            "device_count": report.device_count,
            "driver_version": report.driver_version,
            "error_name": report.error_name,
            "devices": devices,
            "summary": report.to_string(),
        });
        println!("{obj}");
    } else {
        println!("{report}");
    }
    if require_gpu && report.state != ProbeState::Ready {
        std::process::exit(2);
    }
    Ok(())
}

fn main() {
    // Die quietly on a closed pipe (`gwtf ... | head`) like other command-line
    // tools, instead of panicking in println!.
    // SAFETY: restoring the default disposition of one signal at start-up.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result: CliResult = match cli.cmd {
        Cmd::Version => {
            println!(
                "gwtf {} (ABI {})",
                gwtf::VERSION,
                gwtf::ffi::version::GWTF_ABI_VERSION
            );
            Ok(())
        }
        Cmd::Demo(args) => demo_cmd::run(args),
        Cmd::Probe { json, require_gpu } => probe(json, require_gpu),
        Cmd::Flow { cmd } => flow_cmd::run(cmd),
        Cmd::Train(args) => train_cmd::run(args),
        Cmd::Sample(args) => sample_cmd::run(args),
        Cmd::Node(args) => node_cmd::node(*args),
        Cmd::Keygen(args) => node_cmd::keygen(args),
        Cmd::Echo(args) => transport_cmd::echo(args),
        Cmd::Sim(args) => sim_cmd::run(args),
        Cmd::Bench { what } => match what {
            BenchCmd::Flow(args) => flow_cmd::bench(args),
            BenchCmd::Sim(args) => sim_cmd::bench(args),
            BenchCmd::Policies(args) => bench_policies::run(args),
            BenchCmd::Kernels(args) => kernels_cmd::run(args),
            BenchCmd::Allreduce(args) => allreduce_cmd::run(args),
            BenchCmd::Transport(args) => transport_cmd::bench(args),
            BenchCmd::Swarm(args) => bench_swarm::run(args),
            BenchCmd::Testbed(args) => testbed_cmd::run(args),
        },
    };
    if let Err(e) = result {
        eprintln!("gwtf: error: {e}");
        std::process::exit(1);
    }
}
