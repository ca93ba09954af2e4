//! Sets the shared library's SONAME to `libgwtf.so.<ABI>` (Linux).
//!
//! The ABI number must equal `GWTF_ABI_VERSION` in src/ffi/version.rs; the
//! tests read the SONAME back from the built library and compare.
const ABI_VERSION: u32 = 1;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgwtf.so.{ABI_VERSION}");
    }
}
