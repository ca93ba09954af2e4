//! The butterfly all-reduce on an in-memory network: FIFO per link (as TCP
//! is), links interleaved at random, members lost at random moments.
use super::*;
use crate::protocol::rng::Rng;
use crate::swarm::allreduce::RingAllReduce;
use crate::swarm::allreduce_testnet::{
    self, assert_done_with_bits, assert_same_bits_in_every_order, four_members, ids_of, inputs,
    run_again_without, Input, Tally, TestMachine,
};
use std::collections::BTreeSet;

/// The shared in-memory network, of butterflies.
type Net = allreduce_testnet::Net<ButterflyAllReduce>;

impl TestMachine for ButterflyAllReduce {
    fn start(op: u64, me: MemberId, members: &[MemberId], sum: &[f32], mbs: u64) -> Self {
        ButterflyAllReduce::new(op, me, members, sum, mbs).unwrap()
    }

    /// Its slice of the node's part, or its reduced part.
    fn needs(&self, m: MemberId) -> bool {
        self.lacks(self.index(m).unwrap())
    }
}

impl Net {
    /// `m` sent all its 2 (n-1) chunks and every one arrived.
    fn all_delivered_from(&self, m: MemberId) -> bool {
        let n = self.nodes.len();
        let sent = self.sent.get(&m).map_or(0, |s| s.len());
        sent == 2 * (n - 1)
            && self
                .links
                .iter()
                .all(|((from, _), q)| *from != m || q.is_empty())
    }
}

/// Whether `node` holds `m`'s slice of the node's own part.
fn has_slice_of(node: &ButterflyAllReduce, m: MemberId) -> bool {
    node.got[node.index(m).unwrap()]
}

/// The bits the butterfly must give: each element summed in member order
/// in f32, divided by the total count.
fn exact(ins: &[Input]) -> Vec<u32> {
    let total: u64 = ins.iter().map(|x| x.2).sum();
    let len = ins[0].1.len();
    (0..len)
        .map(|i| {
            let mut acc = ins[0].1[i];
            for x in &ins[1..] {
                acc += x.1[i];
            }
            (acc / total as f32).to_bits()
        })
        .collect()
}

/// Every one of `members` is done with the same bits: the weighted mean
/// over all of `ins` (lost members included) and their microbatches.
fn assert_done_with_everyone(net: &Net, members: &[MemberId], ins: &[Input]) {
    assert_done_with_bits(net, members, ins, &exact(ins));
}

/// What holds after losses, once everything is delivered and reported:
/// every survivor ends, Done or Lost (for one of `victims`); the Done ones
/// hold the full result; none is Done if a survivor lacks a victim's slice
/// of its part. Returns the number of survivors done.
fn check_survivors(net: &Net, ins: &[Input], victims: &[MemberId], ctx: &str) -> usize {
    let survivors = net.survivors();
    let mut done = Vec::new();
    for m in &survivors {
        match net.outcome(*m) {
            Outcome::Done { .. } => done.push(*m),
            Outcome::Lost { member } => assert!(victims.contains(member), "{ctx}: {m:x}"),
            o => panic!("{ctx}: survivor {m:x} ended {o:?}"),
        }
        // A loss a survivor heard while it needed the lost member's share
        // ends it.
        for v in victims {
            if net.lacked.contains(&(*m, *v)) {
                assert!(!net.is_done(*m), "{ctx}: {m:x} lacked {v:x}'s share");
            }
        }
    }
    assert_done_with_everyone(net, &done, ins);
    let lacking = survivors
        .iter()
        .any(|m| victims.iter().any(|v| !has_slice_of(&net.nodes[m], *v)));
    if lacking {
        assert!(done.is_empty(), "{ctx}: a slice is missing, yet done");
    }
    done.len()
}

#[test]
fn every_member_gets_the_same_weighted_mean() {
    let mut rng = Rng::new(7);
    for n in 1..=9 {
        for len in [0, 1, 2, n - 1, n, 7, 100, 1031] {
            let ins = inputs(&mut rng, n, len);
            let mut net = Net::new(1, &ins);
            net.run(&mut rng);
            assert_done_with_everyone(&net, &ids_of(&ins), &ins);
            assert!(net.nodes.values().all(|b| !b.serving()));
            assert!(net.links.values().all(|q| q.is_empty()));
        }
    }
}

#[test]
fn the_result_does_not_depend_on_delivery_order() {
    let mut rng = Rng::new(11);
    for n in [2, 5, 8] {
        let ins = inputs(&mut rng, n, 333);
        assert_same_bits_in_every_order::<ButterflyAllReduce>(&ins, &ids_of(&ins));
    }
}

#[test]
fn each_member_sends_two_n_minus_one_chunks() {
    let mut rng = Rng::new(3);
    for n in 2..=8usize {
        for len in [0, n / 2, 400] {
            let ins = inputs(&mut rng, n, len);
            let ids = ids_of(&ins);
            // At the start: its slice of every other member's part, in
            // member order.
            let b = ButterflyAllReduce::new(5, ids[1], &ids, &ins[1].1, ins[1].2).unwrap();
            let mut buf = ins[1].1.clone();
            buf.push(ins[1].2 as f32);
            let want: Vec<(MemberId, Message)> = (0..n)
                .filter(|&j| j != 1)
                .map(|j| {
                    let data = buf[b.part(j)].to_vec().into();
                    (
                        ids[j],
                        Message::Chunk {
                            op: 5,
                            step: 0,
                            data,
                        },
                    )
                })
                .collect();
            assert_eq!(b.outbox, want);
            let mut net = Net::new(5, &ins);
            net.run(&mut rng);
            assert_done_with_everyone(&net, &ids, &ins);
            for (i, id) in ids.iter().enumerate() {
                let sent = &net.sent[id];
                assert_eq!(sent.len(), 2 * (n - 1), "n {n}: {sent:?}");
                // One slice and one copy of its reduced part to each other.
                let mut seen = BTreeSet::new();
                let mut elements = 0;
                for (to, m) in sent {
                    let Message::Chunk { step, data, .. } = m else {
                        panic!("{m:?}")
                    };
                    assert!(*step == 0 || *step == 1 + i as u32, "{step}");
                    assert!(to != id && seen.insert((*to, *step)));
                    elements += data.len();
                }
                // Each sends 2 (n-1)/n of the buffer, give or take a part's
                // rounding.
                let l = len + 1;
                assert!(
                    elements.abs_diff(2 * (n - 1) * l / n) <= 2 * n,
                    "{elements}"
                );
            }
        }
    }
}

#[test]
fn two_message_rounds_suffice() {
    let mut rng = Rng::new(4);
    for n in 2..=8usize {
        let ins = inputs(&mut rng, n, 50);
        let mut net = Net::new(2, &ins);
        net.round();
        // Every owner reduced and sent its part; nobody holds all yet.
        for (id, b) in &net.nodes {
            assert!(b.gathered[b.me] && !net.is_done(*id), "n {n}");
        }
        net.round();
        assert!(net.links.values().all(|q| q.is_empty()));
        assert_done_with_everyone(&net, &ids_of(&ins), &ins);
    }
}

#[test]
fn one_member_lost_at_a_random_moment() {
    let mut mixed = 0;
    for n in 3..=8usize {
        let mut tally = Tally::default();
        let mut all_out = 0;
        for seed in 0..300u64 {
            let mut rng = Rng::derive(seed, n as u64);
            let len = rng.below(3 * n as u64 + 40) as usize;
            let ins = inputs(&mut rng, n, len);
            let ids = ids_of(&ins);
            let mut net = Net::new(3, &ins);
            // Anywhere from before the first delivery to after the last.
            for _ in 0..rng.below((n * 2 * (n - 1)) as u64 + 1) {
                net.step(&mut rng);
            }
            let victim = ids[rng.below(n as u64) as usize];
            let delivered = net.all_delivered_from(victim);
            let late = net.kill_now_or_later(&mut rng, victim);
            net.run(&mut rng);
            let ctx = format!("n {n} seed {seed} late {late}");
            let done = check_survivors(&net, &ins, &[victim], &ctx);
            let survivors = n - 1;
            if delivered {
                all_out += 1;
                assert_eq!(done, survivors, "{ctx}: everything from it arrived");
            }
            if !net.lacked.iter().any(|(_, v)| *v == victim) {
                assert_eq!(done, survivors, "{ctx}: nobody needed anything from it");
            }
            tally.add(done, survivors);
        }
        eprintln!("n {n}: {tally:?}, {all_out} after all it sent arrived");
        assert!(tally.all_lost > 0 && tally.all_done > 0, "n {n}: {tally:?}");
        assert!(all_out > 0, "n {n}");
        mixed += tally.mixed;
    }
    assert!(
        mixed > 0,
        "a loss in the all-gather round splits the survivors"
    );
}

#[test]
fn a_loss_before_an_owner_got_the_lost_members_slice_loses_everyone() {
    let (ins, [a, d, b, c]) = four_members();
    for seed in 0..50 {
        let mut rng = Rng::new(seed);
        let mut net = Net::new(6, &ins);
        // Everything arrives but d's messages to b.
        while net.step_where(&mut rng, |from, to| (from, to) != (d, b)) {}
        for m in [a, d, b, c] {
            assert_eq!(net.outcome(m), &Outcome::Running, "waiting for b's part");
        }
        assert!(!has_slice_of(&net.nodes[&b], d));
        assert_eq!(net.links[&(d, b)].len(), 2, "d's slice and its part");
        if seed % 2 == 0 {
            // Every survivor told at once: d's chunks arrive too late.
            net.kill(d);
        } else {
            // d's writes to b never left its machine; news comes late.
            net.links.remove(&(d, b));
            net.kill_later(d);
        }
        net.run(&mut rng);
        for m in [a, b, c] {
            assert_eq!(net.outcome(m), &Outcome::Lost { member: d }, "seed {seed}");
        }
        assert!(!has_slice_of(&net.nodes[&b], d), "nothing from d after");
        assert_eq!(check_survivors(&net, &ins, &[d], "targeted"), 0);
    }
}

#[test]
fn a_loss_after_everything_it_sent_arrived_leaves_everyone_done() {
    let (ins, [a, d, b, c]) = four_members();
    let mut others_running = 0;
    for seed in 0..50 {
        let mut rng = Rng::new(seed);
        let mut net = Net::new(6, &ins);
        assert!(net.run_until(&mut rng, |net| net.all_delivered_from(d)));
        if [a, b, c].iter().any(|m| !net.is_done(*m)) {
            others_running += 1;
        }
        if seed % 2 == 0 {
            net.kill(d);
        } else {
            net.kill_later(d);
        }
        net.run(&mut rng);
        assert_done_with_everyone(&net, &[a, b, c], &ins);
        assert!(net.lacked.is_empty(), "seed {seed}");
    }
    // Mostly the loss came while the others still worked.
    assert!(others_running > 0);
}

#[test]
fn a_loss_after_its_reduced_part_reached_some_splits_the_survivors() {
    let mut runs = 0;
    for n in 3..=7usize {
        for seed in 0..40u64 {
            let mut rng = Rng::derive(seed, 50 + n as u64);
            let len = rng.below(60) as usize;
            let ins = inputs(&mut rng, n, len);
            let ids = ids_of(&ins);
            let d = ids[rng.below(n as u64) as usize];
            let others: Vec<MemberId> = ids.iter().copied().filter(|m| *m != d).collect();
            // A non-empty proper subset of the others misses d's part.
            let mut held = BTreeSet::new();
            while held.is_empty() || held.len() == others.len() {
                held = others
                    .iter()
                    .copied()
                    .filter(|_| rng.below(2) == 0)
                    .collect();
            }
            let mut net = Net::new(7, &ins);
            let open = |from: MemberId, to: MemberId| from != d || !held.contains(&to);
            while net.step_where(&mut rng, open) {}
            // Their slices from d arrive (the first of the two in flight),
            // so that they can reduce; d's reduced part stays behind.
            for h in &held {
                assert_eq!(net.links[&(d, *h)].len(), 2);
                net.step_where(&mut rng, |from, to| (from, to) == (d, *h));
            }
            while net.step_where(&mut rng, open) {}
            let late = rng.below(2) == 0;
            if late {
                // d's last writes never left its machine.
                for h in &held {
                    net.links.remove(&(d, *h));
                }
                net.kill_later(d);
            } else {
                net.kill(d);
            }
            net.run(&mut rng);
            let ctx = format!("n {n} seed {seed} late {late}");
            for m in &others {
                if held.contains(m) {
                    assert_eq!(net.outcome(*m), &Outcome::Lost { member: d }, "{ctx}");
                    let node = &net.nodes[m];
                    assert!(has_slice_of(node, d) && node.needs(d), "{ctx}");
                }
            }
            let done: Vec<MemberId> = others
                .iter()
                .copied()
                .filter(|m| !held.contains(m))
                .collect();
            assert_done_with_everyone(&net, &done, &ins);
            check_survivors(&net, &ins, &[d], &ctx);
            runs += 1;
        }
    }
    assert!(runs > 0);
}

#[test]
fn two_or_more_losses_still_end_every_survivor() {
    let mut tally = Tally::default();
    for n in 4..=8usize {
        for seed in 0..200u64 {
            let mut rng = Rng::derive(seed, 300 + n as u64);
            let len = rng.below(2 * n as u64 + 30) as usize;
            let ins = inputs(&mut rng, n, len);
            let total = (n * 2 * (n - 1)) as u64;
            let mut net = Net::new(4, &ins);
            let losses = 2 + rng.below(n as u64 - 3) as usize;
            let mut victims = Vec::new();
            for _ in 0..losses {
                for _ in 0..rng.below(total + 1) {
                    net.step(&mut rng);
                }
                let rest = net.survivors();
                let v = rest[rng.below(rest.len() as u64) as usize];
                victims.push(v);
                net.kill_now_or_later(&mut rng, v);
            }
            net.run(&mut rng);
            let ctx = format!("n {n} seed {seed} victims {victims:x?}");
            let done = check_survivors(&net, &ins, &victims, &ctx);
            tally.add(done, n - losses);
        }
    }
    eprintln!("{tally:?}");
    assert!(tally.all_lost > 0 && tally.all_done > 0, "{tally:?}");
}

/// Messages to deliver (or sent), with their sender (or receiver).
type Messages = Vec<(MemberId, Message)>;

/// Member `me` (the first of four, part 0 of 7 elements; the others' parts
/// have 8) with nothing received yet, its outbox taken.
fn fresh() -> (ButterflyAllReduce, [MemberId; 4]) {
    let (mut b, ids) = unsent();
    b.take_outbox();
    (b, ids)
}

/// As [`fresh`], its step-0 slices still in the outbox.
fn unsent() -> (ButterflyAllReduce, [MemberId; 4]) {
    let ins = inputs(&mut Rng::new(5), 4, 30);
    let ids = [ins[0].0, ins[1].0, ins[2].0, ins[3].0];
    let b = ButterflyAllReduce::new(4, ids[0], &ids, &ins[0].1, ins[0].2).unwrap();
    assert_eq!(b.outbox.len(), 3);
    assert_eq!(b.part(0).len(), 7);
    assert!((1..4).all(|k| b.part(k).len() == 8));
    (b, ids)
}

fn chunk(step: u32, len: usize) -> Message {
    Message::Chunk {
        op: 4,
        step,
        data: vec![0.25; len].into(),
    }
}

/// What a member holds: the slices of its part it got, the reduced parts
/// and the result's bits.
fn state(b: &ButterflyAllReduce) -> (Vec<bool>, Vec<bool>, Vec<u32>) {
    let bits = b.result.iter().map(|x| x.to_bits()).collect();
    (b.got.clone(), b.gathered.clone(), bits)
}

#[test]
fn a_message_the_protocol_cannot_send_fails_without_adding_anything() {
    let (_, [me, x, y, z]) = fresh();
    let cases: Vec<(Messages, MemberId, &str)> = vec![
        (vec![(x, chunk(0, 8))], x, "8 elements, 7 expected"),
        (
            vec![(x, chunk(0, 7)), (x, chunk(0, 7))],
            x,
            "two chunks of step 0",
        ),
        (vec![(me, chunk(0, 7))], me, "from myself"),
        (vec![(me, chunk(1, 7))], me, "from myself"),
        (vec![(x, chunk(3, 8))], x, "not its owner"),
        (vec![(z, chunk(2, 8))], z, "not its owner"),
        (vec![(y, chunk(3, 7))], y, "7 elements, 8 expected"),
        (
            vec![(y, chunk(3, 8)), (y, chunk(3, 8))],
            y,
            "two chunks of step 3",
        ),
        (vec![(z, chunk(5, 8))], z, "expected steps 0..=4"),
        (vec![(z, chunk(u32::MAX, 8))], z, "expected steps 0..=4"),
        (
            vec![(
                x,
                Message::Resume {
                    op: 4,
                    lost: y,
                    step: 2,
                },
            )],
            x,
            "resume",
        ),
        (vec![(y, Message::Complete { op: 4 })], y, "complete"),
    ];
    for (msgs, offender, why) in cases {
        let (mut b, ids) = fresh();
        let last = msgs.len() - 1;
        let mut before = state(&b);
        for (k, (from, msg)) in msgs.into_iter().enumerate() {
            if k == last {
                b.take_outbox();
                before = state(&b);
            }
            b.on_message(from, msg);
        }
        match b.outcome() {
            Outcome::Failed { reason } => assert!(reason.contains(why), "{why}: {reason}"),
            o => panic!("{why}: {o:?}"),
        }
        // Only aborts, naming the offender, to each other member but it.
        let want: Vec<(MemberId, Message)> = ids
            .iter()
            .copied()
            .filter(|m| *m != me && *m != offender)
            .map(|m| {
                (
                    m,
                    Message::Abort {
                        op: 4,
                        lost: offender,
                    },
                )
            })
            .collect();
        assert_eq!(b.take_outbox(), want, "{why}");
        assert_eq!(state(&b), before, "{why}: something was added");
        // And nothing after the end counts.
        b.on_message(y, chunk(3, 8));
        b.on_message(x, chunk(0, 7));
        assert!(matches!(b.outcome(), Outcome::Failed { .. }));
        assert!(b.take_outbox().is_empty());
        assert_eq!(state(&b), before, "{why}: something was added after");
    }
}

#[test]
fn bad_setups_are_refused() {
    assert_eq!(
        ButterflyAllReduce::new(1, 9, &[1, 2], &[0.0], 1).unwrap_err(),
        SetupError::NotAMember
    );
    assert_eq!(
        ButterflyAllReduce::new(1, 1, &[1, 2, 1], &[0.0], 1).unwrap_err(),
        SetupError::DuplicateMember(1)
    );
    assert_eq!(
        ButterflyAllReduce::new(1, 1, &[1, 2], &[0.0], (1 << 24) + 1).unwrap_err(),
        SetupError::TooManyMicrobatches((1 << 24) + 1)
    );
    assert!(ButterflyAllReduce::new(1, 1, &[1, 2], &[0.0], 1 << 24).is_ok());
}

#[test]
fn a_single_member_is_done_at_once_as_the_ring() {
    for (sum, mbs) in [(vec![1.0, -2.0, -0.0, 3.5], 4), (vec![], 2), (vec![1.0], 0)] {
        let mut b = ButterflyAllReduce::new(3, 7, &[7], &sum, mbs).unwrap();
        assert!(b.take_outbox().is_empty());
        let ring = RingAllReduce::new(3, 7, &[7], &sum, mbs).unwrap();
        assert!(matches!(b.outcome(), Outcome::Done { .. }));
        assert_eq!(
            format!("{:?}", b.outcome()),
            format!("{:?}", ring.outcome())
        );
    }
}

#[test]
fn a_count_of_zero_gives_zeros_as_the_ring() {
    let mut rng = Rng::new(8);
    let mut ins = inputs(&mut rng, 3, 10);
    for x in &mut ins {
        x.2 = 0;
    }
    let mut net = Net::new(1, &ins);
    net.run(&mut rng);
    for id in ids_of(&ins) {
        let want = Outcome::Done {
            mean: vec![0.0; 10],
            microbatches: 0,
        };
        assert_eq!(net.outcome(id), &want);
    }
}

#[test]
fn messages_of_another_op_or_from_non_members_are_ignored() {
    let (mut b, [me, x, ..]) = fresh();
    let before = state(&b);
    let stranger = 3;
    let other_op = Message::Chunk {
        op: 5,
        step: 0,
        data: vec![1e9; 3].into(),
    };
    b.on_message(x, other_op);
    b.on_message(x, Message::Abort { op: 5, lost: x });
    b.on_message(stranger, chunk(0, 7));
    b.on_message(stranger, chunk(9, 1));
    b.on_message(stranger, Message::Abort { op: 4, lost: x });
    b.on_message(stranger, Message::Complete { op: 4 });
    b.on_peer_lost(stranger);
    b.on_peer_lost(me);
    assert_eq!(b.outcome(), &Outcome::Running);
    assert!(b.take_outbox().is_empty());
    assert_eq!(state(&b), before);
    // The same in a whole exchange: stale chunks of an aborted run among
    // the survivors' next run change nothing.
    let mut rng = Rng::new(99);
    let ins = inputs(&mut rng, 4, 257);
    let (survivors, mut again) = run_again_without::<ButterflyAllReduce>(&mut rng, &ins, ins[1].0);
    for (id, ..) in &survivors {
        let node = again.nodes.get_mut(id).unwrap();
        node.on_message(ins[1].0, Message::Abort { op: 2, lost: *id });
        let stale = Message::Chunk {
            op: 2,
            step: 0,
            data: vec![1e9; 64].into(),
        };
        node.on_message(ins[1].0, stale);
        node.on_message(survivors[0].0, Message::Abort { op: 1, lost: *id });
    }
    again.run(&mut rng);
    assert_done_with_everyone(&again, &ids_of(&survivors), &survivors);
}

#[test]
fn messages_from_a_member_taken_for_lost_are_ignored() {
    let (mut b, [_, x, y, z]) = unsent();
    // x's slice of my part and its reduced part: I need nothing more of x.
    b.on_message(x, chunk(0, 7));
    b.on_message(x, chunk(2, 8));
    b.on_peer_lost(x);
    assert_eq!(b.outcome(), &Outcome::Running);
    // My slice of x's part is not sent to it.
    let to: Vec<MemberId> = b.take_outbox().iter().map(|(to, _)| *to).collect();
    assert_eq!(to, vec![y, z]);
    let before = state(&b);
    // Anything from x, even what would be a violation, changes nothing.
    for msg in [
        chunk(0, 7),
        chunk(2, 8),
        chunk(3, 1),
        Message::Complete { op: 4 },
        Message::Abort { op: 4, lost: y },
    ] {
        b.on_message(x, msg);
        assert_eq!(b.outcome(), &Outcome::Running);
        assert!(b.take_outbox().is_empty());
        assert_eq!(state(&b), before);
    }
    // Reported again: nothing.
    b.on_peer_lost(x);
    assert_eq!(b.outcome(), &Outcome::Running);
    // My reduced part goes to the members not lost, x excepted.
    b.on_message(y, chunk(0, 7));
    b.on_message(z, chunk(0, 7));
    let out = b.take_outbox();
    let to: Vec<MemberId> = out.iter().map(|(to, _)| *to).collect();
    assert_eq!(to, vec![y, z]);
    assert!(out
        .iter()
        .all(|(_, m)| matches!(m, Message::Chunk { step: 1, data, .. } if data.len() == 7)));
    // y is lost before its reduced part came: the end, told to z only.
    b.on_peer_lost(y);
    assert_eq!(b.outcome(), &Outcome::Lost { member: y });
    assert_eq!(
        b.take_outbox(),
        vec![(z, Message::Abort { op: 4, lost: y })]
    );
}

#[test]
fn a_loss_before_the_reduce_scatter_ends_lost_and_aborts_everyone() {
    let (mut b, [_, x, y, z]) = unsent();
    b.on_peer_lost(z);
    assert_eq!(b.outcome(), &Outcome::Lost { member: z });
    let out = b.take_outbox();
    assert_eq!(
        out,
        vec![
            (x, Message::Abort { op: 4, lost: z }),
            (y, Message::Abort { op: 4, lost: z })
        ]
    );
    // After the end, losses and messages change nothing.
    b.on_peer_lost(x);
    b.on_message(y, chunk(0, 7));
    assert_eq!(b.outcome(), &Outcome::Lost { member: z });
    assert!(b.take_outbox().is_empty());
}

#[test]
fn an_abort_ends_the_operation_lost_and_is_not_passed_on() {
    let (mut b, [_, x, y, _]) = fresh();
    b.on_message(x, chunk(0, 7));
    b.on_message(x, Message::Abort { op: 4, lost: y });
    assert_eq!(b.outcome(), &Outcome::Lost { member: y });
    assert!(b.take_outbox().is_empty());
}

#[test]
fn a_done_member_keeps_its_result() {
    let mut rng = Rng::new(12);
    let ins = inputs(&mut rng, 4, 40);
    let ids = ids_of(&ins);
    let mut net = Net::new(1, &ins);
    net.run(&mut rng);
    let b = net.nodes.get_mut(&ids[0]).unwrap();
    let before = b.outcome().clone();
    b.on_peer_lost(ids[1]);
    b.on_message(
        ids[2],
        Message::Abort {
            op: 1,
            lost: ids[3],
        },
    );
    let bad = Message::Chunk {
        op: 1,
        step: 3,
        data: vec![1.0].into(),
    };
    b.on_message(ids[2], bad);
    b.on_message(
        ids[3],
        Message::Resume {
            op: 1,
            lost: ids[1],
            step: 0,
        },
    );
    assert_eq!(b.outcome(), &before);
    assert!(b.take_outbox().is_empty() && !b.serving());
}

/// The simulator's loss rule for the butterfly
/// (`crate::sim::allreduce::butterfly_lacks`) held to the machines: a
/// member lost at a random moment, every survivor told at once. A survivor
/// the rule says lacks something (judged by what had arrived) ends Lost;
/// where it says nobody lacks anything, every survivor ends Done. Where
/// some lack, the simulator fails every survivor still running; a running
/// survivor that lacked nothing may still end Done on the machines when
/// its last parts beat the abort (the simulator is conservative there),
/// counted.
#[test]
fn the_simulators_butterfly_loss_rule_says_what_the_machines_do() {
    use crate::sim::allreduce::butterfly_lacks;
    let (mut nothing, mut aborts, mut conservative) = (0, 0, 0);
    for n in 2..=7usize {
        for seed in 0..300u64 {
            let mut rng = Rng::derive(seed ^ 0xb077, n as u64);
            let len = rng.below(100) as usize;
            let ins = inputs(&mut rng, n, len);
            let ids = ids_of(&ins);
            let mut net = Net::new(8, &ins);
            for _ in 0..rng.below((2 * n * (n - 1)) as u64 + 1) {
                net.step(&mut rng);
            }
            let v = ids[rng.below(n as u64) as usize];
            let vi = net.nodes[&v].index(v).unwrap();
            let lacking: Vec<MemberId> = (ids.iter().copied())
                .filter(|&m| m != v && !net.is_done(m))
                .filter(|m| {
                    let node = &net.nodes[m];
                    butterfly_lacks(has_slice_of(node, v), node.gathered[vi])
                })
                .collect();
            let running: Vec<MemberId> = (ids.iter().copied())
                .filter(|&m| m != v && !net.is_done(m))
                .collect();
            net.kill(v);
            net.run(&mut rng);
            let ctx = format!("n {n} seed {seed}: lacking {lacking:x?}");
            check_survivors(&net, &ins, &[v], &ctx);
            if lacking.is_empty() {
                let done = net.survivors().iter().filter(|m| net.is_done(**m)).count();
                assert_eq!(done, n - 1, "{ctx}: the rule said nothing");
                nothing += 1;
                continue;
            }
            aborts += 1;
            for m in &running {
                if lacking.contains(m) {
                    assert_eq!(net.outcome(*m), &Outcome::Lost { member: v }, "{ctx}");
                } else if net.is_done(*m) {
                    conservative += 1;
                }
            }
        }
    }
    eprintln!("nothing {nothing}, aborts {aborts}, conservative {conservative}");
    assert!(nothing > 0 && aborts > 0, "{nothing} {aborts}");
}
