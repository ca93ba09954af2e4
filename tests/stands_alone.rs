//! The repository stands alone: a user's clone has nothing beside it, so no
//! tracked file may read or name a path outside the repository or documents
//! that only exist there. (`.ci/run` also runs the whole test command in a
//! fresh clone inside an empty directory; this test fails earlier and says
//! which file and line.)
use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Spelled in pieces so that this file does not match itself.
fn forbidden() -> Vec<String> {
    vec![
        ["..", "/shared"].concat(),
        ["shared", "/bench"].concat(),
        ["GWTF", ".md"].concat(),
        ["DESIGN", ".md"].concat(),
        ["notes/", "perf-anchors"].concat(),
        ["BENCHMARKING", ".md"].concat(),
    ]
}

#[test]
fn no_tracked_file_names_anything_outside_the_repository() {
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(repo())
        .output()
        .expect("git is needed to list the tracked files");
    assert!(out.status.success(), "git ls-files failed");
    let files: Vec<String> = String::from_utf8(out.stdout)
        .expect("file names are UTF-8")
        .split('\0')
        .filter(|f| !f.is_empty())
        .map(String::from)
        .collect();
    assert!(files.len() > 50, "only {} tracked files?", files.len());
    let needles = forbidden();
    let mut hits = Vec::new();
    for file in &files {
        let Ok(bytes) = std::fs::read(repo().join(file)) else {
            continue; // deleted in the work tree
        };
        let Ok(text) = String::from_utf8(bytes) else {
            continue; // binary (fuzz seeds)
        };
        for (n, line) in text.lines().enumerate() {
            for needle in &needles {
                if line.contains(needle.as_str()) {
                    hits.push(format!("{file}:{}: names {needle}", n + 1));
                }
            }
        }
    }
    assert!(hits.is_empty(), "outside references:\n{}", hits.join("\n"));
}
