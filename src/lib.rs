//! libgwtf: Go With The Flow.
pub mod cuda;
pub mod ffi;
pub mod flow;
pub mod model;
pub mod protocol;
pub mod sim;
