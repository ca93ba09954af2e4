//! The stage all-reduce between engine nodes over loopback TCP, around the
//! ring and by the butterfly: every member ends with the same bits; a
//! member that dies before the survivors hold what they need of it ends the
//! operation for them within seconds (broken connection, not a timeout),
//! and they finish it again without it; a ring member that dies in the
//! all-gather is bypassed, and a butterfly member that dies after sending
//! everything is not missed: the survivors end with the full result, its
//! contribution in it; a member that sends a malformed chunk is reported,
//! nothing is added.
use gwtf::engine::{NodeOptions, Transport};
use gwtf::protocol::rng::Rng;
use gwtf::swarm::allreduce::{Machine, Message, Outcome, RingAllReduce};
use gwtf::swarm::allreduce_net;
use gwtf::swarm::butterfly::ButterflyAllReduce;
use gwtf::swarm::hierarchy::{self, HierarchicalAllReduce};
use std::time::{Duration, Instant};

const KEY: &[u8] = b"0123456789abcdef-allreduce-test-key";
const STAGE: u32 = 3;
const T: Duration = Duration::from_secs(30);

/// `n` nodes, each connected to every other.
fn mesh(n: usize) -> Vec<Transport> {
    mesh_where(n, 64 << 20, Duration::from_millis(200), |_, _| true)
}

/// `n` nodes with frame pools of `pool` bytes, `i` connected to `j` where
/// `linked(i, j)` (`i < j`).
/// Heartbeats every `beat` (the peer timeout is 100 of them).
fn mesh_where(
    n: usize,
    pool: usize,
    beat: Duration,
    linked: impl Fn(usize, usize) -> bool,
) -> Vec<Transport> {
    let nodes: Vec<Transport> = (0..n)
        .map(|_| {
            Transport::new(NodeOptions {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                swarm_key: KEY.to_vec(),
                max_payload: (16 << 20).min(pool as u64 / 2),
                pool_bytes: pool,
                heartbeat_interval: beat,
                peer_timeout: beat * 100,
                max_connections_per_address: 1024,
                max_handshakes_per_address: 256,
                ..NodeOptions::default()
            })
            .unwrap()
        })
        .collect();
    let mut want = vec![0; n];
    for i in 0..n {
        for j in i + 1..n {
            if linked(i, j) {
                nodes[i]
                    .connect_wait(nodes[j].local_addr().unwrap(), T)
                    .unwrap();
                want[i] += 1;
                want[j] += 1;
            }
        }
    }
    let deadline = Instant::now() + 4 * T;
    while (nodes.iter().zip(&want)).any(|(x, w)| x.peers().len() < *w) {
        assert!(Instant::now() < deadline, "mesh not connected");
        std::thread::sleep(Duration::from_millis(10));
    }
    nodes
}

fn contribution(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..len)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
        .collect()
}

/// Member `me`'s side of operation `op` among `members` with its
/// contribution: a ring's or a butterfly's.
type Make<M> = fn(u64, u64, &[u64], &[f32], u64) -> M;

fn ring(op: u64, me: u64, members: &[u64], sum: &[f32], mbs: u64) -> RingAllReduce {
    RingAllReduce::new(op, me, members, sum, mbs).unwrap()
}

fn butterfly(op: u64, me: u64, members: &[u64], sum: &[f32], mbs: u64) -> ButterflyAllReduce {
    ButterflyAllReduce::new(op, me, members, sum, mbs).unwrap()
}

/// Runs operation `op` among `members` (machines made by `make`, a ring in
/// the members' order) on every given node at once.
fn run_members<M: Machine>(
    make: Make<M>,
    nodes: &[&Transport],
    members: &[u64],
    op: u64,
    inputs: &[(Vec<f32>, u64)],
) -> Vec<Outcome> {
    std::thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .zip(inputs)
            .map(|(node, (sum, mbs))| {
                s.spawn(move || {
                    let r = make(op, node.node_id(), members, sum, *mbs);
                    allreduce_net::run(node, STAGE, r, Instant::now() + T).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs one operation among exactly the given nodes.
fn all_reduce<M: Machine>(
    make: Make<M>,
    nodes: &[&Transport],
    op: u64,
    inputs: &[(Vec<f32>, u64)],
) -> Vec<Outcome> {
    let ids: Vec<u64> = nodes.iter().map(|x| x.node_id()).collect();
    run_members(make, nodes, &ids, op, inputs)
}

fn weighted_mean(inputs: &[(Vec<f32>, u64)]) -> Vec<f64> {
    let total: u64 = inputs.iter().map(|x| x.1).sum();
    (0..inputs[0].0.len())
        .map(|i| inputs.iter().map(|x| x.0[i] as f64).sum::<f64>() / total as f64)
        .collect()
}

fn assert_identical_and_right(outcomes: &[Outcome], inputs: &[(Vec<f32>, u64)]) {
    let want = weighted_mean(inputs);
    let Outcome::Done { mean, microbatches } = &outcomes[0] else {
        panic!("{:?}", outcomes[0]);
    };
    assert_eq!(*microbatches, inputs.iter().map(|x| x.1).sum::<u64>());
    for (g, w) in mean.iter().zip(&want) {
        assert!((*g as f64 - w).abs() < 1e-5, "{g} vs {w}");
    }
    for o in outcomes {
        let Outcome::Done { mean: m, .. } = o else {
            panic!("{o:?}")
        };
        assert!(m.iter().zip(mean).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// Four members reduce a large buffer to identical bits, the weighted
/// mean; each sent 2(n-1)/n of the buffer, not the whole buffer n times
/// (a butterfly: its slices, then its reduced part to each other member).
fn four_members_reduce_a_large_buffer<M: Machine>(make: Make<M>, seed: u64) {
    let nodes = mesh(4);
    let refs: Vec<&Transport> = nodes.iter().collect();
    let inputs: Vec<(Vec<f32>, u64)> = (0..4)
        .map(|k| (contribution(seed + k, 1_000_003), k + 1))
        .collect();
    let out = all_reduce(make, &refs, 1, &inputs);
    assert_identical_and_right(&out, &inputs);
    let sent: u64 = nodes[0].stats().bytes_sent;
    let buffer = 4 * 1_000_004u64;
    assert!(
        sent < buffer * 2,
        "member 0 sent {sent} bytes for a {buffer}-byte buffer"
    );
}

#[test]
fn four_members_reduce_a_large_buffer_to_identical_bits() {
    four_members_reduce_a_large_buffer(ring, 0);
}

#[test]
fn a_butterfly_of_four_reduces_a_large_buffer_to_identical_bits() {
    four_members_reduce_a_large_buffer(butterfly, 30);
}

/// Runs operation `op` among all of `nodes` (ring in their order, one
/// input each) but member `v`, which plays its part with `victim` (its
/// node, its side of the operation), waits `linger` for its last frames to
/// leave, and is gone (taken out of `nodes`). The survivors run it to its
/// end: their outcomes, and how long they took.
fn run_with_a_victim<M: Machine>(
    make: Make<M>,
    nodes: &mut Vec<Transport>,
    op: u64,
    inputs: &[(Vec<f32>, u64)],
    v: usize,
    victim: impl FnOnce(&Transport, &mut M) + Send,
    linger: Duration,
) -> (Vec<Outcome>, Duration) {
    let ids: Vec<u64> = nodes.iter().map(|x| x.node_id()).collect();
    let victim_node = nodes.remove(v);
    let survivors: Vec<&(Vec<f32>, u64)> = (0..inputs.len())
        .filter(|&k| k != v)
        .map(|k| &inputs[k])
        .collect();
    let t0 = Instant::now();
    let outcomes = std::thread::scope(|s| {
        let ring = &ids;
        s.spawn(move || {
            let (sum, mbs) = &inputs[v];
            let mut r = make(op, victim_node.node_id(), ring, sum, *mbs);
            victim(&victim_node, &mut r);
            std::thread::sleep(linger);
            drop(victim_node);
        });
        let handles: Vec<_> = nodes
            .iter()
            .zip(survivors)
            .map(|(node, (sum, mbs))| {
                s.spawn(move || {
                    let r = make(op, node.node_id(), ring, sum, *mbs);
                    allreduce_net::run(node, STAGE, r, Instant::now() + T).unwrap()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    (outcomes, t0.elapsed())
}

/// Sends what `r` asks to send, from `node`.
fn send_outbox(node: &Transport, r: &mut impl Machine) -> Vec<Message> {
    let mut sent = Vec::new();
    for (to, msg) in r.take_outbox() {
        let f = allreduce_net::frame_of(node, STAGE, &msg, T).unwrap();
        node.send(to, f, T).unwrap();
        sent.push(msg);
    }
    sent
}

/// `node` plays its part of `r` (sends what it asks, feeds it what comes)
/// until `stop` says so (given what the last round sent).
fn take_part_until<M: Machine>(node: &Transport, r: &mut M, stop: impl Fn(&[Message], &M) -> bool) {
    let deadline = Instant::now() + T;
    loop {
        let sent = send_outbox(node, r);
        if stop(&sent, r) {
            return;
        }
        assert!(Instant::now() < deadline, "the victim got stuck");
        if let Ok(f) = node.recv(Duration::from_millis(20)) {
            if let Some(Ok(msg)) = allreduce_net::message_of(STAGE, &f) {
                r.on_message(f.peer(), msg);
            }
        }
    }
}

/// Member 2 of four plays its first sends (a ring's first chunk, a
/// butterfly's slices) and its process is gone: every survivor still needs
/// something only it had and ends Lost within seconds (the broken
/// connection, not a timeout); they finish again without it, with a new
/// operation id.
fn a_member_that_dies_mid_way<M: Machine>(make: Make<M>, seed: u64) {
    let mut nodes = mesh(4);
    let ids: Vec<u64> = nodes.iter().map(|x| x.node_id()).collect();
    let inputs: Vec<(Vec<f32>, u64)> = (0..4)
        .map(|k| (contribution(seed + k, 50_000), 2))
        .collect();
    let first_sends = |node: &Transport, r: &mut M| {
        send_outbox(node, r);
    };
    let linger = Duration::from_millis(50);
    let (outcomes, took) = run_with_a_victim(make, &mut nodes, 7, &inputs, 2, first_sends, linger);
    for o in &outcomes {
        assert_eq!(o, &Outcome::Lost { member: ids[2] });
    }
    assert!(
        took < Duration::from_secs(5),
        "the loss took {took:?} to notice"
    );
    let survivors_inputs: Vec<(Vec<f32>, u64)> = [0, 1, 3].map(|k| inputs[k].clone()).to_vec();
    let refs: Vec<&Transport> = nodes.iter().collect();
    let again = all_reduce(make, &refs, 8, &survivors_inputs);
    assert_identical_and_right(&again, &survivors_inputs);
}

#[test]
fn a_member_that_dies_mid_way_ends_it_for_the_survivors_who_finish_without_it() {
    a_member_that_dies_mid_way(ring, 10);
}

/// The victim sends its slices and is gone before it could send its
/// reduced part: every survivor lacks it.
#[test]
fn a_butterfly_member_that_dies_mid_way_ends_it_for_the_survivors_who_finish_without_it() {
    a_member_that_dies_mid_way(butterfly, 40);
}

#[test]
fn a_malformed_chunk_is_refused_and_reported_as_its_senders_loss() {
    let nodes = mesh(3);
    let ids: Vec<u64> = nodes.iter().map(|x| x.node_id()).collect();
    // The bad member sends its right neighbour a chunk of the wrong length.
    let (bad, right) = (0, ids[1]);
    let mut f = nodes[bad].alloc(12, T).unwrap();
    f.header.stage = STAGE;
    f.header.microbatch = 3;
    f.header.dtype = gwtf::wire::Dtype::F32 as u16;
    f.header.ndim = 1;
    f.header.shape = [3, 0, 0, 0];
    nodes[bad].send(right, f, T).unwrap();
    let honest: Vec<&Transport> = nodes.iter().filter(|x| x.node_id() != ids[0]).collect();
    let ones: Vec<(Vec<f32>, u64)> = honest.iter().map(|_| (vec![1.0; 1000], 1)).collect();
    let outcomes = run_members(ring, &honest, &ids, 3, &ones);
    for (node, o) in honest.iter().zip(&outcomes) {
        if node.node_id() == right {
            assert!(
                matches!(o, Outcome::Failed { reason } if reason.contains("elements")),
                "{o:?}"
            );
        } else {
            assert_eq!(o, &Outcome::Lost { member: ids[0] });
        }
    }
}

/// The victim takes part until it has sent its successor its reduced chunk
/// (wire step n-1, the all-gather's first), then its process is gone: the
/// survivors finish without it, within seconds, with the full ring's
/// result (the victim's gradients and microbatches in it), bit-identical.
#[test]
fn a_member_that_dies_in_the_all_gather_is_bypassed_and_its_gradients_kept() {
    let n = 4;
    let mut nodes = mesh(n);
    let inputs: Vec<(Vec<f32>, u64)> = (0..n as u64)
        .map(|k| (contribution(20 + k, 200_003), k + 1))
        .collect();
    let until_reduced_chunk_sent = |node: &Transport, r: &mut RingAllReduce| {
        let all_gather_start = n as u32 - 1;
        take_part_until(node, r, |sent, _| {
            sent.iter()
                .any(|m| matches!(m, Message::Chunk { step, .. } if *step == all_gather_start))
        });
    };
    // Its last frames leave its machine before the process is gone.
    let linger = Duration::from_millis(200);
    let (outcomes, took) = run_with_a_victim(
        ring,
        &mut nodes,
        9,
        &inputs,
        1,
        until_reduced_chunk_sent,
        linger,
    );
    // Everyone's contribution, the victim's included.
    assert_identical_and_right(&outcomes, &inputs);
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// The victim takes part until it holds the result (its slices and its
/// reduced part sent), then its process is gone: nobody needs anything
/// more of it, and the survivors end with the full result, its gradients
/// and microbatches in it, bit-identical.
#[test]
fn a_butterfly_member_that_dies_after_sending_everything_is_not_missed() {
    let n = 4;
    let mut nodes = mesh(n);
    let inputs: Vec<(Vec<f32>, u64)> = (0..n as u64)
        .map(|k| (contribution(50 + k, 200_003), k + 1))
        .collect();
    let until_done = |node: &Transport, r: &mut ButterflyAllReduce| {
        take_part_until(node, r, |_, r| matches!(r.outcome(), Outcome::Done { .. }));
    };
    // Its last frames leave its machine before the process is gone.
    let linger = Duration::from_millis(200);
    let (outcomes, took) =
        run_with_a_victim(butterfly, &mut nodes, 9, &inputs, 1, until_done, linger);
    assert_identical_and_right(&outcomes, &inputs);
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

fn hierarchy_of_64(
    op: u64,
    me: u64,
    members: &[u64],
    sum: &[f32],
    mbs: u64,
) -> HierarchicalAllReduce {
    HierarchicalAllReduce::new(op, me, members, sum, mbs, 64).unwrap()
}

/// A stage too large for one butterfly: 256 members in four groups of 64
/// (connected only where the hierarchy sends: within a group, and along
/// the columns) reduce a small buffer over loopback TCP to identical bits,
/// the weighted mean. It prints its time beside a 64-member butterfly's
/// of the same buffer on the same machine (the figure: the time
/// should grow with the rounds, not with the members; a flat ring of 256
/// would pay 510 sequential steps).
#[test]
fn a_hierarchy_of_256_members_reduces_over_tcp_to_identical_bits() {
    let len = 4096;
    let timed = |n: usize, hier: bool| {
        let groups = hierarchy::groups(n, 64);
        let place = |i: usize| {
            let g = groups.iter().position(|r| r.contains(&i)).unwrap();
            (g, i - groups[g].start)
        };
        let t0 = Instant::now();
        // Few heartbeats: 256 nodes' thousands of links would keep two
        // cores busy with them.
        let nodes = mesh_where(n, 4 << 20, Duration::from_secs(5), |i, j| {
            let ((gi, pi), (gj, pj)) = (place(i), place(j));
            !hier || gi == gj || pi == pj
        });
        eprintln!("{n} nodes connected in {:?}", t0.elapsed());
        let refs: Vec<&Transport> = nodes.iter().collect();
        let inputs: Vec<(Vec<f32>, u64)> = (0..n as u64)
            .map(|k| (contribution(500 + k, len), 1 + k % 3))
            .collect();
        let start = Instant::now();
        let out = if hier {
            all_reduce(hierarchy_of_64, &refs, 11, &inputs)
        } else {
            all_reduce(butterfly, &refs, 11, &inputs)
        };
        let took = start.elapsed();
        assert_identical_and_right(&out, &inputs);
        took
    };
    let flat = timed(64, false);
    let hier = timed(256, true);
    eprintln!(
        "all-reduce of {len} f32 over loopback TCP: butterfly of 64 {flat:?}, \
         hierarchy of 256 {hier:?}, ratio {:.2}",
        hier.as_secs_f64() / flat.as_secs_f64()
    );
}
