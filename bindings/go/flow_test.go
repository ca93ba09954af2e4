package gwtf

import (
	"strings"
	"testing"
)

func TestFlowGraphSolveAndRepair(t *testing.T) {
	g, err := NewFlowGraph()
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	s, _ := g.AddNode(2)
	a, _ := g.AddNode(0)
	b, _ := g.AddNode(0)
	d, _ := g.AddNode(-2)
	g.AddArc(s, a, 1, 1)
	g.AddArc(a, d, 1, 1)
	g.AddArc(s, b, 2, 2)
	g.AddArc(b, d, 2, 3)
	m, err := g.Solve()
	if err != nil || m.State != FlowOptimal || m.TotalCost != 7 || m.FlowValue != 2 {
		t.Fatalf("solve: %+v %v", m, err)
	}
	flows, err := g.ArcFlows()
	if err != nil || len(flows) != 4 || flows[0] != 1 || flows[2] != 1 {
		t.Fatalf("arc flows %v %v", flows, err)
	}
	if err := g.RemoveNode(a); err != nil {
		t.Fatal(err)
	}
	if m, err = g.Solve(); err != nil || m.TotalCost != 10 {
		t.Fatalf("repair: %+v %v", m, err)
	}
	if _, err := g.AddArc(s, 77, 1, 1); StatusOf(err) != StatusNotFound {
		t.Fatalf("unknown node: %v", err)
	}
}

func TestRoutingCrashIsRepaired(t *testing.T) {
	r, err := NewRouting(2, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	h, _ := r.AddDataHolder(2, 1000)
	fast, _ := r.AddRelay(1, 1, 1000)
	slow, _ := r.AddRelay(1, 1, 9000)
	last, _ := r.AddRelay(2, 2, 1000)
	for _, x := range []uint32{fast, slow} {
		r.SetLink(h, x, 5000, 1e9)
		r.SetLink(x, last, 1000, 1e9)
	}
	r.SetLink(last, h, 5000, 1e9)
	m, err := r.Solve()
	if err != nil || m.FlowValue != 2 || m.RouteCount != 2 {
		t.Fatalf("solve: %+v %v", m, err)
	}
	if err := r.RemoveMember(fast); err != nil {
		t.Fatal(err)
	}
	m, err = r.Solve()
	if err != nil || m.FlowValue != 1 || m.Unrouted != 1 {
		t.Fatalf("after crash: %+v %v", m, err)
	}
	routes, err := r.Routes(m.RouteCount)
	if err != nil || len(routes) != 1 || routes[0].Members[1] != slow {
		t.Fatalf("routes %+v %v", routes, err)
	}
	t.Logf("repaired in %.3f ms: %+v", m.SolveMs, routes[0])
}

func TestDIMACSErrorsNameTheLine(t *testing.T) {
	f, err := NewFlowFromDIMACS("p min 2 1\nn 1 3\nn 2 -3\na 1 2 0 5 2\n")
	if err != nil {
		t.Fatal(err)
	}
	if m, err := f.Solve(); err != nil || m.TotalCost != 6 {
		t.Fatalf("%+v %v", m, err)
	}
	f.Close()
	_, err = NewFlowFromDIMACS("p min 2 1\na 1 2 0 x 2\n")
	if StatusOf(err) != StatusProtocol || !strings.Contains(err.Error(), "line 2") {
		t.Fatalf("malformed DIMACS: %v", err)
	}
}
