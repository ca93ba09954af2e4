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

// FlowState is the outcome of Flow.Solve (GWTF_FLOW_STATE_*).
type FlowState int32

// Solve outcomes.
const (
	FlowNotSolved  FlowState = C.GWTF_FLOW_STATE_NOT_SOLVED
	FlowOptimal    FlowState = C.GWTF_FLOW_STATE_OPTIMAL
	FlowInfeasible FlowState = C.GWTF_FLOW_STATE_INFEASIBLE
	FlowUnbounded  FlowState = C.GWTF_FLOW_STATE_UNBOUNDED
)

// FlowMetrics are the results of the last solve.
type FlowMetrics struct {
	State          FlowState
	FlowValue      int64
	TotalCost      int64
	Unrouted       int64
	CriticalPathUs int64
	TIterUs        int64
	TIterPerFlowUs float64
	RouteCount     uint64
	SolveMs        float64
}

// Route is one route of a routing solution: its members (data holder, one
// relay per stage, data holder), how many microbatches take it, its cost.
type Route struct {
	Members []uint32
	Count   int64
	CostUs  int64
}

// Flow is the routing solver: a general min-cost flow graph (NewFlowGraph)
// or a GWTF routing model (NewRouting). After changes, Solve repairs the
// previous optimum instead of solving from scratch. Close it when done.
type Flow struct {
	mu  sync.Mutex
	ptr *C.gwtf_flow
}

func newFlow(ptr *C.gwtf_flow) *Flow {
	f := &Flow{ptr: ptr}
	runtime.SetFinalizer(f, (*Flow).Close)
	return f
}

// NewFlowGraph creates an empty general min-cost flow graph.
func NewFlowGraph() (*Flow, error) {
	var raw *C.gwtf_flow
	var cerr *C.gwtf_error
	if err := check(C.gwtf_flow_new_graph(&raw, &cerr), &cerr); err != nil {
		return nil, err
	}
	return newFlow(raw), nil
}

// NewFlowFromDIMACS parses a DIMACS min-cost flow problem.
func NewFlowFromDIMACS(text string) (*Flow, error) {
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	var raw *C.gwtf_flow
	var cerr *C.gwtf_error
	if err := check(C.gwtf_flow_new_from_dimacs(ctext, C.size_t(len(text)), &raw, &cerr), &cerr); err != nil {
		return nil, err
	}
	return newFlow(raw), nil
}

// NewRouting creates a GWTF routing model with the given stages and
// activation size in bytes.
func NewRouting(stages uint32, activationBytes uint64) (*Flow, error) {
	var raw *C.gwtf_flow
	var cerr *C.gwtf_error
	if err := check(C.gwtf_flow_new_routing(C.uint32_t(stages), C.uint64_t(activationBytes), &raw, &cerr), &cerr); err != nil {
		return nil, err
	}
	return newFlow(raw), nil
}

// Close frees the solver; it is safe to call more than once.
func (f *Flow) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ptr != nil {
		C.gwtf_flow_free(f.ptr)
		f.ptr = nil
		runtime.SetFinalizer(f, nil)
	}
	return nil
}

// call runs one C call under the lock and converts its error.
func (f *Flow) call(fn func(p *C.gwtf_flow, cerr **C.gwtf_error) C.gwtf_status) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	var cerr *C.gwtf_error
	st := fn(f.ptr, &cerr)
	return check(st, &cerr)
}

// AddNode adds a node with a supply (positive: source; negative: sink).
func (f *Flow) AddNode(supply int64) (uint32, error) {
	var id C.uint32_t
	err := f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_add_node(p, C.int64_t(supply), &id, e)
	})
	return uint32(id), err
}

// AddArc adds an arc with a capacity and a cost.
func (f *Flow) AddArc(from, to uint32, capacity, cost int64) (uint32, error) {
	var id C.uint32_t
	err := f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_add_arc(p, C.uint32_t(from), C.uint32_t(to), C.int64_t(capacity), C.int64_t(cost), &id, e)
	})
	return uint32(id), err
}

// RemoveNode removes a node and its arcs.
func (f *Flow) RemoveNode(node uint32) error {
	return f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_remove_node(p, C.uint32_t(node), e)
	})
}

// SetArcCost changes an arc's cost.
func (f *Flow) SetArcCost(arc uint32, cost int64) error {
	return f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_set_arc_cost(p, C.uint32_t(arc), C.int64_t(cost), e)
	})
}

// SetArcCapacity changes an arc's capacity.
func (f *Flow) SetArcCapacity(arc uint32, capacity int64) error {
	return f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_set_arc_capacity(p, C.uint32_t(arc), C.int64_t(capacity), e)
	})
}

// AddDataHolder adds a data holder (routing models).
func (f *Flow) AddDataHolder(capacity int64, computeUs float64) (uint32, error) {
	var id C.uint32_t
	err := f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_add_data_holder(p, C.int64_t(capacity), C.double(computeUs), &id, e)
	})
	return uint32(id), err
}

// AddRelay adds a relay serving a 1-based stage (routing models).
func (f *Flow) AddRelay(stage uint32, capacity int64, computeUs float64) (uint32, error) {
	var id C.uint32_t
	err := f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_add_relay(p, C.uint32_t(stage), C.int64_t(capacity), C.double(computeUs), &id, e)
	})
	return uint32(id), err
}

// SetLink sets a symmetric link: one-way latency (µs) and bandwidth (bytes/s).
func (f *Flow) SetLink(a, b uint32, latencyUs, bytesPerSecond float64) error {
	return f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_set_link(p, C.uint32_t(a), C.uint32_t(b), C.double(latencyUs), C.double(latencyUs),
			C.double(bytesPerSecond), C.double(bytesPerSecond), e)
	})
}

// RemoveMember removes a crashed or departed member (routing models).
func (f *Flow) RemoveMember(member uint32) error {
	return f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		return C.gwtf_flow_remove_member(p, C.uint32_t(member), e)
	})
}

// Solve solves or repairs and returns the metrics of the result.
func (f *Flow) Solve() (FlowMetrics, error) {
	var m C.gwtf_flow_metrics
	C.gwtf_flow_metrics_init(&m)
	err := f.call(func(p *C.gwtf_flow, e **C.gwtf_error) C.gwtf_status {
		var state C.int32_t
		if st := C.gwtf_flow_solve(p, &state, e); st != C.GWTF_STATUS_OK {
			return st
		}
		return C.gwtf_flow_get_metrics(p, &m, e)
	})
	if err != nil {
		return FlowMetrics{}, err
	}
	return FlowMetrics{
		State: FlowState(m.state), FlowValue: int64(m.flow_value), TotalCost: int64(m.total_cost),
		Unrouted: int64(m.unrouted), CriticalPathUs: int64(m.critical_path_us), TIterUs: int64(m.t_iter_us),
		TIterPerFlowUs: float64(m.t_iter_per_flow_us), RouteCount: uint64(m.route_count), SolveMs: float64(m.solve_ms),
	}, nil
}

// ArcFlows returns the flow of every arc, by arc id (general graphs).
func (f *Flow) ArcFlows() ([]int64, error) {
	var n C.size_t
	f.mu.Lock()
	defer f.mu.Unlock()
	var cerr *C.gwtf_error
	st := C.gwtf_flow_arc_flows(f.ptr, nil, 0, &n, &cerr)
	if st != C.GWTF_STATUS_OK && st != C.GWTF_STATUS_BUFFER_TOO_SMALL {
		return nil, check(st, &cerr)
	}
	C.gwtf_error_free(cerr)
	cerr = nil
	if n == 0 {
		return []int64{}, nil
	}
	buf := (*C.int64_t)(C.malloc(n * 8))
	defer C.free(unsafe.Pointer(buf))
	if err := check(C.gwtf_flow_arc_flows(f.ptr, buf, n, &n, &cerr), &cerr); err != nil {
		return nil, err
	}
	src := unsafe.Slice(buf, int(n))
	out := make([]int64, int(n))
	for i := range out {
		out[i] = int64(src[i])
	}
	return out, nil
}

// Routes returns every route of the last routing solve, cheapest first.
func (f *Flow) Routes(count uint64) ([]Route, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	buf := (*C.uint32_t)(C.malloc(C.size_t(64 * 4)))
	defer C.free(unsafe.Pointer(buf))
	routes := make([]Route, 0, count)
	for i := uint64(0); i < count; i++ {
		var n C.size_t
		var cnt, cost C.int64_t
		var cerr *C.gwtf_error
		if err := check(C.gwtf_flow_route(f.ptr, C.size_t(i), buf, 64, &n, &cnt, &cost, &cerr), &cerr); err != nil {
			return nil, err
		}
		src := unsafe.Slice(buf, int(n))
		members := make([]uint32, int(n))
		for k := range members {
			members[k] = uint32(src[k])
		}
		routes = append(routes, Route{Members: members, Count: int64(cnt), CostUs: int64(cost)})
	}
	return routes, nil
}
