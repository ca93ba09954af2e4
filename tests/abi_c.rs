//! The C ABI seen from C: the header compiles alone as C99 and C++17 and from two
//! translation units; symbols, SONAME and versions agree; misuse and panics
//! come back as statuses (under AddressSanitizer).

mod common;

use common::*;
use std::process::Command;

fn header_text() -> String {
    std::fs::read_to_string(repo_root().join("include/gwtf.h")).unwrap()
}

/// Names of the functions the header declares.
fn declared_functions() -> Vec<String> {
    let text = header_text();
    let mut names = Vec::new();
    let mut in_comment = false;
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with("/*") {
            in_comment = true;
        }
        if in_comment {
            if t.ends_with("*/") {
                in_comment = false;
            }
            continue;
        }
        if t.starts_with('#') || t.starts_with("typedef") {
            continue;
        }
        if let Some(open) = t.find('(') {
            let before = &t[..open];
            let name = before.rsplit([' ', '*']).next().unwrap_or("");
            if name.starts_with("gwtf_") {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// Defined dynamic symbols of the built library.
fn exported_symbols() -> Vec<String> {
    let so = lib_dir().join("libgwtf.so");
    let out = run_ok(Command::new("nm").args(["-D", "--defined-only"]).arg(&so));
    stdout_of(&out)
        .lines()
        .filter_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            (parts.len() == 3).then(|| parts[2].to_string())
        })
        .collect()
}

#[test]
fn header_compiles_alone_as_c99_and_cpp17_and_versions_match() {
    let dir = scratch("header-alone");
    let cargo_version = env!("CARGO_PKG_VERSION");
    let (maj, min, pat): (u32, u32, u32) = {
        let v: Vec<u32> = cargo_version
            .split('.')
            .map(|p| p.parse().unwrap())
            .collect();
        (v[0], v[1], v[2])
    };
    for (compiler, std, src) in [
        ("cc", "c99", "header_alone.c"),
        ("c++", "c++17", "header_alone.cpp"),
    ] {
        let exe = dir.join(format!("alone-{std}"));
        build_program(
            compiler,
            std,
            &[repo_root().join("tests/c").join(src)],
            &exe,
            false,
        );
        let out = stdout_of(&run_ok(&mut Command::new(&exe)));
        let expected = format!(
            "{maj}.{min}.{pat} {} {}\nruntime {cargo_version} {}\n",
            maj * 10000 + min * 100 + pat,
            gwtf::ffi::version::GWTF_ABI_VERSION,
            gwtf::ffi::version::GWTF_ABI_VERSION
        );
        assert_eq!(out, expected, "{compiler} -std={std}");
    }
}

#[test]
fn header_from_two_translation_units() {
    let dir = scratch("two-tu");
    let exe = dir.join("two-tu");
    build_program(
        "cc",
        "c99",
        &[
            repo_root().join("tests/c/two_tu_a.c"),
            repo_root().join("tests/c/two_tu_b.c"),
        ],
        &exe,
        false,
    );
    let out = stdout_of(&run_ok(&mut Command::new(&exe)));
    assert_eq!(out, "two translation units: ok 1\n");
}

#[test]
fn every_export_is_prefixed_and_every_declaration_exported() {
    let exported = exported_symbols();
    assert!(!exported.is_empty());
    for s in &exported {
        assert!(
            s.starts_with("gwtf_"),
            "exported symbol without gwtf_ prefix: {s}"
        );
    }
    let declared = declared_functions();
    assert!(declared.len() >= 12, "header parse found only {declared:?}");
    for f in &declared {
        assert!(
            exported.contains(f),
            "{f} is declared in gwtf.h but not exported"
        );
    }
}

#[test]
fn every_function_documents_ownership_thread_safety_errors() {
    let text = header_text();
    for f in declared_functions() {
        let at = text
            .find(&format!(" {f}("))
            .or_else(|| text.find(&format!("*{f}(")))
            .unwrap();
        let doc_start = text[..at].rfind("/**").unwrap();
        let doc = &text[doc_start..at];
        for section in ["Ownership:", "Thread safety:", "Errors:"] {
            assert!(doc.contains(section), "{f}: doc lacks {section}\n{doc}");
        }
    }
}

#[test]
fn soname_carries_the_abi_version() {
    let so = lib_dir().join("libgwtf.so");
    let out = stdout_of(&run_ok(Command::new("readelf").arg("-d").arg(&so)));
    let want = format!(
        "Library soname: [libgwtf.so.{}]",
        gwtf::ffi::version::GWTF_ABI_VERSION
    );
    assert!(out.contains(&want), "readelf -d shows no {want}:\n{out}");
}

#[test]
fn misuse_from_c_returns_statuses_under_asan() {
    let dir = scratch("misuse");
    let exe = dir.join("misuse");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/misuse.c")],
        &exe,
        true,
    );
    let out = run_ok(asan_env(&mut Command::new(&exe)));
    let text = stdout_of(&out);
    assert!(text.contains("misuse: all checks passed"), "{text}");
    assert!(
        text.contains("is not a valid gwtf_cuda_probe_detail"),
        "{text}"
    );
}

#[test]
fn panic_becomes_status_and_poisons_handle() {
    let dir = scratch("panic");
    let exe = dir.join("panic");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/panic.c")],
        &exe,
        true,
    );
    let out = run_ok(asan_env(&mut Command::new(&exe)));
    let text = stdout_of(&out);
    assert!(
        text.contains("no handle: panic caught at the C boundary"),
        "{text}"
    );
    assert!(text.contains("deliberate test panic"), "{text}");
    assert!(
        text.contains("after: handle poisoned by an earlier panic"),
        "{text}"
    );
    assert!(text.ends_with("panic: ok\n"), "{text}");
}

#[test]
fn probe_with_stub_driver_reports_no_device_from_c() {
    let stub = stub_libcuda_dir();
    let dir = scratch("probe-c");
    let exe = dir.join("probe");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/probe.c")],
        &exe,
        true,
    );
    // No driver at all (an empty library path, and none installed here).
    let out = stdout_of(&run_ok(asan_env(&mut Command::new(&exe))));
    if !std::path::Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() {
        assert!(out.contains("state=1 "), "expected no driver: {out}");
        assert!(out.contains("no CUDA driver library"), "{out}");
    }
    // The stand-in driver: present, cuInit says CUDA_ERROR_NO_DEVICE.
    let out = stdout_of(&run_ok(
        asan_env(&mut Command::new(&exe)).env("LD_LIBRARY_PATH", &stub),
    ));
    assert!(out.contains("state=2 count=0"), "expected no device: {out}");
    assert!(out.contains("CUDA_ERROR_NO_DEVICE"), "{out}");
}

#[test]
fn kernel_api_from_c_under_asan() {
    let dir = scratch("kernels-c");
    let exe = dir.join("kernels");
    let mut src = vec![repo_root().join("tests/c/kernels.c")];
    src.push("-lm".into());
    build_program("cc", "c99", &src, &exe, true);
    let out = stdout_of(&run_ok(asan_env(&mut Command::new(&exe))));
    assert!(out.contains("host kernels: ok (avg[0] = 4)"), "{out}");
    assert!(out.contains("kernels: all checks passed"), "{out}");
    if !out.contains("gpu: opened") {
        assert!(
            out.contains("gpu: cuda unavailable: no usable CUDA device"),
            "{out}"
        );
    }
}

#[test]
fn header_declares_only_prefixed_names() {
    // Every macro, type and enum constant of the header is in our namespace.
    let text = header_text();
    let mut bad = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('*') || t.starts_with('/') {
            continue; // documentation
        }
        let name = if let Some(rest) = t.strip_prefix("#define ") {
            rest.split_whitespace().next()
        } else if t.starts_with("typedef ") {
            t.trim_end_matches(';').rsplit([' ', '*']).next()
        } else if let Some(rest) = t
            .strip_prefix("enum ")
            .or_else(|| t.strip_prefix("struct "))
        {
            rest.split_whitespace().next()
        } else if t.starts_with("GWTF_") || t.starts_with("gwtf_") {
            None
        } else if t.contains(" = ") && t.ends_with(',') {
            t.split_whitespace().next()
        } else {
            None
        };
        if let Some(n) = name {
            let n = n.trim_end_matches([';', '{']);
            if !(n.starts_with("GWTF_") || n.starts_with("gwtf_") || n.is_empty() || n == "}") {
                bad.push(line.to_string());
            }
        }
    }
    assert!(bad.is_empty(), "names outside the gwtf namespace: {bad:#?}");
}

#[test]
fn stages_from_c_train_like_the_rust_pipeline() {
    use gwtf::model::{preset, AdamW, Stage, StageInput, StageOutput, StagePlan};
    let dir = scratch("stage-c");
    let exe = dir.join("stage");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/stage.c")],
        &exe,
        true,
    );
    let out = stdout_of(&run_ok(asan_env(&mut Command::new(&exe))));
    assert!(out.contains("stage: all checks passed"), "{out}");
    let c_losses: Vec<f32> = out
        .lines()
        .filter_map(|l| l.strip_prefix("step "))
        .map(|l| l.split(" loss ").nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(c_losses.len(), 5, "{out}");

    // The same five steps in Rust: the C API must give the very same losses.
    let cfg = preset("llama-tiny").unwrap();
    let plan = StagePlan::new(&cfg, 4).unwrap();
    let mut stages = Stage::all(&cfg, &plan, 42).unwrap();
    let (b, t) = (2, 16);
    let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % 256) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 10) % 256) as u32).collect();
    for (step, &c_loss) in c_losses.iter().enumerate() {
        let mb = step as u64;
        let mut act = match stages[0]
            .forward(mb, b, t, StageInput::Tokens(&tokens), None)
            .unwrap()
        {
            StageOutput::Hidden(h) => h,
            StageOutput::Loss(_) => unreachable!(),
        };
        for s in stages.iter_mut().take(3).skip(1) {
            act = match s.forward(mb, b, t, StageInput::Hidden(&act), None).unwrap() {
                StageOutput::Hidden(h) => h,
                StageOutput::Loss(_) => unreachable!(),
            };
        }
        let loss = match stages[3]
            .forward(mb, b, t, StageInput::Hidden(&act), Some(&targets))
            .unwrap()
        {
            StageOutput::Loss(l) => l,
            StageOutput::Hidden(_) => unreachable!(),
        };
        assert_eq!(
            loss.to_bits(),
            c_loss.to_bits(),
            "step {step}: rust {loss} c {c_loss}"
        );
        let mut g = stages[3].backward(mb, None).unwrap();
        for s in (0..3).rev() {
            g = stages[s].backward(mb, g.as_deref()).unwrap();
        }
        for s in &mut stages {
            s.step(&AdamW::default()).unwrap();
        }
    }
    assert!(c_losses[4] < c_losses[0]);
}

#[test]
fn routing_solver_from_c_under_asan() {
    let dir = scratch("flow-c");
    let exe = dir.join("flow");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/flow.c")],
        &exe,
        true,
    );
    let out = stdout_of(&run_ok(asan_env(&mut Command::new(&exe))));
    assert!(out.contains("graph: cost 7 flow 2"), "{out}");
    assert!(out.contains("after crash: flow 1, unrouted 1"), "{out}");
    assert!(
        out.contains("line 3"),
        "the DIMACS error names its line: {out}"
    );
    assert!(out.contains("flow: all checks passed"), "{out}");
}

#[test]
fn run_audit_from_c_passes_a_clean_run_and_fails_diverged_replicas_under_asan() {
    let dir = scratch("audit-c");
    let exe = dir.join("audit");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/audit.c")],
        &exe,
        true,
    );
    let out = stdout_of(&run_ok(asan_env(&mut Command::new(&exe))));
    assert!(out.contains("clean run: ok 1"), "{out}");
    assert!(out.contains("diverged replicas: ok 0"), "{out}");
    assert!(out.contains("a swarm has 3..="), "{out}");
    assert!(out.contains("reference[0] is NaN"), "{out}");
    assert!(out.ends_with("audit: all checks passed\n"), "{out}");
}

#[test]
fn peer_from_c_refuses_every_wrong_answer_under_asan() {
    let dir = scratch("peer");
    let exe = dir.join("peer");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/peer.c")],
        &exe,
        true,
    );
    let out = run_ok(asan_env(&mut Command::new(&exe)));
    let text = stdout_of(&out);
    assert!(text.ends_with("peer: all checks passed\n"), "{text}");
    for want in [
        "expected 32 at stage 1",
        "is not outstanding (never given, or answered already)",
        "forward cannot be answered with a loss",
        "gradient element 3 is not finite",
        "the peer has stopped",
        "holder: iteration 1 final",
    ] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
}

#[test]
fn an_emptied_stage_is_rebuilt_by_a_c_trainer_under_asan() {
    let dir = scratch("rebuild");
    let exe = dir.join("rebuild");
    build_program(
        "cc",
        "c99",
        &[repo_root().join("tests/c/rebuild.c")],
        &exe,
        true,
    );
    let out = run_ok(asan_env(&mut Command::new(&exe)));
    let text = stdout_of(&out);
    assert!(text.ends_with("rebuild: all checks passed\n"), "{text}");
    for want in [
        "relays rebuild emptied stages, a data holder never takes one up",
        "rebuild_from_neighbours is 2: 0 or 1",
        "average_states cannot be answered with a weights digest",
        "2 states averaged, but it gave 1",
        "is not outstanding (never given, or answered already)",
        "joiner: stage 2 had no live node and no kept copy: rebuilt from the average of 1",
    ] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
}
