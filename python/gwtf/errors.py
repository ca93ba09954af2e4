"""Exceptions: one class per `gwtf_status`, each a `GwtfError` carrying
the status code and the library's message, and where Python has a matching
built-in exception, also that (so `except TimeoutError` catches a timeout).
"""
from ._ffi import ffi, lib


class GwtfError(Exception):
    """A libgwtf call failed: `status` (the `GWTF_STATUS_*` code) and
    `message` (the library's description, or ours for a Python-side check)."""

    status: int = lib.GWTF_STATUS_INTERNAL

    def __init__(self, message: str, status: int = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __str__(self):
        return self.message


class InvalidArgument(GwtfError, ValueError):
    status = lib.GWTF_STATUS_INVALID_ARGUMENT


class NullPointer(GwtfError, ValueError):
    status = lib.GWTF_STATUS_NULL_POINTER


class BufferTooSmall(GwtfError):
    status = lib.GWTF_STATUS_BUFFER_TOO_SMALL


class UnsupportedVersion(GwtfError):
    status = lib.GWTF_STATUS_UNSUPPORTED_VERSION


class LimitExceeded(GwtfError, ValueError):
    status = lib.GWTF_STATUS_LIMIT_EXCEEDED


class OutOfMemory(GwtfError, MemoryError):
    status = lib.GWTF_STATUS_OUT_OF_MEMORY


class Timeout(GwtfError, TimeoutError):
    status = lib.GWTF_STATUS_TIMEOUT


class NotFound(GwtfError, LookupError):
    status = lib.GWTF_STATUS_NOT_FOUND


class IoError(GwtfError):
    status = lib.GWTF_STATUS_IO


class ProtocolError(GwtfError):
    status = lib.GWTF_STATUS_PROTOCOL


class Closed(GwtfError):
    status = lib.GWTF_STATUS_CLOSED


class CudaUnavailable(GwtfError):
    status = lib.GWTF_STATUS_CUDA_UNAVAILABLE


class CudaError(GwtfError):
    status = lib.GWTF_STATUS_CUDA_ERROR


class Internal(GwtfError):
    status = lib.GWTF_STATUS_INTERNAL


class Poisoned(GwtfError):
    status = lib.GWTF_STATUS_POISONED


class Panic(GwtfError):
    status = lib.GWTF_STATUS_PANIC


_BY_STATUS = {
    c.status: c
    for c in (
        InvalidArgument, NullPointer, BufferTooSmall, UnsupportedVersion, LimitExceeded,
        OutOfMemory, Timeout, NotFound, IoError, ProtocolError, Closed, CudaUnavailable,
        CudaError, Internal, Poisoned, Panic,
    )
}


def error_of(status: int, message: str) -> GwtfError:
    """The exception for `status` (an unknown code, from a newer library,
    is a plain `GwtfError`)."""
    cls = _BY_STATUS.get(status)
    return cls(message) if cls else GwtfError(message, status)


class ErrorSlot:
    """A `gwtf_error **` for one call; `check` raises what it reports."""

    __slots__ = ("ptr",)

    def __init__(self):
        self.ptr = ffi.new("gwtf_error **")

    def check(self, status: int, what: str) -> None:
        if status == lib.GWTF_STATUS_OK:
            return
        err = self.ptr[0]
        if err != ffi.NULL:
            message = ffi.string(lib.gwtf_error_message(err)).decode("utf-8", "replace")
            lib.gwtf_error_free(err)
            self.ptr[0] = ffi.NULL
        else:
            message = "no message"
        raise error_of(status, f"{what}: {message}")


def call(what: str, fn, *args) -> None:
    """Calls `fn(*args, err)` and raises the error it reports."""
    slot = ErrorSlot()
    slot.check(fn(*args, slot.ptr), what)
