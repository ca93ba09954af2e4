//! A test that cannot run on this machine (no GPU, no NVRTC, no network
//! namespaces, ...) says so through [`skipped`] instead of passing quietly.
//!
//! It writes `SKIPPED <test>: <reason>` to stderr (directly: libtest captures
//! `eprintln!` of passing tests) and, when `GWTF_SKIP_LOG` names a file (the
//! test command sets it), appends `<test>: <reason>` to that file, so that
//! `scripts/test` counts the test as skipped, not passed, and lists it.
#![allow(dead_code)]

use std::io::Write;

/// Records that the calling test was skipped, and why. The test then returns.
pub fn skipped(reason: &str) {
    // libtest runs every test on a thread named after it.
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed test")
        .to_string();
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|s| {
            s.rsplit_once('-')
                .map_or(s.clone(), |(crate_, _)| crate_.to_string())
        })
        .unwrap_or_default();
    let line = format!("{binary}::{test}: {reason}");
    let _ = writeln!(std::io::stderr(), "SKIPPED {line}");
    if let Some(log) = std::env::var_os("GWTF_SKIP_LOG") {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            panic!("cannot record the skip in GWTF_SKIP_LOG: {e}");
        }
    }
}
