package gwtf

import (
	"bytes"
	"encoding/binary"
	"math"
	"testing"
	"time"
)

var testKey = []byte("go-test-swarm-key-0123456789abcdef")

// connectedPair starts two nodes and connects the first to the second;
// the caller closes both.
func connectedPair(t *testing.T, ao, bo NodeOptions) (a, b *Node, peer uint64) {
	t.Helper()
	a, err := NewNode(ao)
	if err != nil {
		t.Fatal(err)
	}
	b, err = NewNode(bo)
	if err != nil {
		a.Close()
		t.Fatal(err)
	}
	addr, err := b.LocalAddr()
	if err == nil {
		peer, err = a.Connect(addr, 10*time.Second)
	}
	if err != nil {
		a.Close()
		b.Close()
		t.Fatal(err)
	}
	return a, b, peer
}

func TestNodeSendRecvTensors(t *testing.T) {
	o := NodeOptions{Listen: "127.0.0.1:0", SwarmKey: testKey, MaxPayloadBytes: 8 << 20, PoolBytes: 32 << 20}
	a, b, peer := connectedPair(t, o, o)
	defer a.Close()
	defer b.Close()
	if id, _ := b.ID(); id != peer {
		t.Fatalf("peer id %x, want %x", peer, id)
	}
	aid, _ := a.ID()
	for r, n := range []int{0, 1, 1000, 1 << 20} {
		data := make([]byte, 4*n)
		for i := 0; i < n; i++ {
			binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(float32(i)*0.25+float32(r)))
		}
		h := FrameHeader{Microbatch: uint64(r), Dtype: DtypeF32, Ndim: 1}
		h.Shape[0] = uint64(n)
		if err := a.Send(peer, h, data, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		f, err := b.Recv(10 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if f.Peer != aid || f.Header.Sender != aid || f.Header.Microbatch != uint64(r) || f.Header.Shape[0] != uint64(n) {
			t.Fatalf("header %+v from %x", f.Header, f.Peer)
		}
		if !bytes.Equal(f.Data, data) {
			t.Fatalf("tensor of %d floats differs", n)
		}
	}
	st, err := b.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.FramesReceived != 4 || st.UserCopies != 0 || st.PoolInUseBytes != 0 {
		t.Fatalf("stats %+v", st)
	}
	t.Logf("b received %d frames, %d bytes, %d library copies", st.FramesReceived, st.BytesReceived, st.UserCopies)
}

// One node asks for encryption: the connection encrypts, and tensors
// arrive as they were sent.
func TestEncryptedNodesExchangeTensors(t *testing.T) {
	a, b, peer := connectedPair(t,
		NodeOptions{Listen: "127.0.0.1:0", SwarmKey: testKey, Encrypt: true},
		NodeOptions{Listen: "127.0.0.1:0", SwarmKey: testKey})
	defer a.Close()
	defer b.Close()
	data := make([]byte, 3<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	h := FrameHeader{Microbatch: 9}
	if err := a.Send(peer, h, data, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	f, err := b.Recv(10 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if f.Header.Microbatch != 9 || !bytes.Equal(f.Data, data) {
		t.Fatalf("the encrypted tensor arrived changed")
	}
	st, err := a.Stats()
	if err != nil {
		t.Fatal(err)
	}
	// The sender encrypts copies: its copies count.
	if st.UserCopies == 0 {
		t.Fatalf("no copy counted on the encrypting side: %+v", st)
	}
}

func TestWrongKeyIsRefused(t *testing.T) {
	b, err := NewNode(NodeOptions{Listen: "127.0.0.1:0", SwarmKey: testKey})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	bad, err := NewNode(NodeOptions{SwarmKey: []byte("some-other-swarm-key-0123456789"), ConnectAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	addr, _ := b.LocalAddr()
	if _, err := bad.Connect(addr, 10*time.Second); StatusOf(err) != StatusClosed {
		t.Fatalf("want a refusal, got %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		ev, err := b.PollEvent(100 * time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		if ev != nil && ev.Kind == EventRefused {
			if ev.Reason != CloseAuthFailed {
				t.Fatalf("reason %d: %s", ev.Reason, ev.Message)
			}
			t.Logf("refused %s: %s", ev.Addr, ev.Message)
			return
		}
	}
	t.Fatal("no refused event")
}

func TestNodeCloseTwiceAndShortKey(t *testing.T) {
	if _, err := NewNode(NodeOptions{SwarmKey: []byte("short")}); StatusOf(err) != StatusInvalidArgument {
		t.Fatalf("short key: %v", err)
	}
	n, err := NewNode(NodeOptions{SwarmKey: testKey})
	if err != nil {
		t.Fatal(err)
	}
	n.Close()
	n.Close()
	if _, err := n.ID(); StatusOf(err) != StatusNullPointer {
		t.Fatalf("use after Close: %v", err)
	}
}
