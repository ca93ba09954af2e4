//! The panic boundary and handle checks shared by every exported function.
//!
//! Every exported body runs inside [`guard`] (or [`guard_handle`]): a Rust
//! error becomes a status plus an optional `gwtf_error`, and a panic becomes
//! `GWTF_STATUS_PANIC` instead of unwinding into C (undefined behaviour) or
//! aborting the host process. A panic while a handle was in use poisons that
//! handle: later calls on it return `GWTF_STATUS_POISONED`, since its state may
//! be half-updated; it can still be freed.

use std::any::Any;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::error::gwtf_error;
use super::status::gwtf_status;

/// An error on its way out to C: a status and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FfiError {
    pub status: gwtf_status,
    pub message: String,
}

impl FfiError {
    pub fn new(status: gwtf_status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(gwtf_status::InvalidArgument, message)
    }
    pub fn null(what: &str) -> Self {
        Self::new(gwtf_status::NullPointer, format!("{what} must not be NULL"))
    }
}

impl std::fmt::Display for FfiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for FfiError {}

pub type FfiResult<T> = Result<T, FfiError>;

/// Turns a caught panic payload into a message.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Stores `err` into `*out_err` when the caller asked for error objects.
fn report(out_err: *mut *mut gwtf_error, err: FfiError) -> gwtf_status {
    let status = err.status;
    if !out_err.is_null() {
        // SAFETY: the caller promises `out_err` is NULL or a valid pointer.
        unsafe { *out_err = gwtf_error::boxed(err) };
    }
    status
}

/// Runs an exported body: clears `*out_err`, maps errors and panics to a status.
pub fn guard<F>(out_err: *mut *mut gwtf_error, body: F) -> gwtf_status
where
    F: FnOnce() -> FfiResult<()>,
{
    if !out_err.is_null() {
        // SAFETY: the caller promises `out_err` is NULL or a valid pointer.
        unsafe { *out_err = std::ptr::null_mut() };
    }
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => gwtf_status::Ok,
        Ok(Err(e)) => report(out_err, e),
        Err(payload) => report(
            out_err,
            FfiError::new(
                gwtf_status::Panic,
                format!("panic inside libgwtf: {}", panic_message(&*payload)),
            ),
        ),
    }
}

/// Runs a body that never fails (no status to return): a panic gives `fallback`.
pub fn guard_value<T, F: FnOnce() -> T>(fallback: T, body: F) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

/// Common header of every opaque handle: a type tag and the poison flag.
pub struct HandleHeader {
    magic: AtomicU64,
    poisoned: AtomicBool,
}

const DEAD_MAGIC: u64 = 0xDEAD_DEAD_DEAD_DEAD;

impl HandleHeader {
    pub fn new(magic: u64) -> Self {
        Self {
            magic: AtomicU64::new(magic),
            poisoned: AtomicBool::new(false),
        }
    }
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }
    pub fn poison(&self) {
        self.poisoned.store(true, Ordering::Release)
    }
}

/// An opaque object handed to C as a pointer.
pub trait FfiHandle: Sized {
    /// A per-type tag: catches a handle of the wrong type or a stale pointer
    /// (best effort; freed memory can be reused).
    const MAGIC: u64;
    /// The C type name, for messages.
    const NAME: &'static str;
    fn header(&self) -> &HandleHeader;

    /// Moves the object to the heap and returns the pointer C will own.
    fn into_raw(self) -> *mut Self {
        Box::into_raw(Box::new(self))
    }
}

/// Checks a handle pointer: not NULL, of the right type, not poisoned.
///
/// # Safety
/// `ptr` must be NULL or point to memory that was, at some point, a `H`.
pub(crate) unsafe fn check_handle<'a, H: FfiHandle>(ptr: *const H) -> FfiResult<&'a H> {
    if ptr.is_null() {
        return Err(FfiError::null(H::NAME));
    }
    // SAFETY: non-null, and the caller promises it points to an H it got from us.
    let h = unsafe { &*ptr };
    if h.header().magic.load(Ordering::Acquire) != H::MAGIC {
        return Err(FfiError::invalid(format!(
            "not a live {} handle (wrong type, or already freed)",
            H::NAME
        )));
    }
    if h.header().is_poisoned() {
        return Err(FfiError::new(
            gwtf_status::Poisoned,
            format!("this {} was poisoned by an earlier panic; free it", H::NAME),
        ));
    }
    Ok(h)
}

/// Runs an exported body that uses one handle; a panic poisons that handle.
pub fn guard_handle<H, F>(out_err: *mut *mut gwtf_error, handle: *const H, body: F) -> gwtf_status
where
    H: FfiHandle,
    F: FnOnce(&H) -> FfiResult<()>,
{
    guard(out_err, || {
        // SAFETY: the C contract says `handle` is NULL or one of ours.
        let h = unsafe { check_handle(handle)? };
        match catch_unwind(AssertUnwindSafe(|| body(h))) {
            Ok(r) => r,
            Err(payload) => {
                h.header().poison();
                Err(FfiError::new(
                    gwtf_status::Panic,
                    format!(
                        "panic inside libgwtf ({} is now poisoned): {}",
                        H::NAME,
                        panic_message(&*payload)
                    ),
                ))
            }
        }
    })
}

/// Frees a handle made by [`FfiHandle::into_raw`]; NULL is a no-op.
///
/// A pointer of the wrong type is ignored rather than freed (it would corrupt
/// the heap); the tag is cleared first so that a second free is caught when the
/// memory has not been reused yet.
///
/// # Safety
/// `ptr` must be NULL or a pointer returned by `into_raw` for this type.
pub unsafe fn free_handle<H: FfiHandle>(ptr: *mut H) {
    if ptr.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: per the function contract.
        let h = unsafe { &*ptr };
        if h.header()
            .magic
            .compare_exchange(H::MAGIC, DEAD_MAGIC, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: we own it (tag matched and is now cleared).
            drop(unsafe { Box::from_raw(ptr) });
        }
    }));
}

/// Checks an out-pointer before any work is done (outputs are written only on success).
pub fn require_out<T>(ptr: *mut T, what: &str) -> FfiResult<()> {
    if ptr.is_null() {
        Err(FfiError::null(what))
    } else {
        Ok(())
    }
}

/// Writes an output value (after `require_out` succeeded).
///
/// # Safety
/// `ptr` must be valid for writes of `T`.
pub unsafe fn write_out<T>(ptr: *mut T, value: T) {
    // SAFETY: per the function contract.
    unsafe { ptr.write(value) }
}

/// Writes `value` into caller memory of `size` bytes: a struct that only
/// grows at the end, of which an older caller knows a smaller size, gets
/// the fields it knows.
///
/// # Safety
/// `ptr` must be valid for writes of `size` bytes.
pub unsafe fn write_sized<T: Copy>(ptr: *mut T, size: usize, value: &T) {
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: per the function contract; at most `size` bytes are written.
    unsafe { std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), ptr.cast::<u8>(), n) };
}

/// Copies `s` as a NUL-terminated string into a caller buffer.
///
/// `*out_len` (when not NULL) receives the string length without the NUL,
/// also when the buffer is too small, so that the caller can retry with
/// `len + 1` bytes. `buf` may be NULL with `buf_len == 0` to ask the length.
///
/// # Safety
/// `buf` must be NULL or valid for `buf_len` bytes; `out_len` NULL or valid.
pub unsafe fn copy_str_out(
    s: &str,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
) -> FfiResult<()> {
    let bytes = s.as_bytes();
    if !out_len.is_null() {
        // SAFETY: per the function contract.
        unsafe { *out_len = bytes.len() };
    }
    if buf.is_null() && buf_len != 0 {
        return Err(FfiError::null("buf (with buf_len > 0)"));
    }
    if buf_len < bytes.len() + 1 {
        return Err(FfiError::new(
            gwtf_status::BufferTooSmall,
            format!(
                "buffer of {buf_len} bytes is too small: {} needed",
                bytes.len() + 1
            ),
        ));
    }
    // SAFETY: buf is valid for buf_len >= len + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
        *buf.add(bytes.len()) = 0;
    }
    Ok(())
}
