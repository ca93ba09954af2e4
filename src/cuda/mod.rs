//! CUDA: device probe, NVRTC-compiled kernels with CPU twins ([`kernels`], [`nvrtc`]),
//! their launcher ([`gpu`]) and matrix multiplies through cuBLAS ([`blas`]).
//!
//! CUDA is loaded at run time: the library builds without CUDA and runs on
//! machines without a driver or a GPU. Everything starts with [`probe`], which
//! never crashes: cudarc panics when the driver library is missing, so we ask
//! `is_culib_present` first and also contain any panic from a broken driver.

pub mod blas;
pub mod gpu;
pub mod kernels;
pub mod nvrtc;
pub mod probe;

pub use probe::{probe, DeviceInfo, ProbeDetail, ProbeReport, ProbeState};
