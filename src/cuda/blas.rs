//! Matrix multiplies on the device through cuBLAS.
//!
//! cuBLAS is loaded at run time, like the driver and NVRTC: from
//! `$GWTF_CUBLAS_LIBRARY` (an absolute path, e.g. the `libcublas.so.12` of the
//! `nvidia-cublas-cu12` wheel) or by the loader's usual search. cudarc panics
//! when the library is missing, so [`check_available`] looks first and a
//! missing library is a [`GpuError::Unavailable`], never a crash.
//!
//! cuBLAS is column-major, the models are row-major: [`row_major_sgemm`] turns the
//! row-major product of [`crate::model::ops::gemm`] into the equivalent column-major call
//! (the derivation is written there), which `Blas::sgemm` queues.

use super::gpu::GpuError;

/// Loads cuBLAS if it can be found; the error says where it looked.
pub fn check_available() -> Result<(), GpuError> {
    imp::check_available(std::env::var_os("GWTF_CUBLAS_LIBRARY").as_deref())
}

/// [`check_available`] with an explicit library path instead of the environment's.
pub fn check_available_at(path: Option<&std::ffi::OsStr>) -> Result<(), GpuError> {
    imp::check_available(path)
}

/// One column-major `cublasSgemm` call with `alpha = 1`:
/// `C = op(A) op(B) + beta C`, `op(A)` of shape `[m, k]`, `op(B)` `[k, n]`, `C` `[m, n]`,
/// each stored column-major with leading dimension `lda`, `ldb`, `ldc`; `op(X)` is `X`
/// or, with `trans_x`, its transpose.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgemmCall {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub a: u64,
    pub lda: i32,
    pub b: u64,
    pub ldb: i32,
    /// 0 (overwrite C, which is not read) or 1 (accumulate).
    pub beta: f32,
    pub c: u64,
    pub ldc: i32,
}

/// The column-major call that computes the row-major `c = a' * b' + beta * c` of
/// [`crate::model::ops::gemm`]: `c` is `[m, n]`; `a'` is `a` stored `[m, k]`, or with `ta`
/// the transpose of `a` stored `[k, m]`; `b'` is `b` stored `[k, n]`, or with `tb` the
/// transpose of `b` stored `[n, k]` (all row-major, densely packed). `None` when there is
/// nothing to compute (`m` or `n` is 0).
#[allow(clippy::too_many_arguments)]
pub fn row_major_sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: u64,
    ta: bool,
    b: u64,
    tb: bool,
    beta: f32,
    c: u64,
) -> Result<Option<SgemmCall>, GpuError> {
    if m == 0 || n == 0 {
        return Ok(None);
    }
    let dim = |x: usize| {
        i32::try_from(x).map_err(|_| GpuError::Invalid(format!("gemm dimension {x} exceeds i32")))
    };
    let (mi, ki, ni) = (dim(m)?, dim(k)?, dim(n)?);
    let k1 = dim(k.max(1))?;
    // A row-major matrix X of r rows and s columns (leading stride s) is, byte for byte,
    // the column-major matrix X^T (s rows, r columns, leading dimension s). So the
    // row-major product C = A' B' ([m, n]) is the column-major product
    //     C^T = B'^T A'^T      ([n, m], leading dimension n),
    // which is what we ask cuBLAS for: its first operand is our `b`, its second our `a`,
    // and its (m, n, k) are our (n, m, k).
    // - First operand, op(B'^T) of shape [n, k]: without `tb`, `b` is stored row-major
    //   [k, n] = column-major [n, k] with ld n: exactly B'^T, no transpose (lda = n).
    //   With `tb`, B' = b^T and `b` is stored row-major [n, k] = column-major [k, n] = B'
    //   with ld k: transpose it (lda = k).
    // - Second operand, op(A'^T) of shape [k, m]: without `ta`, `a` is stored row-major
    //   [m, k] = column-major [k, m] = A'^T with ld k (ldb = k). With `ta`, `a` is stored
    //   row-major [k, m] = column-major [m, k] = A' with ld m: transpose it (ldb = m).
    // - Result: column-major [n, m] with ldc = n is row-major [m, n]: `c`.
    // cuBLAS needs lda >= rows of the stored first operand (n if not transposed, k if
    // transposed), ldb >= rows of the stored second operand (k, or m) and ldc >= its m
    // (our n): these hold with equality (k is raised to 1 for the empty product, where
    // cuBLAS still wants ld >= 1).
    Ok(Some(SgemmCall {
        trans_a: tb,
        trans_b: ta,
        m: ni,
        n: mi,
        k: ki,
        a: b,
        lda: if tb { k1 } else { ni },
        b: a,
        ldb: if ta { mi } else { k1 },
        beta,
        c,
        ldc: ni,
    }))
}

/// `cublasSgemm` as its documentation defines it (column-major, `alpha = 1`), computed on
/// host memory with f64 sums: the reference the tests hold [`row_major_sgemm`]'s calls to,
/// and the matrix multiply of the CPU emulation of the device in the tests.
///
/// # Safety
/// The addresses must be host memory holding the matrices the call describes (`c` not
/// overlapping `a` or `b`).
pub unsafe fn host_sgemm(call: &SgemmCall) {
    let (m, n, k) = (call.m as usize, call.n as usize, call.k as usize);
    let (lda, ldb, ldc) = (call.lda as usize, call.ldb as usize, call.ldc as usize);
    assert!(
        ldc >= m.max(1)
            && lda >= if call.trans_a { k } else { m }.max(1)
            && ldb >= if call.trans_b { n } else { k }.max(1),
        "sgemm: a leading dimension is too small: {call:?}"
    );
    let (a, b, c) = (
        call.a as *const f32,
        call.b as *const f32,
        call.c as *mut f32,
    );
    for j in 0..n {
        for i in 0..m {
            let mut s = 0.0f64;
            for p in 0..k {
                // op(A)[i, p] and op(B)[p, j]; column-major element (r, c) is at r + c * ld.
                let ea = if call.trans_a {
                    p + i * lda
                } else {
                    i + p * lda
                };
                let eb = if call.trans_b {
                    j + p * ldb
                } else {
                    p + j * ldb
                };
                // SAFETY: caller's contract.
                s += unsafe { *a.add(ea) as f64 * *b.add(eb) as f64 };
            }
            // SAFETY: caller's contract.
            unsafe {
                let e = c.add(i + j * ldc);
                let old = if call.beta == 0.0 {
                    0.0
                } else {
                    call.beta as f64 * *e as f64
                };
                *e = (s + old) as f32;
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::GpuError;
    pub fn check_available(_: Option<&std::ffi::OsStr>) -> Result<(), GpuError> {
        Err(GpuError::Unavailable(
            "CUDA support is not built into this libgwtf".into(),
        ))
    }
}

#[cfg(feature = "cuda")]
pub use imp::Blas;

#[cfg(feature = "cuda")]
mod imp {
    use super::{GpuError, SgemmCall};
    use crate::cuda::gpu::Gpu;
    use cudarc::cublas::{result as blas, sys, CudaBlas};
    use std::ffi::{CString, OsStr};
    use std::os::unix::ffi::OsStrExt;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    fn blas_err(what: &str, e: blas::CublasError) -> GpuError {
        GpuError::Blas(format!("{what}: {:?}", e.0))
    }

    pub fn check_available(path: Option<&OsStr>) -> Result<(), GpuError> {
        if let Some(path) = path {
            let c = CString::new(path.as_bytes()).map_err(|_| {
                GpuError::Unavailable("GWTF_CUBLAS_LIBRARY contains a NUL byte".into())
            })?;
            // SAFETY: dlopen with a valid C string. RTLD_GLOBAL so that cudarc's later
            // dlopen by SONAME (libcublas.so.12) finds this already-loaded copy.
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if handle.is_null() {
                return Err(GpuError::Unavailable(format!(
                    "cuBLAS library {} could not be loaded",
                    path.to_string_lossy()
                )));
            }
        }
        // SAFETY: only tries to dlopen candidate library names.
        if unsafe { sys::is_culib_present() } {
            Ok(())
        } else {
            Err(GpuError::Unavailable(
                "no cuBLAS library (libcublas.so.12) found; install the CUDA toolkit's \
                 cuBLAS or the nvidia-cublas-cu12 wheel, or set GWTF_CUBLAS_LIBRARY"
                    .into(),
            ))
        }
    }

    /// A cuBLAS handle bound to the stream of a [`Gpu`], in plain fp32 math.
    pub struct Blas {
        handle: CudaBlas,
    }

    impl Blas {
        /// Checks that cuBLAS is present, then creates a handle on `gpu`'s stream.
        pub fn new(gpu: &Gpu) -> Result<Blas, GpuError> {
            super::check_available()?;
            let stream = gpu.stream().clone();
            // cudarc panics if a symbol is missing from a broken library: contain it.
            let made = catch_unwind(AssertUnwindSafe(|| -> Result<CudaBlas, GpuError> {
                let handle = CudaBlas::new(stream).map_err(|e| blas_err("cublasCreate", e))?;
                // Plain fp32: no TF32 tensor-core rounding of the inputs, so that the
                // products stay within fp32 rounding of the CPU's.
                // SAFETY: a live handle.
                unsafe {
                    sys::cublasSetMathMode(*handle.handle(), sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                }
                .result()
                .map_err(|e| blas_err("cublasSetMathMode", e))?;
                Ok(handle)
            }))
            .map_err(|_| {
                GpuError::Unavailable("the cuBLAS library lacks an expected symbol".into())
            })??;
            Ok(Blas { handle: made })
        }

        /// Queues one column-major sgemm on the stream.
        ///
        /// # Safety
        /// The addresses must be device memory holding the matrices the call describes,
        /// allocated until it has run; `c` must not overlap `a` or `b`.
        pub unsafe fn sgemm(&self, call: &SgemmCall) -> Result<(), GpuError> {
            use sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
            let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
            let alpha = 1.0f32;
            // SAFETY: the caller guarantees the memory; alpha and beta are host scalars
            // (the handle is in the default host pointer mode).
            unsafe {
                blas::sgemm(
                    *self.handle.handle(),
                    op(call.trans_a),
                    op(call.trans_b),
                    call.m,
                    call.n,
                    call.k,
                    &alpha,
                    call.a as *const f32,
                    call.lda,
                    call.b as *const f32,
                    call.ldb,
                    &call.beta,
                    call.c as *mut f32,
                    call.ldc,
                )
            }
            .map_err(|e| blas_err("cublasSgemm", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_cublas_library_is_an_error_not_a_panic() {
        let err = check_available_at(Some(std::ffi::OsStr::new("/nonexistent/libcublas.so.12")))
            .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, GpuError::Unavailable(_)), "{text}");
        assert!(
            text.contains("/nonexistent/libcublas.so.12") || text.contains("not built"),
            "{text}"
        );
        // Without a path the answer depends on the machine, but it is an answer.
        let _ = check_available_at(None);
    }

    #[test]
    fn row_major_gemm_through_the_column_major_call_equals_ops_gemm() {
        let (m, k, n) = (5usize, 7usize, 3usize);
        let val = |i: usize| ((i * 37 % 23) as f32 - 11.0) / 8.0;
        for ta in [false, true] {
            for tb in [false, true] {
                for beta in [0.0f32, 1.0] {
                    let a: Vec<f32> = (0..m * k).map(val).collect();
                    let b: Vec<f32> = (0..k * n).map(|i| val(i + 5)).collect();
                    let c0: Vec<f32> = (0..m * n).map(|i| val(i + 9)).collect();
                    let mut want = c0.clone();
                    crate::model::ops::gemm(m, k, n, &a, ta, &b, tb, beta, &mut want);
                    let mut got = c0.clone();
                    let call = row_major_sgemm(
                        m,
                        k,
                        n,
                        a.as_ptr() as u64,
                        ta,
                        b.as_ptr() as u64,
                        tb,
                        beta,
                        got.as_mut_ptr() as u64,
                    )
                    .unwrap()
                    .unwrap();
                    // SAFETY: the three vectors hold the matrices the call describes.
                    unsafe { host_sgemm(&call) };
                    for (x, y) in got.iter().zip(&want) {
                        assert!(
                            (x - y).abs() <= 1e-5,
                            "ta {ta} tb {tb} beta {beta}: {got:?} vs {want:?}"
                        );
                    }
                }
            }
        }
        assert_eq!(
            row_major_sgemm(0, 3, 4, 0, false, 0, false, 0.0, 0).unwrap(),
            None
        );
        assert!(row_major_sgemm(1 << 31, 1, 1, 0, false, 0, false, 0.0, 0).is_err());
    }
}
