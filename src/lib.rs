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
