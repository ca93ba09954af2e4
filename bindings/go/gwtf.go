// Package gwtf is the Go binding of libgwtf (Go With The Flow: churn-tolerant
// decentralized training), through cgo and the library's stable C ABI.
//
// Conventions: every failure is an error value of type *Error carrying the
// library's Status; objects are Go values with a Close method (a finalizer
// frees forgotten ones, but Close early: the memory lives in C). No Go pointer
// is ever kept by the library: buffers are passed only for the duration of a
// call.
//
// Build: the package links libgwtf through pkg-config (`gwtf.pc`, installed by
// scripts/install, or the one c-examples/Makefile writes for a checkout).
package gwtf

/*
#cgo pkg-config: gwtf
#include <stdlib.h>
#include <gwtf.h>
*/
import "C"

import "fmt"

// Status is a libgwtf status code (GWTF_STATUS_*). Values never change.
type Status int32

// The status codes of gwtf.h.
const (
	StatusOK                 Status = C.GWTF_STATUS_OK
	StatusInvalidArgument    Status = C.GWTF_STATUS_INVALID_ARGUMENT
	StatusNullPointer        Status = C.GWTF_STATUS_NULL_POINTER
	StatusBufferTooSmall     Status = C.GWTF_STATUS_BUFFER_TOO_SMALL
	StatusUnsupportedVersion Status = C.GWTF_STATUS_UNSUPPORTED_VERSION
	StatusLimitExceeded      Status = C.GWTF_STATUS_LIMIT_EXCEEDED
	StatusOutOfMemory        Status = C.GWTF_STATUS_OUT_OF_MEMORY
	StatusTimeout            Status = C.GWTF_STATUS_TIMEOUT
	StatusNotFound           Status = C.GWTF_STATUS_NOT_FOUND
	StatusIO                 Status = C.GWTF_STATUS_IO
	StatusProtocol           Status = C.GWTF_STATUS_PROTOCOL
	StatusClosed             Status = C.GWTF_STATUS_CLOSED
	StatusCudaUnavailable    Status = C.GWTF_STATUS_CUDA_UNAVAILABLE
	StatusCudaError          Status = C.GWTF_STATUS_CUDA_ERROR
	StatusInternal           Status = C.GWTF_STATUS_INTERNAL
	StatusPoisoned           Status = C.GWTF_STATUS_POISONED
	StatusPanic              Status = C.GWTF_STATUS_PANIC
)

// String is the library's static description of the status.
func (s Status) String() string {
	return C.GoString(C.gwtf_status_str(C.int32_t(s)))
}

// Error is a failed libgwtf call: its status and the library's message.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return "gwtf: " + e.Message }

// Is makes errors.Is(err, &gwtf.Error{Status: s}) match on the status alone.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Status == e.Status
}

// StatusOf returns the Status carried by err, StatusOK for nil, and
// StatusInternal for an error that did not come from libgwtf.
func StatusOf(err error) Status {
	if err == nil {
		return StatusOK
	}
	if e, ok := err.(*Error); ok {
		return e.Status
	}
	return StatusInternal
}

// check turns a status and an optional C error object into a Go error, freeing
// the C object. The error is passed by address: Go leaves unspecified whether
// a plain variable argument is read before or after a call in the same
// argument list, so check(f(&cerr), &cerr) could see the old value.
func check(st C.gwtf_status, errp **C.gwtf_error) error {
	var cerr *C.gwtf_error
	if errp != nil {
		cerr, *errp = *errp, nil
	}
	if st == C.GWTF_STATUS_OK {
		if cerr != nil {
			C.gwtf_error_free(cerr)
		}
		return nil
	}
	e := &Error{Status: Status(st)}
	if cerr != nil {
		e.Message = C.GoString(C.gwtf_error_message(cerr))
		C.gwtf_error_free(cerr)
	} else {
		e.Message = Status(st).String()
	}
	return e
}

// HeaderABIVersion is the ABI version of the gwtf.h this package was built with.
const HeaderABIVersion = uint32(C.GWTF_ABI_VERSION)

// Version returns the loaded library's version, "MAJOR.MINOR.PATCH".
func Version() string { return C.GoString(C.gwtf_version()) }

// ABIVersion returns the loaded library's ABI version.
func ABIVersion() uint32 { return uint32(C.gwtf_abi_version()) }

// CheckABI reports an error when the loaded library's ABI differs from the
// header this package was compiled against.
func CheckABI() error {
	if got := ABIVersion(); got != HeaderABIVersion {
		return fmt.Errorf("gwtf: loaded libgwtf has ABI %d, built against %d", got, HeaderABIVersion)
	}
	return nil
}
