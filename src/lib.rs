//! libgwtf: Go With The Flow.
pub mod cuda;
pub mod engine;
pub mod ffi;
pub mod flow;
pub mod model;
pub mod pool;
pub mod protocol;
pub mod sim;
pub mod swarm;
pub mod wire;

/// The library's version, "MAJOR.MINOR.PATCH" (what `gwtf_version()` returns
/// to C; the `gwtf` tool, a crate of its own, prints it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
