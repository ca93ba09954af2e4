package gwtf

import (
	"errors"
	"math"
	"testing"
)

// Trains llama-tiny cut into three stages, as three swarm nodes would, and
// checks that the loss falls.
func TestStagesTrainAPipeline(t *testing.T) {
	const S, B, T = 3, 4, 16
	stages := make([]*Stage, S)
	for i := range stages {
		s, err := NewStage("llama-tiny", S, uint32(i), 1)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		stages[i] = s
	}
	if !stages[0].Info().TakesTokens || !stages[S-1].Info().ComputesLoss || stages[1].Info().NumParams == 0 {
		t.Fatalf("stage infos: %+v %+v", stages[0].Info(), stages[S-1].Info())
	}
	tokens := make([]uint32, B*T)
	targets := make([]uint32, B*T)
	for i := range tokens {
		tokens[i] = uint32(i * 5 % 64)
		targets[i] = uint32((i + 1) * 5 % 64)
	}
	opt := DefaultAdamW()
	opt.LR = 1e-2
	var first, loss float32
	for step := uint64(0); step < 25; step++ {
		h0, err := stages[0].ForwardTokens(step, B, T, tokens)
		if err != nil {
			t.Fatal(err)
		}
		h1, err := stages[1].Forward(step, B, T, h0)
		if err != nil {
			t.Fatal(err)
		}
		if loss, err = stages[2].ForwardLoss(step, B, T, h1, targets); err != nil {
			t.Fatal(err)
		}
		g1, err := stages[2].Backward(step, nil, len(h1))
		if err != nil {
			t.Fatal(err)
		}
		g0, err := stages[1].Backward(step, g1, len(h0))
		if err != nil {
			t.Fatal(err)
		}
		if g, err := stages[0].Backward(step, g0, 0); err != nil || g != nil {
			t.Fatalf("first stage backward: %v %v", g, err)
		}
		for _, s := range stages {
			if err := s.Step(opt); err != nil {
				t.Fatal(err)
			}
		}
		if step == 0 {
			first = loss
		}
	}
	if math.IsNaN(float64(loss)) || loss > 0.5*first {
		t.Fatalf("loss did not fall by half: %v -> %v", first, loss)
	}
}

func TestStageErrorsAndParameterTransfer(t *testing.T) {
	a, err := NewStage("llama-tiny", 2, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := NewStage("llama-tiny", 2, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := NewStage("no-such-model", 2, 0, 1); StatusOf(err) != StatusInvalidArgument {
		t.Fatalf("unknown preset: %v", err)
	}
	if _, err := NewStage("llama-tiny", 2, 2, 1); err == nil {
		t.Fatal("stage index 2 of 2 accepted")
	}
	// Wrong input length: refused with a status, nothing stored.
	if _, err := a.ForwardLoss(7, 1, 4, make([]float32, 3), make([]uint32, 4)); StatusOf(err) != StatusInvalidArgument {
		t.Fatalf("short input: %v", err)
	}
	if found, err := a.Discard(7); err != nil || found {
		t.Fatalf("discard after a refused forward: %v %v", found, err)
	}
	if _, err := a.Backward(99, nil, 0); !errors.Is(err, &Error{Status: StatusNotFound}) {
		t.Fatalf("backward without forward: %v", err)
	}
	// A joiner copies a live member's parameters.
	pa, err := a.ExportParams()
	if err != nil || uint64(len(pa)) != a.Info().NumParams {
		t.Fatalf("export: %d %v", len(pa), err)
	}
	if err := b.ImportParams(pa); err != nil {
		t.Fatal(err)
	}
	pb, _ := b.ExportParams()
	for i := range pa {
		if pa[i] != pb[i] {
			t.Fatalf("parameter %d differs after import", i)
		}
	}
	if err := b.ImportParams(pa[:10]); StatusOf(err) != StatusInvalidArgument {
		t.Fatalf("short import: %v", err)
	}
	a.Close()
	if _, err := a.ExportParams(); StatusOf(err) != StatusClosed {
		t.Fatalf("closed stage: %v", err)
	}
}
