package gwtf

/*
#include <stdlib.h>
#include <string.h>
#include <gwtf.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// PeerRole is what a swarm member is.
type PeerRole int32

// Roles of gwtf.h.
const (
	RoleHolder = PeerRole(C.GWTF_PEER_ROLE_HOLDER) // a data holder (stage 0)
	RoleRelay  = PeerRole(C.GWTF_PEER_ROLE_RELAY)  // serves one middle stage
)

// StageAuto lets the swarm choose a joining relay's stage.
const StageAuto = int32(C.GWTF_STAGE_AUTO)

// Contact is a swarm member to start from: a founding member (ID, Stage,
// Addr), or for a joiner an address alone (ID 0).
type Contact struct {
	ID    uint32
	Stage uint32
	Addr  string
}

// PeerOptions configures a swarm member. Zero values take the library's
// defaults (see gwtf_peer_options in gwtf.h), except Role (RoleHolder or
// RoleRelay) and Stage (0 for a holder, 1..RelayStages for a founding
// relay, StageAuto to join). ActivationBytes and StateBytes have
// RelayStages+1 entries: entry b is the activation stage b sends to stage
// b+1, and the state of stage b (entry 0 may be 0).
type PeerOptions struct {
	Role  PeerRole
	Stage int32
	// NodeKeyFile holds this member's private key, created on first use;
	// its id follows from it (NodeKeyID). "": a fresh key for this run.
	NodeKeyFile string
	// NodeID: 0 for the id of the key; any other value must be it, unless
	// ChosenIDs (insecure, test swarms: any holder of the swarm key can then
	// act as any member; every member must set it).
	NodeID                   uint32
	ChosenIDs                bool
	Listen                   string
	Bootstrap                []Contact
	SwarmKey                 []byte
	MemoryBudgetBytes        uint64
	MicrobatchBytes          uint64
	Seed                     uint64
	RelayStages              uint32
	MicrobatchesPerIteration uint32
	ActivationBytes          []uint64
	GradientBytes            []uint64 // nil: the activations' sizes
	StateBytes               []uint64
	LogToStderr              bool
	// The trainer can run a forward again: a relay whose memory is full
	// gets TaskDiscard for a forward, and that forward again before its
	// backward, instead of waiting for memory.
	Recompute bool
	// Data holders: keep a copy of every relay stage's state after every
	// KeepStatesEvery updates (an emptied stage is restored from it), and
	// assemble a checkpoint of the whole model after every SaveEvery
	// (EventCheckpoint, then CheckpointState). 0: none.
	KeepStatesEvery, SaveEvery uint32
	// Founding members whose trainers start from a checkpoint: the updates
	// it holds (iterations 0..N-1); the swarm starts at iteration N.
	ResumeIterationsDone uint32
	// Relays whose trainer can average its neighbouring stages' states: an
	// emptied stage of which no holder kept a copy is rebuilt from them
	// (TaskAverageStates, then EventStageRebuilt) instead of starting from
	// the initial weights.
	RebuildFromNeighbours bool
}

// TaskKind is a GWTF_TASK_KIND_* value: a task (below 100) to answer once,
// or an event (100 and up).
type TaskKind int32

// Task and event kinds of gwtf.h (see gwtf_task_kind for what each asks).
const (
	TaskEmbed            = TaskKind(C.GWTF_TASK_KIND_EMBED)
	TaskForward          = TaskKind(C.GWTF_TASK_KIND_FORWARD)
	TaskLoss             = TaskKind(C.GWTF_TASK_KIND_LOSS)
	TaskBackward         = TaskKind(C.GWTF_TASK_KIND_BACKWARD)
	TaskEmbedBackward    = TaskKind(C.GWTF_TASK_KIND_EMBED_BACKWARD)
	TaskGradient         = TaskKind(C.GWTF_TASK_KIND_GRADIENT)
	TaskApply            = TaskKind(C.GWTF_TASK_KIND_APPLY)
	TaskExportState      = TaskKind(C.GWTF_TASK_KIND_EXPORT_STATE)
	TaskImportState      = TaskKind(C.GWTF_TASK_KIND_IMPORT_STATE)
	TaskForget           = TaskKind(C.GWTF_TASK_KIND_FORGET)
	TaskDiscard          = TaskKind(C.GWTF_TASK_KIND_DISCARD)
	TaskInitState        = TaskKind(C.GWTF_TASK_KIND_INIT_STATE)
	TaskAverageStates    = TaskKind(C.GWTF_TASK_KIND_AVERAGE_STATES)
	EventIteration       = TaskKind(C.GWTF_TASK_KIND_EVENT_ITERATION)
	EventCommitted       = TaskKind(C.GWTF_TASK_KIND_EVENT_COMMITTED)
	EventApplied         = TaskKind(C.GWTF_TASK_KIND_EVENT_APPLIED)
	EventPeerGone        = TaskKind(C.GWTF_TASK_KIND_EVENT_PEER_LOST)
	EventActive          = TaskKind(C.GWTF_TASK_KIND_EVENT_ACTIVE)
	EventStateDownloaded = TaskKind(C.GWTF_TASK_KIND_EVENT_STATE_DOWNLOADED)
	EventStageStalled    = TaskKind(C.GWTF_TASK_KIND_EVENT_STAGE_STALLED)
	EventRecovered       = TaskKind(C.GWTF_TASK_KIND_EVENT_RECOVERED)
	EventError           = TaskKind(C.GWTF_TASK_KIND_EVENT_ERROR)
	EventLeft            = TaskKind(C.GWTF_TASK_KIND_EVENT_LEFT)
	EventStageEmpty      = TaskKind(C.GWTF_TASK_KIND_EVENT_STAGE_EMPTY)
	EventStageResumed    = TaskKind(C.GWTF_TASK_KIND_EVENT_STAGE_RESUMED)
	EventInputRefused    = TaskKind(C.GWTF_TASK_KIND_EVENT_REFUSED)
	EventFenced          = TaskKind(C.GWTF_TASK_KIND_EVENT_FENCED)
	EventUnreachable     = TaskKind(C.GWTF_TASK_KIND_EVENT_CONNECT_FAILED)
	EventStageRestored   = TaskKind(C.GWTF_TASK_KIND_EVENT_STAGE_RESTORED)
	EventStageRestarted  = TaskKind(C.GWTF_TASK_KIND_EVENT_STAGE_RESTARTED)
	EventCheckpoint      = TaskKind(C.GWTF_TASK_KIND_EVENT_CHECKPOINT)
	EventStageRebuilt    = TaskKind(C.GWTF_TASK_KIND_EVENT_STAGE_REBUILT)
)

// Microbatch names a microbatch: its holder, iteration and index.
type Microbatch struct {
	Holder, Iteration, Index uint32
}

// Task is a task or an event from NextTask. Input and Mean are views of
// library memory (no copy): valid until the task is answered or the peer
// closed; never keep them longer.
type Task struct {
	Kind         TaskKind
	Stage        uint32
	ID           uint64
	Mb           Microbatch
	Iteration    uint32
	HasIteration bool
	OutputBytes  uint64
	Input        []byte
	Granted      []Microbatch
	Mean         []float32
	Microbatches uint64
	Loss         float32
	Peer         uint64
	Bytes        uint64
	Ms           float64
	Weights      [32]byte
	Message      string
}

// IsEvent says whether t needs no answer.
func (t *Task) IsEvent() bool { return t.Kind >= 100 }

// PeerStats are a peer's counters.
type PeerStats struct {
	Compute, Useful                          time.Duration
	TasksGiven, TasksDone, TasksFailed       uint64
	AnswersRefused, Events                   uint64
	FramesSent, FramesReceived               uint64
	BytesSent, BytesReceived, PeersConnected uint64
}

// OutFrame is an output frame from the peer's pool: fill Data, then pass it
// to TaskDone or TaskDoneLoss, which take it when the answer is accepted.
// Release one that was not taken.
type OutFrame struct {
	f    *C.gwtf_frame
	Data []byte // library memory
}

// Release gives an untaken frame back. Idempotent.
func (o *OutFrame) Release() {
	if o != nil && o.f != nil {
		C.gwtf_frame_release(o.f)
		o.f = nil
		o.Data = nil
	}
}

// Peer is a swarm member driven by this program's trainer (gwtf_peer).
// Methods may be called from any goroutine; Close waits for calls in
// progress.
type Peer struct {
	mu  sync.RWMutex
	ptr *C.gwtf_peer
}

// cArray copies v into C memory (nil for an empty v); free it with C.free.
func cArray(v []uint64) *C.uint64_t {
	if len(v) == 0 {
		return nil
	}
	p := (*C.uint64_t)(C.malloc(C.size_t(8 * len(v))))
	copy(unsafe.Slice((*uint64)(unsafe.Pointer(p)), len(v)), v)
	return p
}

// NewPeer creates a swarm member and starts it. No Go memory is handed to
// the library: the options are copied into C memory for the call.
func NewPeer(o PeerOptions) (*Peer, error) {
	// The library reads RelayStages+1 sizes from each array.
	if n := int(o.RelayStages) + 1; len(o.ActivationBytes) != n || len(o.StateBytes) != n ||
		(o.GradientBytes != nil && len(o.GradientBytes) != n) {
		return nil, &Error{Status: StatusInvalidArgument,
			Message: "invalid argument: ActivationBytes, GradientBytes and StateBytes need RelayStages+1 entries"}
	}
	var opts C.gwtf_peer_options
	if err := check(C.gwtf_peer_options_init(&opts), nil); err != nil {
		return nil, err
	}
	var frees []unsafe.Pointer
	defer func() {
		for _, p := range frees {
			C.free(p)
		}
	}()
	keep := func(p unsafe.Pointer) unsafe.Pointer {
		if p != nil {
			frees = append(frees, p)
		}
		return p
	}
	opts.role = C.int32_t(o.Role)
	opts.stage = C.int32_t(o.Stage)
	opts.node_id = C.uint32_t(o.NodeID)
	if o.NodeKeyFile != "" {
		opts.node_key_path = (*C.char)(keep(unsafe.Pointer(C.CString(o.NodeKeyFile))))
	}
	if o.ChosenIDs {
		opts.chosen_ids = 1
	}
	opts.keep_states_every = C.uint32_t(o.KeepStatesEvery)
	opts.save_every = C.uint32_t(o.SaveEvery)
	opts.resume_iterations_done = C.uint32_t(o.ResumeIterationsDone)
	if o.RebuildFromNeighbours {
		opts.rebuild_from_neighbours = 1
	}
	if o.Listen != "" {
		opts.listen_addr = (*C.char)(keep(unsafe.Pointer(C.CString(o.Listen))))
	}
	if n := len(o.Bootstrap); n > 0 {
		arr := (*C.gwtf_peer_contact)(keep(C.malloc(C.size_t(n) * C.size_t(unsafe.Sizeof(C.gwtf_peer_contact{})))))
		cs := unsafe.Slice(arr, n)
		for i, c := range o.Bootstrap {
			cs[i].id = C.uint32_t(c.ID)
			cs[i].stage = C.uint32_t(c.Stage)
			cs[i].addr = (*C.char)(keep(unsafe.Pointer(C.CString(c.Addr))))
		}
		opts.bootstrap = arr
		opts.bootstrap_len = C.size_t(n)
	}
	opts.swarm_key = (*C.uint8_t)(keep(C.CBytes(o.SwarmKey)))
	opts.swarm_key_len = C.size_t(len(o.SwarmKey))
	if o.MemoryBudgetBytes > 0 {
		opts.memory_budget_bytes = C.uint64_t(o.MemoryBudgetBytes)
	}
	opts.microbatch_bytes = C.uint64_t(o.MicrobatchBytes)
	if o.Seed > 0 {
		opts.seed = C.uint64_t(o.Seed)
	}
	opts.relay_stages = C.uint32_t(o.RelayStages)
	if o.MicrobatchesPerIteration > 0 {
		opts.microbatches_per_iteration = C.uint32_t(o.MicrobatchesPerIteration)
	}
	opts.activation_bytes = (*C.uint64_t)(keep(unsafe.Pointer(cArray(o.ActivationBytes))))
	opts.gradient_bytes = (*C.uint64_t)(keep(unsafe.Pointer(cArray(o.GradientBytes))))
	opts.state_bytes = (*C.uint64_t)(keep(unsafe.Pointer(cArray(o.StateBytes))))
	if o.LogToStderr {
		opts.log_to_stderr = 1
	}
	if o.Recompute {
		opts.recompute = 1
	}
	var p *C.gwtf_peer
	var cerr *C.gwtf_error
	if err := check(C.gwtf_peer_new(&opts, &p, &cerr), &cerr); err != nil {
		return nil, err
	}
	peer := &Peer{ptr: p}
	runtime.SetFinalizer(peer, func(p *Peer) { p.Close() })
	return peer, nil
}

// Close frees the peer: abruptly, as a crash is for the others, unless
// Leave came first. Every Task's Input and Mean are invalid afterwards.
// Idempotent.
func (p *Peer) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ptr != nil {
		C.gwtf_peer_free(p.ptr)
		p.ptr = nil
	}
	return nil
}

// ID is this peer's node id.
func (p *Peer) ID() (uint32, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var id C.uint32_t
	var cerr *C.gwtf_error
	err := check(C.gwtf_peer_id(p.ptr, &id, &cerr), &cerr)
	return uint32(id), err
}

// LocalAddr is the "IP:PORT" the peer listens on.
func (p *Peer) LocalAddr() (string, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	buf := (*C.char)(C.malloc(64))
	defer C.free(unsafe.Pointer(buf))
	var cerr *C.gwtf_error
	if err := check(C.gwtf_peer_local_addr(p.ptr, buf, 64, nil, &cerr), &cerr); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

// NextTask waits up to timeout for the next task or event; an error with
// StatusTimeout when nothing came, StatusClosed once the peer stopped.
func (p *Peer) NextTask(timeout time.Duration) (*Task, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var t C.gwtf_peer_task
	var cerr *C.gwtf_error
	if err := check(C.gwtf_peer_next_task(p.ptr, ms(timeout), &t, C.size_t(unsafe.Sizeof(t)), &cerr), &cerr); err != nil {
		return nil, err
	}
	out := &Task{
		Kind: TaskKind(t.kind), Stage: uint32(t.stage), ID: uint64(t.id),
		Mb:        Microbatch{uint32(t.mb.holder), uint32(t.mb.iteration), uint32(t.mb.index)},
		Iteration: uint32(t.iteration), HasIteration: t.has_iteration != 0,
		OutputBytes: uint64(t.output_bytes), Microbatches: uint64(t.microbatches),
		Loss: float32(t.loss), Peer: uint64(t.peer), Bytes: uint64(t.bytes), Ms: float64(t.ms),
		Message: C.GoString(&t.message[0]),
	}
	for i := range out.Weights {
		out.Weights[i] = byte(t.weights[i])
	}
	if t.input_len > 0 {
		out.Input = unsafe.Slice((*byte)(unsafe.Pointer(t.input)), int(t.input_len))
	}
	if t.mean_len > 0 {
		out.Mean = unsafe.Slice((*float32)(unsafe.Pointer(t.mean)), int(t.mean_len))
	}
	if t.granted_len > 0 {
		g := unsafe.Slice(t.granted, int(t.granted_len))
		out.Granted = make([]Microbatch, len(g))
		for i, m := range g {
			out.Granted[i] = Microbatch{uint32(m.holder), uint32(m.iteration), uint32(m.index)}
		}
	}
	return out, nil
}

// CheckpointState is the state of protocol stage stage (0: the holders')
// in this holder's checkpoint of iteration iteration (EventCheckpoint), as
// that stage's trainer exported it (a copy), and the node it came from.
func (p *Peer) CheckpointState(iteration, stage uint32) ([]byte, uint32, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var data *C.uint8_t
	var n C.size_t
	var from C.uint32_t
	var cerr *C.gwtf_error
	if err := check(C.gwtf_peer_checkpoint_state(p.ptr, C.uint32_t(iteration), C.uint32_t(stage), &data, &n, &from, &cerr), &cerr); err != nil {
		return nil, 0, err
	}
	return C.GoBytes(unsafe.Pointer(data), C.int(n)), uint32(from), nil
}

// Alloc takes an output frame of n bytes from the peer's pool.
func (p *Peer) Alloc(n int, timeout time.Duration) (*OutFrame, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var f *C.gwtf_frame
	var cerr *C.gwtf_error
	if err := check(C.gwtf_peer_alloc(p.ptr, C.uint64_t(n), ms(timeout), &f, &cerr), &cerr); err != nil {
		return nil, err
	}
	var v C.gwtf_frame_view
	if err := check(C.gwtf_frame_get_view(f, &v, &cerr), &cerr); err != nil {
		C.gwtf_frame_release(f)
		return nil, err
	}
	o := &OutFrame{f: f}
	if v.len > 0 {
		o.Data = unsafe.Slice((*byte)(unsafe.Pointer(v.data)), int(v.len))
	}
	return o, nil
}

// raw is the frame handle (nil for none).
func (o *OutFrame) raw() *C.gwtf_frame {
	if o == nil {
		return nil
	}
	return o.f
}

// taken marks out as passed to the library after an accepted answer.
func taken(out *OutFrame, err error) error {
	if err == nil && out != nil {
		out.f = nil
		out.Data = nil
	}
	return err
}

// TaskDone answers a task with out (nil for none). Accepted: out belongs to
// the library. Refused (an error): out is still the caller's, unchanged.
func (p *Peer) TaskDone(id uint64, out *OutFrame) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var cerr *C.gwtf_error
	return taken(out, check(C.gwtf_peer_task_done(p.ptr, C.uint64_t(id), out.raw(), &cerr), &cerr))
}

// TaskDoneLoss answers a loss task: the loss and the input's gradient.
func (p *Peer) TaskDoneLoss(id uint64, loss float32, grad *OutFrame) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var cerr *C.gwtf_error
	return taken(grad, check(C.gwtf_peer_task_done_loss(p.ptr, C.uint64_t(id), C.float(loss), grad.raw(), &cerr), &cerr))
}

// TaskDoneGradient answers a gradient task: the sum of the granted
// microbatches' gradients (copied by the library during the call; zeros of
// the same length when none is granted) and the digest of the weights.
func (p *Peer) TaskDoneGradient(id uint64, sum []float32, weights [32]byte) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var ptr *C.float
	if len(sum) > 0 {
		ptr = (*C.float)(unsafe.Pointer(&sum[0]))
	}
	var cerr *C.gwtf_error
	return check(C.gwtf_peer_task_done_gradient(p.ptr, C.uint64_t(id), ptr, C.size_t(len(sum)),
		(*C.uint8_t)(unsafe.Pointer(&weights[0])), &cerr), &cerr)
}

// TaskDoneWeights answers an apply or import task with the weights' digest.
func (p *Peer) TaskDoneWeights(id uint64, weights [32]byte) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var cerr *C.gwtf_error
	return check(C.gwtf_peer_task_done_weights(p.ptr, C.uint64_t(id),
		(*C.uint8_t)(unsafe.Pointer(&weights[0])), &cerr), &cerr)
}

// TaskDoneRebuilt answers an average-states task with the rebuilt weights'
// digest and how many of its states they average (0: none fitted; the
// trainer took the initial weights).
func (p *Peer) TaskDoneRebuilt(id uint64, weights [32]byte, averaged uint32) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var cerr *C.gwtf_error
	return check(C.gwtf_peer_task_done_rebuilt(p.ptr, C.uint64_t(id),
		(*C.uint8_t)(unsafe.Pointer(&weights[0])), C.uint32_t(averaged), &cerr), &cerr)
}

// TaskFailed reports that the trainer could not do a task.
func (p *Peer) TaskFailed(id uint64, reason string) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	cs := C.CString(reason)
	defer C.free(unsafe.Pointer(cs))
	var cerr *C.gwtf_error
	return check(C.gwtf_peer_task_failed(p.ptr, C.uint64_t(id), cs, &cerr), &cerr)
}

// Stats are the peer's counters.
func (p *Peer) Stats() (PeerStats, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var s C.gwtf_peer_stats
	var cerr *C.gwtf_error
	if err := check(C.gwtf_peer_get_stats(p.ptr, &s, C.size_t(unsafe.Sizeof(s)), &cerr), &cerr); err != nil {
		return PeerStats{}, err
	}
	return PeerStats{
		Compute: time.Duration(s.compute_ns), Useful: time.Duration(s.useful_ns),
		TasksGiven: uint64(s.tasks_given), TasksDone: uint64(s.tasks_done),
		TasksFailed: uint64(s.tasks_failed), AnswersRefused: uint64(s.answers_refused),
		Events: uint64(s.events), FramesSent: uint64(s.frames_sent),
		FramesReceived: uint64(s.frames_received), BytesSent: uint64(s.bytes_sent),
		BytesReceived: uint64(s.bytes_received), PeersConnected: uint64(s.peers_connected),
	}, nil
}

// Leave leaves the swarm gracefully and waits until done; NextTask then
// says StatusClosed (after the events from before). Idempotent.
func (p *Peer) Leave() error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var cerr *C.gwtf_error
	return check(C.gwtf_peer_leave(p.ptr, &cerr), &cerr)
}
