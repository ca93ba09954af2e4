package gwtf

/*
#include <stdlib.h>
#include <gwtf.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// StageInfo describes one pipeline stage of a reference model.
type StageInfo struct {
	Index        uint32 // 0-based position in the pipeline
	NumStages    uint32 // stages the model is cut into
	TakesTokens  bool   // the first stage: its input is token ids
	ComputesLoss bool   // the last stage: it needs targets and yields a loss
	DModel       uint32 // width of the activations between stages
	VocabSize    uint32 // token ids must be below it
	MaxSeq       uint32 // longest sequence a microbatch may have
	NumParams    uint64 // parameters of this stage
}

// AdamW holds the optimizer's hyper-parameters for Stage.Step.
type AdamW struct {
	LR, Beta1, Beta2, Eps, WeightDecay float32
}

// DefaultAdamW returns the library's defaults (gwtf_adamw_options_init).
func DefaultAdamW() AdamW {
	var o C.gwtf_adamw_options
	C.gwtf_adamw_options_init(&o)
	return AdamW{LR: float32(o.lr), Beta1: float32(o.beta1), Beta2: float32(o.beta2),
		Eps: float32(o.eps), WeightDecay: float32(o.weight_decay)}
}

// Stage is one pipeline stage of libgwtf's reference models (gwtf_stage):
// forward and backward per microbatch, gradients accumulated until Step.
// Calls on one Stage are serialised; Close it when done.
type Stage struct {
	mu   sync.Mutex
	ptr  *C.gwtf_stage
	info StageInfo
}

// NewStage builds stage index (0-based) of a model preset ("gpt-tiny",
// "llama-tiny", ...) cut into numStages stages, initialised from seed (every
// stage of one model must use the same seed).
func NewStage(preset string, numStages, index uint32, seed uint64) (*Stage, error) {
	cname := C.CString(preset)
	defer C.free(unsafe.Pointer(cname))
	var raw *C.gwtf_stage
	var cerr *C.gwtf_error
	if err := check(C.gwtf_stage_new(cname, C.uint32_t(numStages), C.uint32_t(index), C.uint64_t(seed), &raw, &cerr), &cerr); err != nil {
		return nil, err
	}
	var info C.gwtf_stage_info
	C.gwtf_stage_info_init(&info)
	if err := check(C.gwtf_stage_get_info(raw, &info, &cerr), &cerr); err != nil {
		C.gwtf_stage_free(raw)
		return nil, err
	}
	s := &Stage{ptr: raw, info: StageInfo{
		Index: uint32(info.index), NumStages: uint32(info.num_stages),
		TakesTokens: info.takes_tokens != 0, ComputesLoss: info.computes_loss != 0,
		DModel: uint32(info.d_model), VocabSize: uint32(info.vocab_size),
		MaxSeq: uint32(info.max_seq), NumParams: uint64(info.num_params),
	}}
	runtime.SetFinalizer(s, (*Stage).Close)
	return s, nil
}

// Info describes the stage.
func (s *Stage) Info() StageInfo { return s.info }

// Close frees the stage; it is safe to call more than once.
func (s *Stage) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr != nil {
		C.gwtf_stage_free(s.ptr)
		s.ptr = nil
		runtime.SetFinalizer(s, nil)
	}
	return nil
}

// call runs one C call under the lock and converts its error.
func (s *Stage) call(fn func(p *C.gwtf_stage, cerr **C.gwtf_error) C.gwtf_status) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return &Error{Status: StatusClosed, Message: "stage is closed"}
	}
	var cerr *C.gwtf_error
	st := fn(s.ptr, &cerr)
	return check(st, &cerr)
}

func u32ptr(v []uint32) *C.uint32_t {
	if len(v) == 0 {
		return nil
	}
	return (*C.uint32_t)(unsafe.Pointer(&v[0]))
}

func f32ptr(v []float32) *C.float {
	if len(v) == 0 {
		return nil
	}
	return (*C.float)(unsafe.Pointer(&v[0]))
}

// ForwardTokens runs the first stage on batch*seq token ids and returns its
// activations (batch*seq*DModel floats).
func (s *Stage) ForwardTokens(microbatch uint64, batch, seq uint32, tokens []uint32) ([]float32, error) {
	out := make([]float32, int(batch)*int(seq)*int(s.info.DModel))
	err := s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_forward(p, C.uint64_t(microbatch), C.uint32_t(batch), C.uint32_t(seq),
			u32ptr(tokens), nil, C.size_t(len(tokens)), nil, 0, f32ptr(out), C.size_t(len(out)), nil, nil, e)
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Forward runs a middle stage on the previous stage's activations.
func (s *Stage) Forward(microbatch uint64, batch, seq uint32, hidden []float32) ([]float32, error) {
	out := make([]float32, int(batch)*int(seq)*int(s.info.DModel))
	err := s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_forward(p, C.uint64_t(microbatch), C.uint32_t(batch), C.uint32_t(seq),
			nil, f32ptr(hidden), C.size_t(len(hidden)), nil, 0, f32ptr(out), C.size_t(len(out)), nil, nil, e)
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ForwardLoss runs the last stage on the previous stage's activations and
// returns the mean loss against targets (batch*seq token ids).
func (s *Stage) ForwardLoss(microbatch uint64, batch, seq uint32, hidden []float32, targets []uint32) (float32, error) {
	var loss C.float
	err := s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_forward(p, C.uint64_t(microbatch), C.uint32_t(batch), C.uint32_t(seq),
			nil, f32ptr(hidden), C.size_t(len(hidden)), u32ptr(targets), C.size_t(len(targets)), nil, 0, nil, &loss, e)
	})
	return float32(loss), err
}

// Backward runs the backward of a microbatch whose forward this stage ran.
// gradOutput is nil for the last stage; the result is the gradient of the
// stage's input (nil for the first stage). Parameter gradients accumulate
// until Step.
func (s *Stage) Backward(microbatch uint64, gradOutput []float32, inputLen int) ([]float32, error) {
	var gradIn []float32
	if !s.info.TakesTokens {
		gradIn = make([]float32, inputLen)
	}
	err := s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_backward(p, C.uint64_t(microbatch), f32ptr(gradOutput), C.size_t(len(gradOutput)),
			f32ptr(gradIn), C.size_t(len(gradIn)), nil, e)
	})
	if err != nil {
		return nil, err
	}
	return gradIn, nil
}

// Discard drops the stored forward of a microbatch whose result will not be
// used, and tells whether there was one.
func (s *Stage) Discard(microbatch uint64) (bool, error) {
	var found C.bool
	err := s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_discard(p, C.uint64_t(microbatch), &found, e)
	})
	return bool(found), err
}

// Step applies one AdamW step with the mean of the accumulated gradients.
func (s *Stage) Step(opt AdamW) error {
	var o C.gwtf_adamw_options
	C.gwtf_adamw_options_init(&o)
	o.lr, o.beta1, o.beta2 = C.float(opt.LR), C.float(opt.Beta1), C.float(opt.Beta2)
	o.eps, o.weight_decay = C.float(opt.Eps), C.float(opt.WeightDecay)
	return s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_step(p, &o, e)
	})
}

// ExportParams copies the stage's parameters (f32, in the stage's order).
func (s *Stage) ExportParams() ([]float32, error) {
	buf := make([]float32, s.info.NumParams)
	err := s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_export_params(p, f32ptr(buf), C.size_t(len(buf)), nil, e)
	})
	if err != nil {
		return nil, err
	}
	return buf, nil
}

// ImportParams replaces the stage's parameters with a same-stage peer's.
func (s *Stage) ImportParams(params []float32) error {
	return s.call(func(p *C.gwtf_stage, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_stage_import_params(p, f32ptr(params), C.size_t(len(params)), e)
	})
}
