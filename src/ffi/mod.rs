//! The C ABI: the only module with exported `extern "C"` functions.
//!
//! One file per C object (`status`, `error`, `version`, `cuda`, `flow`,
//! `node`, `frame`, `stage`, `kernels`, `peer`, `audit`), plus the machinery
//! every export shares: the panic boundary and handle checks ([`boundary`])
//! and the checked conversion of enum-like integers ([`enums`]).
//!
//! Conventions (see docs/ARCHITECTURE.md): every symbol is `gwtf_<object>_<verb>`; fallible
//! calls return a [`gwtf_status`] and take an optional trailing
//! `gwtf_error **out_err`; outputs are written only on success; `_free(NULL)` is
//! a no-op; a panic never crosses the boundary.

// C names (`gwtf_status`, `gwtf_error`, ...) are the ABI; they keep C style.
#![allow(non_camel_case_types)]
// Exported functions take raw pointers from C, which has no `unsafe`: their
// pointer contracts are written in each function's doc (the header), and
// every dereference is checked for NULL first and marked with a SAFETY note.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod audit;
pub mod boundary;
pub mod cuda;
pub mod enums;
pub mod error;
pub mod flow;
pub mod frame;
pub mod kernels;
pub mod node;
pub mod peer;
pub mod stage;
pub mod status;
pub mod version;

pub use boundary::{FfiError, FfiResult};
pub use status::gwtf_status;
