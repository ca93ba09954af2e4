//! Run-time compilation of the kernels with NVRTC.
//!
//! NVRTC compiles CUDA C to PTX without a GPU, so every machine can check the
//! kernels. The library is found, in order, at `$GWTF_NVRTC_LIBRARY` (an
//! absolute path, e.g. the `libnvrtc.so.12` of the `nvidia-cuda-nvrtc-cu12`
//! wheel that scripts/nvrtc-deps installs) or by the loader's usual search.

use std::fmt;

/// Why a kernel could not be compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvrtcError {
    /// This build has no CUDA support.
    Disabled,
    /// No NVRTC library could be loaded.
    Unavailable(String),
    /// NVRTC rejected the source: its log.
    Compile { file: String, log: String },
}

impl fmt::Display for NvrtcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Disabled => write!(f, "CUDA support is not built into this libgwtf"),
            Self::Unavailable(why) => write!(f, "NVRTC is not available: {why}"),
            Self::Compile { file, log } => write!(f, "NVRTC failed to compile {file}:\n{log}"),
        }
    }
}

impl std::error::Error for NvrtcError {}

/// Loads NVRTC if it can be found; the error says where it looked.
pub fn ensure_loaded() -> Result<(), NvrtcError> {
    imp::ensure_loaded()
}

/// Compiles one CUDA C source to PTX for a virtual architecture such as
/// `"compute_90"`.
pub fn compile_ptx(file: &str, source: &str, arch: &'static str) -> Result<String, NvrtcError> {
    imp::compile_ptx(file, source, arch)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::NvrtcError;
    pub fn ensure_loaded() -> Result<(), NvrtcError> {
        Err(NvrtcError::Disabled)
    }
    pub fn compile_ptx(_: &str, _: &str, _: &'static str) -> Result<String, NvrtcError> {
        Err(NvrtcError::Disabled)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::NvrtcError;
    use std::ffi::CString;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::OnceLock;

    fn preload_from_env() -> Result<(), String> {
        let Some(path) = std::env::var_os("GWTF_NVRTC_LIBRARY") else {
            return Ok(());
        };
        let c = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| "GWTF_NVRTC_LIBRARY contains a NUL byte".to_string())?;
        // SAFETY: dlopen with a valid C string. RTLD_GLOBAL so that cudarc's later
        // dlopen by SONAME finds this already-loaded copy.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(format!(
                "GWTF_NVRTC_LIBRARY={} could not be loaded",
                path.to_string_lossy()
            ));
        }
        Ok(())
    }

    pub fn ensure_loaded() -> Result<(), NvrtcError> {
        static LOADED: OnceLock<Result<(), NvrtcError>> = OnceLock::new();
        LOADED
            .get_or_init(|| {
                preload_from_env().map_err(NvrtcError::Unavailable)?;
                // SAFETY: only tries to dlopen candidate names.
                if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                    Ok(())
                } else {
                    Err(NvrtcError::Unavailable(
                        "no libnvrtc.so found (set GWTF_NVRTC_LIBRARY, or run scripts/nvrtc-deps)"
                            .into(),
                    ))
                }
            })
            .clone()
    }

    pub fn compile_ptx(file: &str, source: &str, arch: &'static str) -> Result<String, NvrtcError> {
        ensure_loaded()?;
        let opts = cudarc::nvrtc::CompileOptions {
            fmad: Some(false),
            prec_div: Some(true),
            prec_sqrt: Some(true),
            arch: Some(arch),
            name: Some(file.to_string()),
            ..Default::default()
        };
        // cudarc panics if a symbol is missing from a broken library: contain it.
        let result = catch_unwind(AssertUnwindSafe(|| {
            cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        }))
        .map_err(|_| NvrtcError::Unavailable("NVRTC library lacks an expected symbol".into()))?;
        match result {
            Ok(ptx) => Ok(ptx.to_src()),
            Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => {
                Err(NvrtcError::Compile {
                    file: file.to_string(),
                    log: log.to_string_lossy().into_owned(),
                })
            }
            Err(e) => Err(NvrtcError::Compile {
                file: file.to_string(),
                log: format!("{e:?}"),
            }),
        }
    }
}
