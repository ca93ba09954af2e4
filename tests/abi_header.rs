//! The committed include/gwtf.h is exactly what cbindgen generates from the code.
//!
//! Regenerate after changing the C API: `GWTF_BLESS=1 cargo test --test abi_header`.

use std::path::Path;

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    // Only src/ffi/ (and the modules it declares) and the wire header are
    // parsed: the C ABI lives there, and a `pub const` elsewhere in the crate
    // must not leak into C (tests/abi_c.rs checks the header's namespace).
    let bindings = cbindgen::Builder::new()
        .with_src(root.join("src/ffi/mod.rs"))
        // The wire header struct is defined once, in src/wire, and is also C's.
        .with_src(root.join("src/wire/header.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen failed to generate the header");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("header is UTF-8")
}

#[test]
fn committed_header_matches_generated() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = root.join("include/gwtf.h");
    let generated = generate();
    if std::env::var_os("GWTF_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/gwtf.h");
        eprintln!("include/gwtf.h regenerated");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()));
        panic!(
            "include/gwtf.h differs from what cbindgen generates (first difference at line {}).\n\
             committed: {:?}\ngenerated: {:?}\n\
             Regenerate it with: GWTF_BLESS=1 cargo test --test abi_header",
            first + 1,
            committed.lines().nth(first),
            generated.lines().nth(first)
        );
    }
}

/// A function that changes its object takes a non-const handle: a C caller
/// holding a `const gwtf_flow *` must not be able to add a node through it.
#[test]
fn functions_that_change_an_object_take_a_non_const_handle() {
    let header = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include/gwtf.h"),
    )
    .unwrap();
    let changing = [
        "_add_",
        "_remove_",
        "_set_",
        "_solve",
        "_step",
        "_forward",
        "_backward",
        "_discard",
        "_import_",
        "_send",
        "_recv",
        "_connect",
        "_disconnect",
        "_shutdown",
        "_poll_event",
        "_frame_alloc",
    ];
    // Declarations only: drop the comments, which may hold '(' and ';'.
    let mut code = String::new();
    let mut rest = header.as_str();
    while let Some(start) = rest.find("/*") {
        code.push_str(&rest[..start]);
        rest = rest[start..]
            .split_once("*/")
            .map_or("", |(_, after)| after);
    }
    code.push_str(rest);
    let flat = code.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for decl in flat.split(';') {
        let Some(open) = decl.find('(') else { continue };
        let Some(name) = decl[..open].split_whitespace().last() else {
            continue;
        };
        let name = name.trim_start_matches('*');
        if !name.starts_with("gwtf_") || !changing.iter().any(|v| name.contains(v)) {
            continue;
        }
        let first = decl[open + 1..].split(',').next().unwrap_or("").trim();
        let first = first.replace("struct ", "");
        // Only handles (opaque objects) are concerned, not options structs.
        let handle = ["gwtf_flow", "gwtf_node", "gwtf_stage", "gwtf_frame"]
            .iter()
            .any(|h| {
                first.starts_with(&format!("const {h} *")) || first.starts_with(&format!("{h} *"))
            });
        if !handle {
            continue;
        }
        checked += 1;
        if first.starts_with("const ") {
            wrong.push(format!("{name}({first}, ...)"));
        }
    }
    assert!(checked >= 25, "only {checked} changing functions found");
    assert!(
        wrong.is_empty(),
        "declared with a const handle:\n{}",
        wrong.join("\n")
    );
}
