package gwtf

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand"
	"net"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// A toy model in Go: holders embed a token (V x D table) and score it with a
// linear head (D x V, softmax cross-entropy); relays of stage 1 apply a
// linear layer (D x D). Plain SGD.
const (
	toyV, toyD, toyB = 8, 8, 8
	toyLR            = 0.5
)

type toyTrainer struct {
	stage   uint32
	params  [][]float32 // holder: [E, H]; relay: [W]
	tokens  map[Microbatch][]int
	targets map[Microbatch][]int
	inputs  map[Microbatch][]float32 // relay: forward inputs
	grads   map[Microbatch][][]float32
	applied int64 // last update applied, -1: none
	before  [][]float32
}

func newToy(stage uint32) *toyTrainer {
	r := rand.New(rand.NewSource(int64(100 + stage)))
	mk := func(n int, scale float32) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = (2*r.Float32() - 1) * scale
		}
		return v
	}
	t := &toyTrainer{stage: stage, tokens: map[Microbatch][]int{}, targets: map[Microbatch][]int{},
		inputs: map[Microbatch][]float32{}, grads: map[Microbatch][][]float32{}, applied: -1}
	if stage == 0 {
		t.params = [][]float32{mk(toyV*toyD, 1), mk(toyD*toyV, 0.3)}
	} else {
		t.params = [][]float32{mk(toyD*toyD, 0.3)}
	}
	return t
}

func f32s(b []byte) []float32 {
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4)
}

func (t *toyTrainer) digest() [32]byte {
	h := sha256.New()
	for _, p := range t.params {
		binary.Write(h, binary.LittleEndian, p)
	}
	var d [32]byte
	copy(d[:], h.Sum(nil))
	return d
}

func (t *toyTrainer) keep(mb Microbatch, piece int, g []float32) {
	if t.grads[mb] == nil {
		t.grads[mb] = make([][]float32, len(t.params))
	}
	t.grads[mb][piece] = g
}

func (t *toyTrainer) tensor(p *Peer, task *Task, v []float32) *OutFrame {
	o, err := p.Alloc(int(task.OutputBytes), 5*time.Second)
	if err != nil {
		panic(err)
	}
	copy(f32s(o.Data), v)
	return o
}

// run answers one task; returns an error for a refused answer.
func (t *toyTrainer) run(p *Peer, task *Task) error {
	params := t.params
	if task.Kind < TaskGradient && t.applied >= 0 && int64(task.Mb.Iteration) <= t.applied {
		if t.before == nil || int64(task.Mb.Iteration) < t.applied {
			return p.TaskFailed(task.ID, "its weights are gone")
		}
		params = t.before // a microbatch redone after its update
	}
	mb := task.Mb
	switch task.Kind {
	case TaskEmbed:
		r := rand.New(rand.NewSource(int64(mb.Holder)<<40 | int64(mb.Iteration)<<20 | int64(mb.Index)))
		x, y := make([]int, toyB), make([]int, toyB)
		h := make([]float32, toyB*toyD)
		for b := range x {
			x[b] = r.Intn(toyV)
			y[b] = (3*x[b] + 1) % toyV
			copy(h[b*toyD:(b+1)*toyD], params[0][x[b]*toyD:(x[b]+1)*toyD])
		}
		t.tokens[mb], t.targets[mb] = x, y
		return p.TaskDone(task.ID, t.tensor(p, task, h))
	case TaskLoss:
		h := f32s(task.Input)
		H := params[1]
		gH, gh := make([]float32, len(H)), make([]float32, toyB*toyD)
		var loss float64
		for b := 0; b < toyB; b++ {
			z := make([]float64, toyV)
			mx := math.Inf(-1)
			for v := range z {
				for j := 0; j < toyD; j++ {
					z[v] += float64(h[b*toyD+j] * H[j*toyV+v])
				}
				mx = math.Max(mx, z[v])
			}
			s := 0.0
			for v := range z {
				z[v] = math.Exp(z[v] - mx)
				s += z[v]
			}
			y := t.targets[mb][b]
			loss -= math.Log(z[y] / s)
			for v := range z {
				g := float32(z[v] / s / toyB)
				if v == y {
					g -= 1.0 / toyB
				}
				for j := 0; j < toyD; j++ {
					gH[j*toyV+v] += h[b*toyD+j] * g
					gh[b*toyD+j] += g * H[j*toyV+v]
				}
			}
		}
		t.keep(mb, 1, gH)
		return p.TaskDoneLoss(task.ID, float32(loss/toyB), t.tensor(p, task, gh))
	case TaskEmbedBackward:
		g := f32s(task.Input)
		gE := make([]float32, toyV*toyD)
		for b, x := range t.tokens[mb] {
			for j := 0; j < toyD; j++ {
				gE[x*toyD+j] += g[b*toyD+j]
			}
		}
		t.keep(mb, 0, gE)
		return p.TaskDone(task.ID, nil)
	case TaskForward:
		x := append([]float32(nil), f32s(task.Input)...)
		t.inputs[mb] = x
		y := make([]float32, toyB*toyD)
		for b := 0; b < toyB; b++ {
			for o := 0; o < toyD; o++ {
				for i := 0; i < toyD; i++ {
					y[b*toyD+o] += x[b*toyD+i] * params[0][i*toyD+o]
				}
			}
		}
		return p.TaskDone(task.ID, t.tensor(p, task, y))
	case TaskBackward:
		g, x := f32s(task.Input), t.inputs[mb]
		if x == nil {
			return p.TaskFailed(task.ID, "no forward kept")
		}
		gW, gx := make([]float32, toyD*toyD), make([]float32, toyB*toyD)
		for b := 0; b < toyB; b++ {
			for o := 0; o < toyD; o++ {
				for i := 0; i < toyD; i++ {
					gW[i*toyD+o] += x[b*toyD+i] * g[b*toyD+o]
					gx[b*toyD+i] += g[b*toyD+o] * params[0][i*toyD+o]
				}
			}
		}
		delete(t.inputs, mb)
		t.keep(mb, 0, gW)
		return p.TaskDone(task.ID, t.tensor(p, task, gx))
	case TaskGradient:
		granted := append([]Microbatch(nil), task.Granted...)
		sort.Slice(granted, func(i, j int) bool {
			a, b := granted[i], granted[j]
			if a.Holder != b.Holder {
				return a.Holder < b.Holder
			}
			if a.Iteration != b.Iteration {
				return a.Iteration < b.Iteration
			}
			return a.Index < b.Index
		})
		// A member granted nothing still takes part: its sum is zeros.
		n := 0
		for _, piece := range t.params {
			n += len(piece)
		}
		sum := make([]float32, n)
		for _, m := range granted {
			g := t.grads[m]
			if g == nil {
				return p.TaskFailed(task.ID, "no gradient kept for a granted microbatch")
			}
			var flat []float32
			for _, piece := range g {
				flat = append(flat, piece...)
			}
			for i := range flat {
				sum[i] += flat[i]
			}
		}
		return p.TaskDoneGradient(task.ID, sum, t.digest())
	case TaskApply:
		t.before = make([][]float32, len(t.params))
		off := 0
		for i, piece := range t.params {
			t.before[i] = append([]float32(nil), piece...)
			for j := range piece {
				piece[j] -= toyLR * task.Mean[off+j]
			}
			off += len(piece)
		}
		t.applied = int64(task.Iteration)
		return p.TaskDoneWeights(task.ID, t.digest())
	case TaskExportState:
		// The parameters, then those from before the last update when
		// known (a joiner may have to run a microbatch of its iteration).
		var all []float32
		for _, piece := range t.params {
			all = append(all, piece...)
		}
		if t.applied >= 0 && t.before != nil {
			for _, piece := range t.before {
				all = append(all, piece...)
			}
		}
		o, err := p.Alloc(4*len(all), 5*time.Second)
		if err != nil {
			return err
		}
		copy(f32s(o.Data), all)
		return p.TaskDone(task.ID, o)
	case TaskInitState:
		// The stage's last node died: start it again from the initial
		// weights; a microbatch of the iteration they stand for runs on
		// them too (an update copies them before it changes them).
		*t = *newToy(task.Stage)
		if task.HasIteration {
			t.applied, t.before = int64(task.Iteration), t.params
		}
		return p.TaskDoneWeights(task.ID, t.digest())
	case TaskImportState:
		in := f32s(task.Input)
		n := 0
		for _, piece := range t.params {
			n += len(piece)
		}
		if len(in) != n && (len(in) != 2*n || !task.HasIteration) {
			return p.TaskFailed(task.ID, fmt.Sprintf("a state of %d floats", len(in)))
		}
		off := 0
		for _, piece := range t.params {
			copy(piece, in[off:off+len(piece)])
			off += len(piece)
		}
		t.applied, t.before = -1, nil
		if task.HasIteration {
			t.applied = int64(task.Iteration)
		}
		if len(in) == 2*n {
			for _, piece := range t.params {
				b := append([]float32(nil), in[off:off+len(piece)]...)
				t.before = append(t.before, b)
				off += len(piece)
			}
		}
		return p.TaskDoneWeights(task.ID, t.digest())
	case TaskForget:
		for m := range t.grads {
			if m.Iteration < task.Iteration {
				delete(t.grads, m)
			}
		}
		return p.TaskDone(task.ID, nil)
	}
	return p.TaskFailed(task.ID, "unknown task")
}

// freePort is a free port on a loopback address of its own (127.a.b.c at
// random), bound and released for a peer to bind next: not 127.0.0.1, whose
// ports the kernel also gives to outgoing connections in the meantime.
func freePort(t *testing.T) string {
	r := rand.New(rand.NewSource(time.Now().UnixNano()))
	ip := fmt.Sprintf("127.%d.%d.%d", 1+r.Intn(250), 1+r.Intn(250), 1+r.Intn(250))
	l, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// A data holder and two relays, each a Go Peer with the toy trainer, train
// together over loopback: the loss falls, the relays' replicas agree after
// every update, and a wrong answer is an error with its status.
func TestGoRelaysTakePartInASwarm(t *testing.T) {
	const iterations = 20
	addrs := []string{freePort(t), freePort(t), freePort(t)}
	// Each member's id follows from its key file, created here.
	keys, ids := make([]string, 3), make([]uint32, 3)
	for i := range keys {
		keys[i] = filepath.Join(t.TempDir(), "node.key")
		id, err := NodeKeyID(keys[i])
		if err != nil {
			t.Fatal(err)
		}
		if again, err := NodeKeyID(keys[i]); err != nil || again != id {
			t.Fatalf("the key file's id changed: %d then %d (%v)", id, again, err)
		}
		ids[i] = id
	}
	boot := []Contact{{ids[0], 0, addrs[0]}, {ids[1], 1, addrs[1]}, {ids[2], 1, addrs[2]}}
	act := uint64(4 * toyB * toyD)
	opts := func(i int) PeerOptions {
		role, stage, every := RoleRelay, int32(1), uint32(0)
		if i == 0 {
			role, stage, every = RoleHolder, 0, 5
		}
		return PeerOptions{Role: role, Stage: stage, NodeKeyFile: keys[i], Listen: addrs[i],
			KeepStatesEvery: every, SaveEvery: every,
			Bootstrap: boot, SwarmKey: []byte("0123456789abcdef-go-peer-test"),
			MemoryBudgetBytes: 16 << 20, RelayStages: 1, MicrobatchesPerIteration: 4,
			LogToStderr:     os.Getenv("GWTF_LOG") != "",
			ActivationBytes: []uint64{act, act}, StateBytes: []uint64{0, 8 * toyD * toyD}}
	}
	if _, err := NewPeer(PeerOptions{RelayStages: 1, ActivationBytes: []uint64{act}}); StatusOf(err) != StatusInvalidArgument {
		t.Fatalf("short sizes: %v", err)
	}
	bad := opts(1)
	bad.Stage = 5
	if _, err := NewPeer(bad); !errors.Is(err, &Error{Status: StatusInvalidArgument}) {
		t.Fatalf("stage 5 of 1: %v", err)
	}
	// An id that is not its key's is refused (unless chosen, in a test swarm).
	other := opts(1)
	other.NodeID = ids[2]
	if _, err := NewPeer(other); !errors.Is(err, &Error{Status: StatusInvalidArgument}) {
		t.Fatalf("another member's id: %v", err)
	}
	// Relays neither keep copies nor write checkpoints.
	relaySaving := opts(1)
	relaySaving.SaveEvery = 5
	if _, err := NewPeer(relaySaving); !errors.Is(err, &Error{Status: StatusInvalidArgument}) {
		t.Fatalf("a relay with SaveEvery: %v", err)
	}
	// checkpoint states by iteration and stage, as the holder got them
	checkpoints := map[uint32]map[uint32][]byte{}
	var checkpointErr error

	var mu sync.Mutex
	losses := map[uint32]float32{}
	digests := map[uint32]map[uint32][32]byte{} // iteration -> node -> digest
	refusedTwice := false
	trail := map[uint32][]string{} // node -> what it was given, kept for a failure report
	note := func(id uint32, task *Task) {
		mu.Lock()
		defer mu.Unlock()
		if len(trail[id]) < 400 {
			trail[id] = append(trail[id], fmt.Sprintf("%d/%d.%d.%d %s", task.Kind, task.Mb.Holder,
				task.Mb.Iteration, task.Mb.Index, task.Message))
		}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	peers := make([]*Peer, 3)
	for i := range peers {
		p, err := NewPeer(opts(i))
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		peers[i] = p
	}
	for i, p := range peers {
		id := uint32(i + 1)
		tr := newToy(boot[i].Stage)
		wg.Add(1)
		go func(p *Peer) {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				task, err := p.NextTask(50 * time.Millisecond)
				if StatusOf(err) == StatusTimeout {
					continue
				}
				if err != nil {
					t.Errorf("node %d: %v", id, err)
					return
				}
				note(id, task)
				switch task.Kind {
				case EventIteration:
					mu.Lock()
					losses[task.Iteration] = task.Loss
					mu.Unlock()
				case EventApplied:
					mu.Lock()
					if digests[task.Iteration] == nil {
						digests[task.Iteration] = map[uint32][32]byte{}
					}
					digests[task.Iteration][id] = task.Weights
					mu.Unlock()
				case EventError:
					t.Errorf("node %d: %s", id, task.Message)
				case EventCheckpoint:
					states := map[uint32][]byte{}
					for s := uint32(0); s < uint32(task.Microbatches); s++ {
						b, _, err := p.CheckpointState(task.Iteration, s)
						if err != nil {
							t.Errorf("checkpoint %d stage %d: %v", task.Iteration, s, err)
						}
						states[s] = b
					}
					_, _, err := p.CheckpointState(task.Iteration, 7)
					mu.Lock()
					checkpoints[task.Iteration] = states
					if checkpointErr == nil {
						checkpointErr = err
					}
					mu.Unlock()
				}
				if task.IsEvent() {
					continue
				}
				if err := tr.run(p, task); err != nil {
					t.Errorf("node %d: %v: %v", id, task.Message, err)
				}
				// Any task answered once is refused a second answer (not
				// only a forward: the routing may send relay 2 none).
				if id == 2 && !refusedTwice {
					err := p.TaskDone(task.ID, nil)
					if !errors.Is(err, &Error{Status: StatusNotFound}) {
						t.Errorf("a second answer: %v", err)
					}
					refusedTwice = true
				}
			}
		}(p)
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		mu.Lock()
		_, finished := losses[iterations-1]
		mu.Unlock()
		if finished {
			break
		}
		if time.Now().After(deadline) {
			close(done)
			wg.Wait()
			mu.Lock()
			for i, p := range peers {
				s, err := p.Stats()
				t.Logf("node %d: stats %+v %v; given: %v", i+1, s, err, trail[uint32(i+1)])
			}
			mu.Unlock()
			t.Fatalf("the swarm did not finish %d iterations: %v", iterations, losses)
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(done)
	wg.Wait()
	for _, p := range peers {
		if err := p.Leave(); err != nil {
			t.Error(err)
		}
	}
	s, err := peers[1].Stats()
	if err != nil || s.TasksDone == 0 || s.AnswersRefused == 0 {
		t.Errorf("relay stats %+v %v", s, err)
	}
	t.Logf("loss: iteration 0 %.3f, iteration %d %.3f; relay 2 did %d tasks", losses[0],
		iterations-1, losses[iterations-1], s.TasksDone)
	if !(losses[iterations-1] < 0.7*losses[0]) {
		t.Errorf("the loss did not fall: %v", losses)
	}
	if !refusedTwice {
		t.Error("relay 2 never had a task to answer twice")
	}
	agreed := 0
	for it, d := range digests {
		if a, ok := d[2]; ok {
			if b, ok := d[3]; ok {
				if a != b {
					t.Errorf("iteration %d: the relays' weights differ", it)
				}
				agreed++
			}
		}
	}
	if agreed < iterations-2 {
		t.Errorf("only %d updates compared between the relays", agreed)
	}
	// Checkpoints after the updates of 4, 9, 14 (and 19 when it came before
	// the end): each stage's state holds the weights its replicas printed.
	if !errors.Is(checkpointErr, &Error{Status: StatusNotFound}) {
		t.Errorf("a stage the checkpoint lacks: %v", checkpointErr)
	}
	params := map[uint32]int{0: 2 * toyV * toyD, 1: toyD * toyD}
	printer := map[uint32]uint32{0: 1, 1: 2}
	compared := 0
	for it, states := range checkpoints {
		if (it+1)%5 != 0 {
			t.Errorf("a checkpoint of iteration %d", it)
		}
		for s, b := range states {
			if len(b) < 4*params[s] {
				t.Errorf("checkpoint %d stage %d: %d bytes", it, s, len(b))
				continue
			}
			got := sha256.Sum256(b[:4*params[s]])
			if want, ok := digests[it][printer[s]]; ok {
				if got != want {
					t.Errorf("checkpoint %d stage %d is not the weights its replica printed", it, s)
				}
				compared++
			}
		}
	}
	t.Logf("%d checkpoints, %d stage states equal to the weights their replicas printed",
		len(checkpoints), compared)
	if len(checkpoints) < 3 || compared < 6 {
		t.Errorf("%d checkpoints, %d states compared", len(checkpoints), compared)
	}
}
