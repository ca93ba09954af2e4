//! The tool as a user first meets it: `--version` and `--help` answer, and
//! a command that does not exist is refused. The system tests of its
//! commands (demo, node, sim, bench, ...) are the workspace root's tests/,
//! which run this crate's binary; being an integration test, this file also
//! makes a plain `cargo test` build that binary before any test runs.
use std::process::Command;

fn gwtf(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gwtf"))
        .args(args)
        .output()
        .expect("run the gwtf tool")
}

#[test]
fn version_names_the_library_not_the_tool_crate() {
    for args in [&["--version"][..], &["version"]] {
        let out = gwtf(args);
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(gwtf::VERSION), "{args:?}: {text}");
    }
}

#[test]
fn help_lists_the_main_commands() {
    let out = gwtf(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in ["demo", "node", "train", "sample", "sim", "bench"] {
        assert!(text.contains(cmd), "--help does not list {cmd}:\n{text}");
    }
}

#[test]
fn an_unknown_command_is_refused() {
    let out = gwtf(&["no-such-command"]);
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no-such-command"), "{err}");
}
