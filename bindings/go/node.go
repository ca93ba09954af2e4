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

// NodeOptions configures a transport node. Zero values take the library's
// defaults (see gwtf_node_options in gwtf.h); SwarmKey is required.
type NodeOptions struct {
	Listen   string // "IP:PORT" to accept peers on; "" for none
	SwarmKey []byte // shared by all participants, >= 16 bytes
	// NodeKeyFile holds this node's private key, created on first use; its
	// id follows from it (NodeKeyID). "": a fresh key for this run.
	NodeKeyFile string
	// NodeID: 0 for the id of the key; any other value must be it, unless
	// ChosenIDs (insecure, test swarms: any holder of the swarm key can then
	// act as any node).
	NodeID          uint64
	ChosenIDs       bool
	MaxPayloadBytes uint64
	PoolBytes       uint64
	SendQueueDepth  uint32
	PeerTimeout     time.Duration
	HeartbeatEvery  time.Duration
	ConnectAttempts uint32
	LogToStderr     bool
	// Encrypt frame payloads (AES-256-GCM; a connection encrypts when
	// either end asks). Every frame is authenticated either way.
	Encrypt bool
}

// FrameHeader holds the user fields of a frame header.
type FrameHeader struct {
	Sender     uint64 // set by the library
	Stage      uint32
	Flags      uint32
	Microbatch uint64
	Iteration  uint64
	Dtype      uint16
	Ndim       uint16
	Shape      [4]uint64
}

// Dtypes of gwtf.h.
const (
	DtypeBytes = uint16(C.GWTF_DTYPE_BYTES)
	DtypeF32   = uint16(C.GWTF_DTYPE_F32)
)

// Frame is a received frame; Data is a Go copy (the library's buffer was
// released before Recv returned).
type Frame struct {
	Peer   uint64
	Header FrameHeader
	Data   []byte
}

// EventKind is a GWTF_EVENT_KIND_* value.
type EventKind int32

// Event kinds.
const (
	EventPeerConnected = EventKind(C.GWTF_EVENT_KIND_PEER_CONNECTED)
	EventPeerLost      = EventKind(C.GWTF_EVENT_KIND_PEER_LOST)
	EventRefused       = EventKind(C.GWTF_EVENT_KIND_REFUSED)
	EventConnectFailed = EventKind(C.GWTF_EVENT_KIND_CONNECT_FAILED)
)

// CloseAuthFailed is the close reason of a peer without the swarm key.
const CloseAuthFailed = int32(C.GWTF_CLOSE_REASON_AUTH_FAILED)

// Event is something that happened to a node's connections.
type Event struct {
	Kind    EventKind
	Reason  int32 // GWTF_CLOSE_REASON_*
	Peer    uint64
	Addr    string
	Message string
}

// NodeStats are a node's counters.
type NodeStats struct {
	FramesSent, FramesReceived, BytesSent, BytesReceived  uint64
	UserCopies, PeersConnected, ConnectionsRefused        uint64
	PoolCapacityBytes, PoolInUseBytes, PoolHighWaterBytes uint64
}

// Node is a libgwtf transport node. Methods may be called from any
// goroutine; Close waits for calls in progress.
type Node struct {
	mu  sync.RWMutex
	ptr *C.gwtf_node
}

func ms(d time.Duration) C.uint32_t {
	if d < 0 {
		return 0
	}
	m := d.Milliseconds()
	if m > 0xffffffff {
		m = 0xffffffff
	}
	return C.uint32_t(m)
}

// NewNode creates a node (and its listener when Listen is set).
func NewNode(o NodeOptions) (*Node, error) {
	var opts C.gwtf_node_options
	if err := check(C.gwtf_node_options_init(&opts), nil); err != nil {
		return nil, err
	}
	if o.Listen != "" {
		cs := C.CString(o.Listen)
		defer C.free(unsafe.Pointer(cs))
		opts.listen_addr = cs
	}
	// The key is copied into C memory: no Go memory is handed to C to keep.
	key := C.CBytes(o.SwarmKey)
	defer C.free(key)
	opts.swarm_key = (*C.uint8_t)(key)
	opts.swarm_key_len = C.size_t(len(o.SwarmKey))
	opts.node_id = C.uint64_t(o.NodeID)
	if o.NodeKeyFile != "" {
		cs := C.CString(o.NodeKeyFile)
		defer C.free(unsafe.Pointer(cs))
		opts.node_key_path = cs
	}
	if o.ChosenIDs {
		opts.chosen_ids = 1
	}
	if o.MaxPayloadBytes > 0 {
		opts.max_payload_bytes = C.uint64_t(o.MaxPayloadBytes)
	}
	if o.PoolBytes > 0 {
		opts.pool_bytes = C.uint64_t(o.PoolBytes)
	}
	if o.SendQueueDepth > 0 {
		opts.send_queue_depth = C.uint32_t(o.SendQueueDepth)
	}
	if o.PeerTimeout > 0 {
		opts.peer_timeout_ms = ms(o.PeerTimeout)
	}
	if o.HeartbeatEvery > 0 {
		opts.heartbeat_interval_ms = ms(o.HeartbeatEvery)
	}
	if o.ConnectAttempts > 0 {
		opts.connect_attempts = C.uint32_t(o.ConnectAttempts)
	}
	if o.LogToStderr {
		opts.log_to_stderr = 1
	}
	if o.Encrypt {
		opts.encrypt = 1
	}
	var p *C.gwtf_node
	var cerr *C.gwtf_error
	if err := check(C.gwtf_node_new(&opts, &p, &cerr), &cerr); err != nil {
		return nil, err
	}
	n := &Node{ptr: p}
	runtime.SetFinalizer(n, func(n *Node) { n.Close() })
	return n, nil
}

// Close shuts the node down (goodbye to every peer) and frees it. Idempotent.
func (n *Node) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ptr != nil {
		C.gwtf_node_free(n.ptr)
		n.ptr = nil
	}
	return nil
}

// ID is this node's id.
func (n *Node) ID() (uint64, error) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	var id C.uint64_t
	var cerr *C.gwtf_error
	err := check(C.gwtf_node_id(n.ptr, &id, &cerr), &cerr)
	return uint64(id), err
}

// NodeKeyID is the node id that follows from the node key in the file at
// path, which is created (a fresh key, owner read and write only) when
// missing: how founding members learn the ids for their Bootstrap lists.
func NodeKeyID(path string) (uint32, error) {
	cs := C.CString(path)
	defer C.free(unsafe.Pointer(cs))
	var id C.uint32_t
	var cerr *C.gwtf_error
	err := check(C.gwtf_node_key_id(cs, &id, &cerr), &cerr)
	return uint32(id), err
}

// LocalAddr is the "IP:PORT" the node listens on.
func (n *Node) LocalAddr() (string, error) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	buf := (*C.char)(C.malloc(64))
	defer C.free(unsafe.Pointer(buf))
	var cerr *C.gwtf_error
	if err := check(C.gwtf_node_local_addr(n.ptr, buf, 64, nil, &cerr), &cerr); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

// Connect connects to addr and waits until the peer is authenticated.
func (n *Node) Connect(addr string, timeout time.Duration) (uint64, error) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	cs := C.CString(addr)
	defer C.free(unsafe.Pointer(cs))
	var peer C.uint64_t
	var cerr *C.gwtf_error
	err := check(C.gwtf_node_connect(n.ptr, cs, ms(timeout), &peer, &cerr), &cerr)
	return uint64(peer), err
}

// Send copies data into a library frame (the only copy, on the Go side) and
// sends it to peer with header h.
func (n *Node) Send(peer uint64, h FrameHeader, data []byte, timeout time.Duration) error {
	n.mu.RLock()
	defer n.mu.RUnlock()
	var f *C.gwtf_frame
	var cerr *C.gwtf_error
	if err := check(C.gwtf_node_frame_alloc(n.ptr, C.uint64_t(len(data)), ms(timeout), &f, &cerr), &cerr); err != nil {
		return err
	}
	var v C.gwtf_frame_view
	if err := check(C.gwtf_frame_get_view(f, &v, &cerr), &cerr); err != nil {
		C.gwtf_frame_release(f)
		return err
	}
	if len(data) > 0 {
		copy(unsafe.Slice((*byte)(unsafe.Pointer(v.data)), len(data)), data)
	}
	var ch C.gwtf_frame_header
	C.gwtf_frame_header_init(&ch)
	ch.stage = C.uint32_t(h.Stage)
	ch.flags = C.uint32_t(h.Flags)
	ch.microbatch = C.uint64_t(h.Microbatch)
	ch.iteration = C.uint64_t(h.Iteration)
	ch.dtype = C.uint16_t(h.Dtype)
	ch.ndim = C.uint16_t(h.Ndim)
	for i := 0; i < 4; i++ {
		ch.shape[i] = C.uint64_t(h.Shape[i])
	}
	if err := check(C.gwtf_frame_set_header(f, &ch, &cerr), &cerr); err != nil {
		C.gwtf_frame_release(f)
		return err
	}
	// The frame belongs to the library from here on, even on failure.
	return check(C.gwtf_node_send(n.ptr, C.uint64_t(peer), f, ms(timeout), &cerr), &cerr)
}

// Recv waits up to timeout for the next frame; its data is copied into Go
// memory and the library's buffer released at once.
func (n *Node) Recv(timeout time.Duration) (*Frame, error) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	var f *C.gwtf_frame
	var cerr *C.gwtf_error
	if err := check(C.gwtf_node_recv(n.ptr, ms(timeout), &f, &cerr), &cerr); err != nil {
		return nil, err
	}
	defer C.gwtf_frame_release(f)
	var v C.gwtf_frame_view
	if err := check(C.gwtf_frame_get_view(f, &v, &cerr), &cerr); err != nil {
		return nil, err
	}
	out := &Frame{Peer: uint64(v.peer_id)}
	h := &v.header
	out.Header = FrameHeader{
		Sender: uint64(h.sender), Stage: uint32(h.stage), Flags: uint32(h.flags),
		Microbatch: uint64(h.microbatch), Iteration: uint64(h.iteration),
		Dtype: uint16(h.dtype), Ndim: uint16(h.ndim),
	}
	for i := 0; i < 4; i++ {
		out.Header.Shape[i] = uint64(h.shape[i])
	}
	out.Data = C.GoBytes(unsafe.Pointer(v.data), C.int(v.len))
	return out, nil
}

// PollEvent waits up to timeout for the next event; (nil, nil) when none.
func (n *Node) PollEvent(timeout time.Duration) (*Event, error) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	var ev C.gwtf_event
	var cerr *C.gwtf_error
	st := C.gwtf_node_poll_event(n.ptr, ms(timeout), &ev, &cerr)
	if st == C.GWTF_STATUS_TIMEOUT {
		C.gwtf_error_free(cerr)
		return nil, nil
	}
	if err := check(st, &cerr); err != nil {
		return nil, err
	}
	return &Event{
		Kind: EventKind(ev.kind), Reason: int32(ev.reason), Peer: uint64(ev.peer_id),
		Addr: C.GoString(&ev.addr[0]), Message: C.GoString(&ev.message[0]),
	}, nil
}

// Stats returns the node's counters.
func (n *Node) Stats() (NodeStats, error) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	var s C.gwtf_node_stats
	var cerr *C.gwtf_error
	if err := check(C.gwtf_node_get_stats(n.ptr, &s, C.size_t(unsafe.Sizeof(s)), &cerr), &cerr); err != nil {
		return NodeStats{}, err
	}
	return NodeStats{
		FramesSent: uint64(s.frames_sent), FramesReceived: uint64(s.frames_received),
		BytesSent: uint64(s.bytes_sent), BytesReceived: uint64(s.bytes_received),
		UserCopies: uint64(s.user_copies), PeersConnected: uint64(s.peers_connected),
		ConnectionsRefused: uint64(s.connections_refused),
		PoolCapacityBytes:  uint64(s.pool_capacity_bytes), PoolInUseBytes: uint64(s.pool_in_use_bytes),
		PoolHighWaterBytes: uint64(s.pool_high_water_bytes),
	}, nil
}
