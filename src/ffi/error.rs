//! `gwtf_error`: an owned error object (status + message) for C callers.
//!
//! There is deliberately no thread-local "last error": Go moves goroutines
//! between OS threads, so an error must travel with the call that failed.

use std::ffi::{c_char, CString};

use super::boundary::{guard_value, FfiError};
use super::status::gwtf_status;

/// An error returned through a trailing `gwtf_error **out_err` parameter.
pub struct gwtf_error {
    status: gwtf_status,
    message: CString,
}

impl gwtf_error {
    /// Heap-allocates an error for C (interior NULs in the message are replaced).
    pub(crate) fn boxed(err: FfiError) -> *mut gwtf_error {
        let text = format!("{}: {}", err.status, err.message).replace('\0', "\\0");
        let message = CString::new(text).unwrap_or_default();
        Box::into_raw(Box::new(gwtf_error {
            status: err.status,
            message,
        }))
    }
}

/// The message of an error: NUL-terminated UTF-8, starting with the status text.
///
/// Ownership: the string belongs to `err` and stays valid until
/// `gwtf_error_free(err)`; do not free it. A NULL `err` gives a static string.
///
/// Thread safety: an error object is immutable; it may be read from any thread.
///
/// Errors: none; never returns NULL.
#[no_mangle]
pub extern "C" fn gwtf_error_message(err: *const gwtf_error) -> *const c_char {
    if err.is_null() {
        return c"(null gwtf_error)".as_ptr();
    }
    // SAFETY: the caller passes an error it got from libgwtf and has not freed.
    guard_value(c"(error message unavailable)".as_ptr(), || unsafe {
        (*err).message.as_ptr()
    })
}

/// The status code carried by an error (a `GWTF_STATUS_*` value).
///
/// Ownership: `err` is only borrowed.
///
/// Thread safety: may be called from any thread.
///
/// Errors: a NULL `err` gives `GWTF_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn gwtf_error_status(err: *const gwtf_error) -> i32 {
    if err.is_null() {
        return gwtf_status::NullPointer as i32;
    }
    // SAFETY: the caller passes an error it got from libgwtf and has not freed.
    guard_value(gwtf_status::Panic as i32, || unsafe {
        (*err).status as i32
    })
}

/// Frees an error object. `gwtf_error_free(NULL)` does nothing.
///
/// Ownership: takes ownership of `err`; it must not be used afterwards.
///
/// Thread safety: do not free an error while another thread reads it.
///
/// Errors: none.
#[no_mangle]
pub extern "C" fn gwtf_error_free(err: *mut gwtf_error) {
    if err.is_null() {
        return;
    }
    // SAFETY: the caller passes an error it got from libgwtf, once.
    guard_value((), || drop(unsafe { Box::from_raw(err) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn roundtrip() {
        let e = gwtf_error::boxed(FfiError::invalid("bad\0thing"));
        assert_eq!(gwtf_error_status(e), gwtf_status::InvalidArgument as i32);
        let m = unsafe { CStr::from_ptr(gwtf_error_message(e)) };
        assert_eq!(m.to_str().unwrap(), "invalid argument: bad\\0thing");
        gwtf_error_free(e);
        gwtf_error_free(std::ptr::null_mut());
        assert_eq!(
            gwtf_error_status(std::ptr::null()),
            gwtf_status::NullPointer as i32
        );
    }
}
