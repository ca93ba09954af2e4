//! Library and ABI versions, at compile time (header macros) and at run time.

use std::ffi::c_char;

/// Major version of libgwtf (equals Cargo.toml's; checked by tests).
pub const GWTF_VERSION_MAJOR: u32 = 0;
/// Minor version of libgwtf.
pub const GWTF_VERSION_MINOR: u32 = 1;
/// Patch version of libgwtf.
pub const GWTF_VERSION_PATCH: u32 = 0;
/// MAJOR * 10000 + MINOR * 100 + PATCH, for preprocessor comparisons.
pub const GWTF_VERSION_NUMBER: u32 = 100;
/// The ABI version: the N of the SONAME `libgwtf.so.N`. It changes only when a
/// released symbol, struct layout or status value would change incompatibly.
pub const GWTF_ABI_VERSION: u32 = 1;

const VERSION_STRING: &std::ffi::CStr = c"0.1.0";

/// The library version as "MAJOR.MINOR.PATCH".
///
/// Ownership: static string; never free it.
///
/// Thread safety: may be called from any thread.
///
/// Errors: none; never returns NULL.
#[no_mangle]
pub extern "C" fn gwtf_version() -> *const c_char {
    VERSION_STRING.as_ptr()
}

/// The ABI version of the loaded library. A program compares it with the
/// `GWTF_ABI_VERSION` it was compiled against and refuses to run on a mismatch.
///
/// Ownership: nothing is allocated.
///
/// Thread safety: may be called from any thread.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_abi_version() -> u32 {
    GWTF_ABI_VERSION
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_cargo() {
        let v = env!("CARGO_PKG_VERSION");
        let parts: Vec<u32> = v.split('.').map(|p| p.parse().unwrap()).collect();
        assert_eq!(
            parts,
            [GWTF_VERSION_MAJOR, GWTF_VERSION_MINOR, GWTF_VERSION_PATCH]
        );
        assert_eq!(
            GWTF_VERSION_NUMBER,
            GWTF_VERSION_MAJOR * 10000 + GWTF_VERSION_MINOR * 100 + GWTF_VERSION_PATCH
        );
        assert_eq!(VERSION_STRING.to_str().unwrap(), v);
        assert_eq!(crate::VERSION, v);
        assert_eq!(gwtf_abi_version(), GWTF_ABI_VERSION);
    }
}
