//! The consumers in c-examples/ (C, C++17 and Go) are built against the
//! library and run, and their output is checked; so is an installed copy used
//! through pkg-config.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `make -C c-examples TARGET` with a private build directory; returns stdout.
fn make(target: &str, build: &Path) -> String {
    make_with_env(target, build, &[])
}

fn make_with_env(target: &str, build: &Path, env: &[(&str, &std::ffi::OsStr)]) -> String {
    let out = run_ok(
        Command::new("make")
            .arg("-C")
            .arg(repo_root().join("c-examples"))
            .arg(format!("LIBDIR={}", lib_dir().display()))
            .arg(format!("BUILD={}", build.display()))
            .arg(target)
            .envs(go_env())
            .envs(env.iter().copied()),
    );
    stdout_of(&out)
}

/// Go's environment: no network, and caches under target/ when the machine
/// has none (CI may run without HOME).
fn go_env() -> Vec<(&'static str, PathBuf)> {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let mut env = vec![
        ("GOPROXY", PathBuf::from("off")),
        ("GOFLAGS", PathBuf::from("-mod=mod")),
    ];
    if std::env::var_os("HOME").is_none() || std::env::var_os("GOCACHE").is_some() {
        env.push(("GOPATH", tmp.join("go-path")));
    }
    let cache = std::env::var_os("GOCACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| tmp.join("go-cache"));
    env.push(("GOCACHE", cache));
    env
}

fn go_available() -> bool {
    if Command::new("go").arg("version").output().is_ok() {
        return true;
    }
    if std::env::var_os("GWTF_SKIP_GO").is_some() {
        common::skip::skipped("Go is not installed and GWTF_SKIP_GO is set");
        return false;
    }
    panic!("Go is not installed: run scripts/install-deps (or set GWTF_SKIP_GO=1 to skip visibly)");
}

#[test]
fn c_and_cpp_examples_build_and_run() {
    let build = scratch("examples-c");
    make("all", &build);
    let version = env!("CARGO_PKG_VERSION");
    for (exe, ok_line) in [("hello_c", "hello_c: ok"), ("hello_cpp", "hello_cpp: ok")] {
        let out = stdout_of(&run_ok(asan_env(&mut Command::new(build.join(exe)))));
        assert!(
            out.starts_with(&format!("libgwtf {version} (ABI 1")),
            "{exe}: {out}"
        );
        assert!(
            out.contains("is not a valid gwtf_cuda_probe_detail"),
            "{exe}: {out}"
        );
        assert!(out.contains("cuda: "), "{exe}: {out}");
        assert!(out.trim_end().ends_with(ok_line), "{exe}: {out}");
        // With the stand-in driver, the name of the CUDA error comes through.
        let out = stdout_of(&run_ok(
            asan_env(&mut Command::new(build.join(exe))).env("LD_LIBRARY_PATH", stub_libcuda_dir()),
        ));
        assert!(
            out.contains("cuda: CUDA driver present but no device (CUDA_ERROR_NO_DEVICE)"),
            "{exe}: {out}"
        );
        assert!(out.contains("cuda state 2, 0 device(s)"), "{exe}: {out}");
    }
}

#[test]
fn cpp_pipeline_trains_through_four_stages_with_int8_activations() {
    let build = scratch("examples-pipeline");
    make("all", &build);
    let out = stdout_of(&run_ok(asan_env(&mut Command::new(
        build.join("pipeline_cpp"),
    ))));
    assert!(out.contains("pipeline_cpp: ok (loss "), "{out}");
    assert!(out.contains("with int8 activations"), "{out}");
}

#[test]
fn cpp_tensor_pingpong_runs_under_asan() {
    let build = scratch("examples-pingpong");
    make("all", &build);
    let out = stdout_of(&run_ok(asan_env(&mut Command::new(
        build.join("tensor_pingpong"),
    ))));
    assert!(
        out.contains("tensor [1024 x 1024] f32 round trip ok"),
        "{out}"
    );
    assert!(out.contains("tensor [0 x 7] f32 round trip ok"), "{out}");
    assert!(out.contains("user-space copies 0"), "{out}");
    assert!(out.contains("handshake: authentication failed"), "{out}");
    assert!(out.trim_end().ends_with("tensor_pingpong: ok"), "{out}");
}

#[test]
fn cpp_routes_the_ten_region_scenario_and_repairs_a_crash() {
    let build = scratch("examples-geo10");
    make("all", &build);
    let data = repo_root().join("src/flow/data");
    let out = stdout_of(&run_ok(
        asan_env(&mut Command::new(build.join("route_geo10")))
            .arg(data.join("geo10.csv"))
            .arg(data.join("geo10-compute.csv")),
    ));
    assert!(out.contains("geo10, 6 stages: "), "{out}");
    assert!(out.contains("crash: "), "{out}");
    assert!(out.contains("repaired: "), "{out}");
    assert!(out.trim_end().ends_with("route_geo10: ok"), "{out}");
}

#[test]
fn go_package_tests_and_program_run() {
    if !go_available() {
        return;
    }
    let build = scratch("examples-go");
    let out = make("go-test", &build);
    assert!(
        out.contains("--- PASS: TestInvalidDetailIsAnError"),
        "{out}"
    );
    assert!(out.contains("ok  \tlibgwtf.local/gwtf"), "{out}");
    assert!(!out.contains("--- SKIP"), "{out}");
    for t in [
        "TestNodeSendRecvTensors",
        "TestEncryptedNodesExchangeTensors",
        "TestWrongKeyIsRefused",
        "TestNodeCloseTwiceAndShortKey",
        "TestStagesTrainAPipeline",
        "TestStageErrorsAndParameterTransfer",
    ] {
        assert!(out.contains(&format!("--- PASS: {t}")), "{t}: {out}");
    }

    // Again with the stand-in driver: the Go test asserts the no-device state.
    let stub = stub_libcuda_dir();
    let out = make_with_env(
        "go-test",
        &build,
        &[
            ("LD_LIBRARY_PATH", stub.as_os_str()),
            ("GWTF_EXPECT_CUDA_STATE", "2".as_ref()),
            ("GWTF_EXPECT_VERSION", env!("CARGO_PKG_VERSION").as_ref()),
        ],
    );
    assert!(out.contains("state no-device, 0 device(s): CUDA driver present but no device (CUDA_ERROR_NO_DEVICE)"), "{out}");
    assert!(out.contains("ok  \tlibgwtf.local/gwtf"), "{out}");

    let out = make("go-run", &build);
    assert!(
        out.contains(&format!(
            "libgwtf {} (ABI 1, header ABI 1)",
            env!("CARGO_PKG_VERSION")
        )),
        "{out}"
    );
    assert!(
        out.contains("probe with detail=7: status 1 (invalid argument)"),
        "{out}"
    );
    assert!(out.contains("gwtf-hello: ok"), "{out}");
}

#[test]
fn installed_library_is_usable_through_pkg_config() {
    let prefix = scratch("install-prefix");
    run_ok(
        Command::new(repo_root().join("scripts/install"))
            .arg(&prefix)
            .arg(lib_dir()),
    );
    let lib = prefix.join("lib");
    assert!(lib.join("libgwtf.so.1").is_file());
    assert!(prefix.join("include/gwtf.hpp").is_file());
    // What is installed carries no debug info, even when installed from this
    // debug build.
    for shipped in ["libgwtf.so.1", "libgwtf.a"] {
        let sections = stdout_of(&run_ok(
            Command::new("readelf")
                .args(["-S", "-W"])
                .arg(lib.join(shipped)),
        ));
        for debug_info in [".debug_info", ".debug_line"] {
            assert!(
                !sections.contains(debug_info),
                "{shipped} still has a {debug_info} section"
            );
        }
    }
    assert!(prefix.join("include/gwtf.h").is_file());
    let pc_path = lib.join("pkgconfig");
    let flags = |what: &str| -> Vec<String> {
        let out = run_ok(
            Command::new("pkg-config")
                .arg(what)
                .arg("gwtf")
                .env("PKG_CONFIG_PATH", &pc_path),
        );
        stdout_of(&out)
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    let version = stdout_of(&run_ok(
        Command::new("pkg-config")
            .args(["--modversion", "gwtf"])
            .env("PKG_CONFIG_PATH", &pc_path),
    ));
    assert_eq!(version.trim(), env!("CARGO_PKG_VERSION"));
    let exe = prefix.join("hello_c");
    run_ok(
        Command::new("cc")
            .arg("-std=c99")
            .args(WARN)
            .args(flags("--cflags"))
            .arg(repo_root().join("c-examples/c/hello.c"))
            .arg("-o")
            .arg(&exe)
            .args(flags("--libs"))
            .arg(format!("-Wl,-rpath,{}", lib.display())),
    );
    let out = stdout_of(&run_ok(&mut Command::new(&exe)));
    assert!(out.ends_with("hello_c: ok\n"), "{out}");
    // The program found the installed copy through its SONAME.
    let ldd = stdout_of(&run_ok(Command::new("ldd").arg(&exe)));
    assert!(
        ldd.contains(&format!(
            "libgwtf.so.1 => {}",
            lib.join("libgwtf.so.1").display()
        )),
        "{ldd}"
    );
}

/// A Go program in a module of its own uses the package as the README says:
/// `require libgwtf.local/gwtf` with a `replace` pointing at the checkout,
/// linked against an installed library, found at run time through an rpath.
#[test]
fn go_program_in_its_own_module_uses_the_installed_library() {
    if !go_available() {
        return;
    }
    let prefix = scratch("install-prefix-go");
    run_ok(
        Command::new(repo_root().join("scripts/install"))
            .arg(&prefix)
            .arg(lib_dir()),
    );
    let module = scratch("go-user-module");
    std::fs::write(
        module.join("go.mod"),
        format!(
            "module mytrainer\n\ngo 1.19\n\nrequire libgwtf.local/gwtf v0.0.0\n\nreplace libgwtf.local/gwtf => {}\n",
            repo_root().join("bindings/go").display()
        ),
    )
    .unwrap();
    std::fs::write(
        module.join("main.go"),
        r#"package main

import (
	"fmt"
	"os"

	"libgwtf.local/gwtf"
)

func main() {
	if err := gwtf.CheckABI(); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	s, err := gwtf.NewStage("llama-tiny", 2, 0, 1)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	defer s.Close()
	fmt.Printf("mytrainer: libgwtf %s, stage 0 has %d parameters\n", gwtf.Version(), s.Info().NumParams)
}
"#,
    )
    .unwrap();
    let lib = prefix.join("lib");
    let exe = module.join("mytrainer");
    run_ok(
        Command::new("go")
            .args(["build", "-o"])
            .arg(&exe)
            .arg(".")
            .current_dir(&module)
            .envs(go_env())
            .env("PKG_CONFIG_PATH", lib.join("pkgconfig"))
            .env("CGO_LDFLAGS", format!("-Wl,-rpath,{}", lib.display())),
    );
    let out = stdout_of(&run_ok(Command::new(&exe).env_remove("LD_LIBRARY_PATH")));
    let expected = format!(
        "mytrainer: libgwtf {}, stage 0 has ",
        env!("CARGO_PKG_VERSION")
    );
    assert!(out.starts_with(&expected), "{out}");
}
