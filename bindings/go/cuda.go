package gwtf

/*
#include <stdlib.h>
#include <gwtf.h>
*/
import "C"

import (
	"runtime"
	"sync"
)

// CudaState is what a CUDA probe found (GWTF_CUDA_STATE_*).
type CudaState int32

// The probe states of gwtf.h.
const (
	CudaDisabled  CudaState = C.GWTF_CUDA_STATE_DISABLED
	CudaNoDriver  CudaState = C.GWTF_CUDA_STATE_NO_DRIVER
	CudaNoDevice  CudaState = C.GWTF_CUDA_STATE_NO_DEVICE
	CudaInitError CudaState = C.GWTF_CUDA_STATE_INIT_ERROR
	CudaReady     CudaState = C.GWTF_CUDA_STATE_READY
)

func (s CudaState) String() string {
	switch s {
	case CudaDisabled:
		return "disabled"
	case CudaNoDriver:
		return "no-driver"
	case CudaNoDevice:
		return "no-device"
	case CudaInitError:
		return "init-error"
	case CudaReady:
		return "ready"
	}
	return "unknown"
}

// ProbeDetail says how much a probe finds out (GWTF_CUDA_PROBE_DETAIL_*).
type ProbeDetail int32

// Probe details.
const (
	ProbeCountOnly ProbeDetail = C.GWTF_CUDA_PROBE_DETAIL_COUNT_ONLY
	ProbeDevices   ProbeDetail = C.GWTF_CUDA_PROBE_DETAIL_DEVICES
)

// CudaDevice describes one CUDA device.
type CudaDevice struct {
	Ordinal          uint32
	Name             string
	TotalMemoryBytes uint64
}

// CudaInfo is the result of ProbeCUDA. Close it when done.
type CudaInfo struct {
	mu  sync.Mutex
	ptr *C.gwtf_cuda_info
}

// ProbeCUDA finds out whether CUDA is usable here. "No driver" and "no device"
// are answers (see State), not errors; errors are for invalid arguments.
func ProbeCUDA(detail ProbeDetail) (*CudaInfo, error) {
	var opts C.gwtf_cuda_probe_options
	if err := check(C.gwtf_cuda_probe_options_init(&opts), nil); err != nil {
		return nil, err
	}
	opts.detail = C.int32_t(detail)
	var raw *C.gwtf_cuda_info
	var cerr *C.gwtf_error
	if err := check(C.gwtf_cuda_probe(&opts, &raw, &cerr), &cerr); err != nil {
		return nil, err
	}
	info := &CudaInfo{ptr: raw}
	runtime.SetFinalizer(info, (*CudaInfo).Close)
	return info, nil
}

// Close frees the probe result. It is safe to call more than once; methods
// called after Close return an error with StatusNullPointer.
func (i *CudaInfo) Close() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.ptr != nil {
		C.gwtf_cuda_info_free(i.ptr)
		i.ptr = nil
		runtime.SetFinalizer(i, nil)
	}
	return nil
}

// State returns what the probe found.
func (i *CudaInfo) State() (CudaState, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	var s C.int32_t
	var cerr *C.gwtf_error
	if err := check(C.gwtf_cuda_info_state(i.ptr, &s, &cerr), &cerr); err != nil {
		return 0, err
	}
	return CudaState(s), nil
}

// Describe returns the probe's one-paragraph summary.
func (i *CudaInfo) Describe() (string, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	var n C.size_t
	var cerr *C.gwtf_error
	st := C.gwtf_cuda_info_describe(i.ptr, nil, 0, &n, &cerr)
	if st != C.GWTF_STATUS_BUFFER_TOO_SMALL {
		return "", check(st, &cerr)
	}
	C.gwtf_error_free(cerr)
	cerr = nil
	buf := C.malloc(n + 1)
	defer C.free(buf)
	if err := check(C.gwtf_cuda_info_describe(i.ptr, (*C.char)(buf), n+1, nil, &cerr), &cerr); err != nil {
		return "", err
	}
	return C.GoStringN((*C.char)(buf), C.int(n)), nil
}

// Devices lists the devices found (empty unless State is CudaReady).
func (i *CudaInfo) Devices() ([]CudaDevice, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	var count C.uint32_t
	var cerr *C.gwtf_error
	if err := check(C.gwtf_cuda_info_device_count(i.ptr, &count, &cerr), &cerr); err != nil {
		return nil, err
	}
	devices := make([]CudaDevice, 0, int(count))
	buf := C.malloc(256)
	defer C.free(buf)
	for k := C.uint32_t(0); k < count; k++ {
		var mem C.uint64_t
		var n C.size_t
		if err := check(C.gwtf_cuda_info_device_name(i.ptr, k, (*C.char)(buf), 256, &n, &mem, &cerr), &cerr); err != nil {
			return nil, err
		}
		devices = append(devices, CudaDevice{
			Ordinal:          uint32(k),
			Name:             C.GoStringN((*C.char)(buf), C.int(n)),
			TotalMemoryBytes: uint64(mem),
		})
	}
	return devices, nil
}
