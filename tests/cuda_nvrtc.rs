//! Every kernel compiles to PTX with NVRTC, on any machine (no GPU needed).
//!
//! The test command installs NVRTC (scripts/nvrtc-deps) and sets
//! `GWTF_NVRTC_LIBRARY` and `GWTF_REQUIRE_NVRTC=1`, so in CI this cannot be
//! skipped; elsewhere, without NVRTC, it is recorded as skipped.

#[path = "common/skip.rs"]
mod skip;

use gwtf::cuda::kernels::SOURCES;
use gwtf::cuda::nvrtc::{compile_ptx, ensure_loaded};

fn nvrtc_or_skip() -> bool {
    match ensure_loaded() {
        Ok(()) => true,
        Err(e) => {
            if std::env::var_os("GWTF_REQUIRE_NVRTC").is_some() {
                panic!("GWTF_REQUIRE_NVRTC is set but {e}");
            }
            skip::skipped(&format!("no NVRTC: {e}"));
            false
        }
    }
}

#[test]
fn every_kernel_compiles_to_ptx_for_ampere_and_hopper() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        for unit in SOURCES {
            let ptx = compile_ptx(unit.file, &unit.full_source(), arch)
                .unwrap_or_else(|e| panic!("{}: {e}", unit.file));
            assert!(ptx.contains(".version"), "{}: not PTX", unit.file);
            for entry in unit.entries {
                assert!(
                    ptx.contains(&format!(".entry {entry}(")),
                    "{} ({arch}): no entry point {entry}",
                    unit.file
                );
            }
            // --fmad=false: the units that must match the CPU bit for bit
            // contain no fused multiply-add (libdevice's expf/tanhf use FMA
            // internally, so the other units are compared with tolerances).
            let exact = [
                "quantize.cu",
                "average.cu",
                "adamw.cu",
                "rope.cu",
                "encoder.cu",
                "residual.cu",
            ];
            assert!(
                !exact.contains(&unit.file) || !ptx.contains("fma.rn.f32"),
                "{} ({arch}): contracted FMA found",
                unit.file
            );
        }
    }
}

#[test]
fn every_cu_file_is_a_registered_unit() {
    // A kernel file left out of SOURCES would be neither compiled by the test
    // above nor loaded by the launcher.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda/kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".cu"))
        .collect();
    files.sort();
    let mut units: Vec<String> = SOURCES.iter().map(|u| u.file.to_string()).collect();
    units.sort();
    assert_eq!(files, units);
    for unit in SOURCES {
        assert!(!unit.entries.is_empty(), "{}: no entry points", unit.file);
        for entry in unit.entries {
            assert!(
                unit.source
                    .contains(&format!("extern \"C\" __global__ void {entry}(")),
                "{}: {entry} is not defined there",
                unit.file
            );
        }
    }
}

#[test]
fn a_broken_kernel_reports_the_compiler_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let err = compile_ptx(
        "broken.cu",
        "extern \"C\" __global__ void k() { undefined_thing(); }",
        "compute_80",
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("broken.cu"), "{text}");
    assert!(text.contains("undefined_thing"), "{text}");
}
