package gwtf

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
)

func TestVersionAndABI(t *testing.T) {
	v := Version()
	if len(strings.Split(v, ".")) != 3 {
		t.Fatalf("version %q is not MAJOR.MINOR.PATCH", v)
	}
	if err := CheckABI(); err != nil {
		t.Fatal(err)
	}
	if want := os.Getenv("GWTF_EXPECT_VERSION"); want != "" && v != want {
		t.Fatalf("version %q, want %q", v, want)
	}
}

func TestStatusStrings(t *testing.T) {
	if StatusOK.String() != "ok" {
		t.Fatalf("StatusOK = %q", StatusOK.String())
	}
	if Status(12345).String() != "unknown status" {
		t.Fatalf("unknown status = %q", Status(12345).String())
	}
	if int32(StatusPanic) != 16 {
		t.Fatalf("GWTF_STATUS_PANIC renumbered: %d", StatusPanic)
	}
}

func TestProbeIsConsistent(t *testing.T) {
	info, err := ProbeCUDA(ProbeDevices)
	if err != nil {
		t.Fatal(err)
	}
	defer info.Close()
	state, err := info.State()
	if err != nil {
		t.Fatal(err)
	}
	devices, err := info.Devices()
	if err != nil {
		t.Fatal(err)
	}
	text, err := info.Describe()
	if err != nil || text == "" {
		t.Fatalf("describe: %q, %v", text, err)
	}
	t.Logf("state %v, %d device(s): %s", state, len(devices), text)
	if (state == CudaReady) != (len(devices) > 0) {
		t.Fatalf("state %v with %d devices", state, len(devices))
	}
	// The test command runs this package a second time with a stand-in driver.
	if want := os.Getenv("GWTF_EXPECT_CUDA_STATE"); want != "" {
		n, _ := strconv.Atoi(want)
		if state != CudaState(n) {
			t.Fatalf("state %v (%d), want %s", state, state, want)
		}
		if state == CudaNoDevice && !strings.Contains(text, "CUDA_ERROR_NO_DEVICE") {
			t.Fatalf("no CUDA error name in %q", text)
		}
	}
}

func TestInvalidDetailIsAnError(t *testing.T) {
	info, err := ProbeCUDA(ProbeDetail(99))
	if info != nil || err == nil {
		t.Fatalf("want an error, got %v, %v", info, err)
	}
	if StatusOf(err) != StatusInvalidArgument {
		t.Fatalf("status %v", StatusOf(err))
	}
	if !errors.Is(err, &Error{Status: StatusInvalidArgument}) {
		t.Fatal("errors.Is does not match on status")
	}
	var gerr *Error
	if !errors.As(err, &gerr) || !strings.Contains(gerr.Message, "99 is not a valid gwtf_cuda_probe_detail") {
		t.Fatalf("message: %v", err)
	}
}

func TestCloseTwiceAndUseAfterClose(t *testing.T) {
	info, err := ProbeCUDA(ProbeCountOnly)
	if err != nil {
		t.Fatal(err)
	}
	if err := info.Close(); err != nil {
		t.Fatal(err)
	}
	if err := info.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := info.State(); StatusOf(err) != StatusNullPointer {
		t.Fatalf("use after Close: %v", err)
	}
}
