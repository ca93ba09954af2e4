//! DIMACS read/write: round trip, lower bounds, and malformed input with line numbers.
use gwtf::flow::{dimacs, reference, Status};

const SMALL: &str = "c tiny\np min 4 5\nn 1 4\nn 4 -4\na 1 2 0 4 2\na 1 3 0 2 2\na 2 3 0 2 1\na 2 4 0 3 3\na 3 4 0 5 1\n";

#[test]
fn round_trip_and_solve() {
    let mut p = dimacs::read(SMALL.as_bytes(), Some(SMALL.len() as u64)).unwrap();
    assert_eq!(p.mcf.solve().unwrap(), Status::Optimal);
    assert_eq!(p.cost(), 14);
    assert_eq!(p.flow_value(), 4);
    let mut out = Vec::new();
    dimacs::write(&p.mcf, &mut out).unwrap();
    let mut q = dimacs::read(out.as_slice(), None).unwrap();
    q.mcf.solve().unwrap();
    assert_eq!(q.cost(), 14);
    assert_eq!(q.mcf.arc_count(), 5);
    let arcs: Vec<reference::RefArc> = vec![
        (0, 1, 4, 2),
        (0, 2, 2, 2),
        (1, 2, 2, 1),
        (1, 3, 3, 3),
        (2, 3, 5, 1),
    ];
    assert_eq!(reference::solve(4, &[4, 0, 0, -4], &arcs).unwrap().0, 14);
}

#[test]
fn lower_bounds_are_transformed() {
    // force 3 units over the expensive 1->3 arc (cap 3, low 3)
    let text = "p min 3 3\nn 1 3\nn 3 -3\na 1 2 0 5 1\na 2 3 0 5 1\na 1 3 3 3 10\n";
    let mut p = dimacs::read(text.as_bytes(), None).unwrap();
    assert_eq!(p.mcf.solve().unwrap(), Status::Optimal);
    assert_eq!(p.cost(), 30);
    assert_eq!(p.arc_flows(), vec![0, 0, 3]);
}

fn err_of(text: &str) -> String {
    dimacs::read(text.as_bytes(), Some(text.len() as u64))
        .unwrap_err()
        .to_string()
}

#[test]
fn malformed_inputs_report_line_and_reason() {
    let cases: &[(&str, &str)] = &[
        ("p min 2 1\na 1 2 0 1\n", "line 2: missing cost"),
        (
            "p min 2 1\na 1 3 0 1 1\n",
            "line 2: arc 1->3: node outside 1..=2",
        ),
        ("c x\np max 2 1\n", "line 2: problem type 'max'"),
        ("a 1 2 0 1 1\n", "line 1: 'a' line before 'p' line"),
        ("p min 2 1\nn 1 x\n", "line 2: bad supply 'x'"),
        (
            "p min 2 1\na 1 2 0 1 1\na 1 2 0 1 1\n",
            "line 3: more than the 1 arcs",
        ),
        ("p min 2 2\na 1 2 0 1 1\n", "announced 2 arcs, found 1"),
        ("p min 2 1\na 1 2 5 1 1\n", "line 2: need 0 <= LOW <= CAP"),
        ("p min 2 1\nx 1\n", "line 2: unknown line type 'x'"),
        ("p min 2 1\na 1 2 0 1 1 9\n", "line 2: trailing fields"),
        ("p min 2 1\nn 1 1\nn 1 1\n", "line 3: node 1 given twice"),
        (
            "p min 5 99999999\n",
            "line 1: N=5 M=99999999 are implausible",
        ),
        ("p min 99999999999 1\n", "exceed the 2^31 limit"),
        ("", "no 'p min N M' line"),
    ];
    for (text, want) in cases {
        let got = err_of(text);
        assert!(
            got.contains(want),
            "input {text:?}: got '{got}', want '{want}'"
        );
    }
}

#[test]
fn infeasible_file() {
    let text = "p min 2 1\nn 1 5\nn 2 -5\na 1 2 0 3 1\n";
    let mut p = dimacs::read(text.as_bytes(), None).unwrap();
    assert_eq!(p.mcf.solve().unwrap(), Status::Infeasible);
}
