//! `gwtf_status`: the result code of every fallible C call.

use std::ffi::c_char;

/// Result code of every fallible libgwtf call.
///
/// The numeric values are part of the ABI: they are never renumbered, and new
/// codes are only ever appended. C receives it as an `int32_t`; an unknown value
/// (from a newer library) must be treated as a generic failure.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum gwtf_status {
    /// Success. Outputs have been written.
    Ok = 0,
    /// An argument has a value that makes no sense (see the error message).
    InvalidArgument = 1,
    /// A required pointer argument (handle or out-pointer) was NULL.
    NullPointer = 2,
    /// A caller buffer is too small; the required length was reported.
    BufferTooSmall = 3,
    /// An options struct carries a version this library does not know.
    UnsupportedVersion = 4,
    /// A configured limit would be exceeded (checked before allocating).
    LimitExceeded = 5,
    /// Memory could not be allocated.
    OutOfMemory = 6,
    /// The operation did not complete within its timeout.
    Timeout = 7,
    /// A named thing (node, peer, arc, device) does not exist.
    NotFound = 8,
    /// An operating-system I/O error.
    Io = 9,
    /// A peer or a file violated the protocol or format.
    Protocol = 10,
    /// The object was shut down or the connection closed.
    Closed = 11,
    /// CUDA is not usable here: no driver library, no device, or init failed.
    CudaUnavailable = 12,
    /// A CUDA call failed (the message carries the CUDA error name).
    CudaError = 13,
    /// A bug inside libgwtf was detected (an internal invariant failed).
    Internal = 14,
    /// The handle was poisoned by an earlier panic and can only be freed.
    Poisoned = 15,
    /// A panic inside libgwtf was caught at the C boundary.
    Panic = 16,
}

/// Every status, in numeric order (index = value).
const ALL_STATUSES: [gwtf_status; 17] = [
    gwtf_status::Ok,
    gwtf_status::InvalidArgument,
    gwtf_status::NullPointer,
    gwtf_status::BufferTooSmall,
    gwtf_status::UnsupportedVersion,
    gwtf_status::LimitExceeded,
    gwtf_status::OutOfMemory,
    gwtf_status::Timeout,
    gwtf_status::NotFound,
    gwtf_status::Io,
    gwtf_status::Protocol,
    gwtf_status::Closed,
    gwtf_status::CudaUnavailable,
    gwtf_status::CudaError,
    gwtf_status::Internal,
    gwtf_status::Poisoned,
    gwtf_status::Panic,
];

impl gwtf_status {
    /// Every status, in numeric order.
    pub fn all() -> &'static [gwtf_status] {
        &ALL_STATUSES
    }

    /// Checked conversion from the integer a C caller passes.
    pub fn from_i32(value: i32) -> Option<Self> {
        usize::try_from(value)
            .ok()
            .and_then(|i| ALL_STATUSES.get(i).copied())
    }

    /// Static NUL-terminated description (what `gwtf_status_str` returns).
    pub fn as_cstr(self) -> &'static std::ffi::CStr {
        match self {
            Self::Ok => c"ok",
            Self::InvalidArgument => c"invalid argument",
            Self::NullPointer => c"null pointer",
            Self::BufferTooSmall => c"buffer too small",
            Self::UnsupportedVersion => c"unsupported options version",
            Self::LimitExceeded => c"limit exceeded",
            Self::OutOfMemory => c"out of memory",
            Self::Timeout => c"timeout",
            Self::NotFound => c"not found",
            Self::Io => c"i/o error",
            Self::Protocol => c"protocol error",
            Self::Closed => c"closed",
            Self::CudaUnavailable => c"cuda unavailable",
            Self::CudaError => c"cuda error",
            Self::Internal => c"internal error",
            Self::Poisoned => c"handle poisoned by an earlier panic",
            Self::Panic => c"panic caught at the C boundary",
        }
    }

    /// The description as a Rust string.
    pub fn as_str(self) -> &'static str {
        self.as_cstr().to_str().unwrap_or("?")
    }
}

impl std::fmt::Display for gwtf_status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A static, NUL-terminated English description of a status code.
///
/// Any integer is accepted: a value this library does not know gives
/// "unknown status".
///
/// Ownership: the returned string is static; never free it.
///
/// Thread safety: may be called from any thread at any time.
///
/// Errors: none; never returns NULL.
#[no_mangle]
pub extern "C" fn gwtf_status_str(status: i32) -> *const c_char {
    match gwtf_status::from_i32(status) {
        Some(s) => s.as_cstr().as_ptr(),
        None => c"unknown status".as_ptr(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_dense_and_fixed() {
        for (i, s) in gwtf_status::all().iter().enumerate() {
            assert_eq!(*s as i32, i as i32);
            assert_eq!(gwtf_status::from_i32(i as i32), Some(*s));
        }
        assert_eq!(gwtf_status::from_i32(-1), None);
        assert_eq!(gwtf_status::from_i32(17), None);
        assert_eq!(gwtf_status::from_i32(i32::MIN), None);
        assert_eq!(gwtf_status::Panic as i32, 16);
    }

    #[test]
    fn status_str_never_null() {
        for v in [-5, 0, 3, 16, 17, i32::MAX] {
            let p = gwtf_status_str(v);
            assert!(!p.is_null());
        }
        let s = unsafe { std::ffi::CStr::from_ptr(gwtf_status_str(999)) };
        assert_eq!(s.to_str().unwrap(), "unknown status");
    }
}
