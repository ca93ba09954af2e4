//! The committed include/gwtf.h is exactly what cbindgen generates from the code.
//!
//! Regenerate after changing the C API: `GWTF_BLESS=1 cargo test --test abi_header`.

use std::path::Path;

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    // Only src/ffi/ (and the modules it declares) is parsed: the C ABI lives
    // there, and a `pub const` elsewhere in the crate must not leak into C.
    let bindings = cbindgen::Builder::new()
        .with_src(root.join("src/ffi/mod.rs"))
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
