//! `gwtf node --device cuda`: a swarm of `gwtf node` processes that all
//! train on one GPU (2 data holders, 2 relay stages of 3), a relay
//! SIGKILLed after the second iteration. Every microbatch is counted once
//! per stage, the replicas of each stage print the same weights digest
//! after every update, and every iteration's loss equals the CPU
//! reference's at float32 noise (cuBLAS and our kernels sum in another
//! order than the CPU: 1e-3 relative, the tolerance of tests/cuda_gpu.rs's
//! training check).
//!
//! Without a GPU the test is recorded as skipped (common/skip.rs); with
//! `GWTF_REQUIRE_GPU=1` a missing device fails it instead. The device
//! trainer's bookkeeping is checked on every machine on the host backend
//! (tests/swarm_model.rs), and a node asked for CUDA without a device is
//! refused with the probe's reason (tests/cli.rs).
mod common;

use common::swarm_procs::{
    check_run, llama_tiny_args, llama_tiny_reference, two_holders_and_two_by_three_relays, Swarm,
};
use gwtf::cuda::{probe, ProbeDetail, ProbeState};

const ITERATIONS: u32 = 8;
const MB: u32 = 3;
const SEED: u64 = 5;

/// The probe's reason when there is no usable GPU.
fn no_gpu() -> Option<String> {
    let p = probe(ProbeDetail::CountOnly);
    (p.state != ProbeState::Ready).then(|| p.to_string())
}

#[test]
fn a_swarm_on_one_gpu_trains_the_cpu_reference_through_a_crash() {
    if let Some(why) = no_gpu() {
        if std::env::var_os("GWTF_REQUIRE_GPU").is_some() {
            panic!("GWTF_REQUIRE_GPU is set but: {why}");
        }
        common::skip::skipped(&format!("no GPU: {why}"));
        return;
    }
    let args = llama_tiny_args(
        ITERATIONS,
        MB,
        SEED,
        &["--device", "cuda", "--threads", "1"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut swarm = Swarm::start(&two_holders_and_two_by_three_relays(), &args, &[]);
    let ev = swarm.until("iteration 2", |ev| {
        ev.iter()
            .any(|e| e.event() == "iteration" && e.u("iteration") >= 2)
    });
    // Every node says where its model runs: not on the CPU.
    for e in ev.iter().filter(|e| e.event() == "listening") {
        assert_ne!(e.s("device"), "cpu", "node {}", e.node);
    }
    swarm.kill(12);
    let ev = swarm.until_done(&[1, 2]);
    let losses = check_run(&ev, ITERATIONS, MB, 2);
    let want = llama_tiny_reference(ITERATIONS, MB, SEED);
    for (k, (got, w)) in losses.iter().zip(&want).enumerate() {
        let w = *w as f64;
        assert!(
            (got - w).abs() <= 1e-3 * w.abs(),
            "iteration {k}: swarm on the GPU {got}, CPU reference {w}"
        );
    }
    assert!(losses[ITERATIONS as usize - 1] < losses[0], "{losses:?}");
}
