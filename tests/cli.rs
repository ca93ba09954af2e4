//! The `gwtf` command-line tool: version and the CUDA probe.

mod common;

use common::*;
use std::process::Command;

fn gwtf() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gwtf"))
}

#[test]
fn version_matches_cargo() {
    let out = stdout_of(&run_ok(gwtf().arg("version")));
    assert_eq!(out, format!("gwtf {} (ABI 1)\n", env!("CARGO_PKG_VERSION")));
}

#[test]
fn probe_without_driver_and_with_stub_driver() {
    if !std::path::Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() {
        let out = stdout_of(&run_ok(gwtf().arg("probe")));
        assert_eq!(out, "no CUDA driver library (libcuda.so) found\n");
        let out = gwtf().args(["probe", "--require-gpu"]).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
    }
    let stub = stub_libcuda_dir();
    let out = stdout_of(&run_ok(gwtf().arg("probe").env("LD_LIBRARY_PATH", &stub)));
    assert_eq!(
        out,
        "CUDA driver present but no device (CUDA_ERROR_NO_DEVICE)\n"
    );
    let out = stdout_of(&run_ok(
        gwtf()
            .args(["probe", "--json"])
            .env("LD_LIBRARY_PATH", &stub),
    ));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["state"], "no-device");
    assert_eq!(v["error_name"], "CUDA_ERROR_NO_DEVICE");
    assert_eq!(v["device_count"], 0);
}

#[test]
fn probe_with_a_broken_driver_reports_init_error() {
    // A "driver" without cuInit: the probe must report it, not crash.
    let dir = scratch("broken-libcuda");
    let src = dir.join("broken.c");
    std::fs::write(&src, "int cuSomethingElse(void) { return 0; }\n").unwrap();
    run_ok(
        Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join("libcuda.so.1"))
            .arg(&src),
    );
    let out = run_ok(
        gwtf()
            .args(["probe", "--json"])
            .env("LD_LIBRARY_PATH", &dir),
    );
    let v: serde_json::Value = serde_json::from_str(stdout_of(&out).trim()).unwrap();
    assert_eq!(v["state"], "init-error", "{v}");
}
