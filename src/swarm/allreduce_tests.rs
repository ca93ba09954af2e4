//! The ring all-reduce on an in-memory network: FIFO per link (as TCP is),
//! links interleaved at random, members lost at random moments.
use super::*;
use crate::protocol::rng::Rng;
use crate::swarm::allreduce_testnet::{
    self, assert_same_bits_in_every_order, four_members, inputs, reference, run_again_without,
    Input, TestMachine,
};
use std::collections::BTreeSet;

/// The shared in-memory network, of rings.
type Net = allreduce_testnet::Net<RingAllReduce>;

impl TestMachine for RingAllReduce {
    fn start(op: u64, me: MemberId, members: &[MemberId], sum: &[f32], mbs: u64) -> Self {
        RingAllReduce::new(op, me, members, sum, mbs).unwrap()
    }

    /// A ring member needs every other until its end: any loss it hears
    /// of while running counts.
    fn needs(&self, _: MemberId) -> bool {
        true
    }
}

fn assert_done_and_identical(net: &Net, ins: &[Input]) {
    let all: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
    assert_done_with_everyone(net, &all, ins);
}

/// Every one of `members` is done with bit-identical means: the weighted
/// mean over all of `ins` (lost members included) and their microbatches.
fn assert_done_with_everyone(net: &Net, members: &[MemberId], ins: &[Input]) {
    let want = reference(ins);
    let total: u64 = ins.iter().map(|x| x.2).sum();
    let first = net.outcome(members[0]).clone();
    let Outcome::Done { mean, microbatches } = &first else {
        panic!("member did not finish: {first:?}");
    };
    assert_eq!(*microbatches, total);
    for (got, want) in mean.iter().zip(&want) {
        assert!(
            (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()) * ins.len() as f64,
            "{got} vs {want}"
        );
    }
    for id in members {
        let o = net.outcome(*id);
        let Outcome::Done { mean: m, .. } = o else {
            panic!("{id:x}: {o:?}")
        };
        let same = m.iter().zip(mean).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{id:x} holds different bits");
    }
}

/// Messages of a full exchange among `n`: 2(n-1) chunks per member, and
/// one complete notice per member from three members on.
fn messages_of_exchange(n: usize) -> u64 {
    let notices = if n >= 3 { n } else { 0 };
    (n * 2 * (n - 1) + notices) as u64
}

#[test]
fn every_member_gets_the_same_weighted_mean() {
    let mut rng = Rng::new(7);
    for n in [1, 2, 3, 5, 8] {
        for len in [0, 1, 3, 7, 100, 1031] {
            let ins = inputs(&mut rng, n, len);
            let mut net = Net::new(1, &ins);
            net.run(&mut rng);
            assert_done_and_identical(&net, &ins);
            // Every member heard its right-right neighbour is complete:
            // none is left serving.
            assert!(net.nodes.values().all(|m| !m.serving()), "n {n}");
        }
    }
}

#[test]
fn the_result_does_not_depend_on_delivery_order() {
    let mut rng = Rng::new(11);
    let ins = inputs(&mut rng, 5, 333);
    assert_same_bits_in_every_order::<RingAllReduce>(&ins, &[ins[2].0]);
}

#[test]
fn each_member_sends_two_n_minus_one_chunks() {
    let mut rng = Rng::new(3);
    let ins = inputs(&mut rng, 4, 400);
    let ids: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
    let mut r = RingAllReduce::new(5, ids[0], &ids, &ins[0].1, ins[0].2).unwrap();
    // Only the first chunk can go before anything arrived: 1/4 of the buffer
    // (400 gradients and the count, so 100 or 101 elements).
    let out = r.take_outbox();
    assert_eq!(out.len(), 1);
    let Message::Chunk { step, data, .. } = &out[0].1 else {
        panic!()
    };
    assert_eq!(*step, 0);
    assert!((100..=101).contains(&data.len()), "{}", data.len());
    let mut net = Net::new(5, &ins);
    net.run(&mut rng);
    assert_done_and_identical(&net, &ins);
    for node in net.nodes.values() {
        assert_eq!(node.next_send, 2 * 3, "each member sends 2(n-1) chunks");
    }
}

/// How runs with one loss ended.
#[derive(Debug, Default)]
struct Tally {
    /// Every survivor lost.
    aborted: u32,
    /// Every survivor done, the victim's successor served by a Resume.
    resumed: u32,
    /// Every survivor done, the loss known to some while running but no
    /// Resume needed (the successor already had every chunk).
    bypassed: u32,
    /// Every survivor done before it heard of the loss.
    unaffected: u32,
}

#[test]
fn a_member_lost_after_its_successor_got_all_gather_step_0_is_bypassed_and_before_it_aborts_all() {
    for n in 2..=7usize {
        let mut tally = Tally::default();
        for seed in 0..400u64 {
            let mut rng = Rng::derive(seed, n as u64);
            let len = rng.below(120) as usize;
            let ins = inputs(&mut rng, n, len);
            let ids: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
            let mut net = Net::new(3, &ins);
            // Kill anywhere from before the first delivery to after the last.
            for _ in 0..rng.below(messages_of_exchange(n) + 1) {
                net.step(&mut rng);
            }
            let v = rng.below(n as u64) as usize;
            let victim = ids[v];
            let successor = ids[(v + 1) % n];
            let had_step_0 = net.nodes[&successor].next_recv >= n as u32;
            let done_before: BTreeSet<MemberId> =
                ids.iter().copied().filter(|m| net.is_done(*m)).collect();
            let late = net.kill_now_or_later(&mut rng, victim);
            net.run(&mut rng);
            let ctx = format!("n {n} seed {seed} late {late}");
            let survivors = net.survivors();
            for m in &survivors {
                match net.outcome(*m) {
                    Outcome::Done { .. } => {}
                    Outcome::Lost { member } => assert_eq!(*member, victim, "{ctx}"),
                    o => panic!("{ctx}: survivor {m:x} ended {o:?}"),
                }
            }
            let done = survivors.iter().filter(|m| net.is_done(**m)).count();
            if n == 2 {
                // Two members: nothing to bypass. The survivor is done only
                // if it finished before it heard of the loss.
                assert!(net.nodes.values().all(|r| r.bypassed.is_none()), "{ctx}");
                let heard = net.lacked.contains(&(survivors[0], victim));
                assert_eq!(done == 1, !heard, "{ctx}");
                if !late {
                    assert_eq!(done == 1, done_before.contains(&survivors[0]), "{ctx}");
                }
            }
            if n >= 3 && !late {
                // The rule, when every survivor hears of the loss at once.
                assert_eq!(done > 0, had_step_0, "{ctx}");
            }
            if had_step_0 {
                assert_eq!(done, survivors.len(), "{ctx}: the successor had step 0");
            }
            if done == 0 {
                tally.aborted += 1;
                continue;
            }
            // No mix of done and lost, and the victim's share is in.
            assert_eq!(
                done,
                survivors.len(),
                "{ctx}: some survivors done, some lost"
            );
            assert_done_with_everyone(&net, &survivors, &ins);
            if net.nodes.values().any(|r| r.serve.is_some()) {
                tally.resumed += 1;
            } else if survivors
                .iter()
                .any(|m| net.nodes[m].bypassed == Some(victim))
            {
                tally.bypassed += 1;
            } else {
                tally.unaffected += 1;
            }
        }
        eprintln!("n {n}: {tally:?}");
        assert!(tally.aborted > 0, "n {n}: {tally:?}");
        assert!(tally.unaffected > 0, "n {n}: {tally:?}");
        if n >= 3 {
            assert!(tally.resumed > 0, "n {n}: {tally:?}");
            assert!(tally.bypassed > 0, "n {n}: {tally:?}");
        }
    }
}

#[test]
fn a_loss_just_after_the_successor_got_wire_step_n_minus_1_is_bypassed() {
    let (ins, [p, d, q, r]) = four_members();
    for seed in 0..50 {
        let mut rng = Rng::new(seed);
        let mut net = Net::new(6, &ins);
        assert!(net.run_until(&mut rng, |net| net.nodes[&q].next_recv == 4));
        net.kill(d);
        let resume = Message::Resume {
            op: 6,
            lost: d,
            step: 4,
        };
        assert!(net.links[&(q, p)].contains(&resume), "seed {seed}");
        net.run(&mut rng);
        assert_eq!(net.nodes[&p].serve, Some(6), "p served steps 4 and 5");
        assert_eq!(net.nodes[&q].bypassed, Some(d));
        assert_done_with_everyone(&net, &[p, q, r], &ins);
    }
}

#[test]
fn a_loss_just_before_the_successor_got_wire_step_n_minus_1_aborts_everyone() {
    let (ins, [p, d, q, r]) = four_members();
    let mut in_flight = 0;
    for seed in 0..50 {
        let mut rng = Rng::new(seed);
        let mut net = Net::new(6, &ins);
        assert!(net.run_until(&mut rng, |net| net.nodes[&q].next_recv == 3));
        if net.links.get(&(d, q)).is_some_and(|l| !l.is_empty()) {
            in_flight += 1;
        }
        net.kill(d);
        net.run(&mut rng);
        for m in [p, q, r] {
            assert_eq!(net.outcome(m), &Outcome::Lost { member: d }, "seed {seed}");
        }
        assert_eq!(net.nodes[&p].serve, None);
    }
    // Often step 3 was on its way: it arrived, too late.
    assert!(in_flight > 0);
}

/// p holds every chunk long before q's Resume comes: it ends Done at once
/// (its result waits for nothing) and serves the Resume after.
#[test]
fn the_predecessor_with_every_chunk_ends_and_serves_the_resume_after() {
    let (ins, [p, d, q, r]) = four_members();
    for seed in 0..50 {
        let mut rng = Rng::new(seed);
        let mut net = Net::new(6, &ins);
        assert!(net.run_until(&mut rng, |net| net.nodes[&q].next_recv == 4));
        net.kill_silently(d);
        // d's last writes never left its machine: q waits for them.
        net.links.remove(&(d, q));
        // p may hear of the loss, or learn it only from q's Resume.
        let p_told = seed % 2 == 0;
        if p_told {
            net.tell(p, d);
        }
        net.tell(r, d);
        net.run(&mut rng);
        // q waits for the steps d will never send; p has every chunk.
        assert_eq!(net.nodes[&p].next_recv, 6);
        assert!(net.is_done(p), "seed {seed}");
        assert!(net.nodes[&p].serving(), "q may still ask p");
        assert_eq!(net.outcome(q), &Outcome::Running);
        net.tell(q, d);
        net.run(&mut rng);
        assert_eq!(net.nodes[&p].bypassed, Some(d));
        assert_eq!(net.nodes[&p].serve, Some(6));
        assert!(!net.nodes[&p].serving(), "served");
        assert_done_with_everyone(&net, &[p, q, r], &ins);
    }
}

#[test]
fn a_successor_complete_before_it_hears_of_the_loss_lets_the_predecessor_end() {
    let (ins, [p, d, q, r]) = four_members();
    for seed in 0..50 {
        let mut rng = Rng::new(seed);
        let mut net = Net::new(6, &ins);
        assert!(net.run_until(&mut rng, |net| net.nodes[&p].next_recv == 4));
        // p's last two chunks are held up; q gets all of its own.
        while net.step_where(&mut rng, |from, to| (from, to) != (r, p)) {}
        assert_eq!(net.nodes[&q].next_recv, 6);
        assert_eq!(net.nodes[&p].next_recv, 4);
        net.kill(d);
        // q has nothing to ask for; p must not wait for a Resume.
        let asked = net.links.get(&(q, p)).is_some_and(|l| !l.is_empty());
        assert!(!asked);
        net.run(&mut rng);
        assert_eq!(net.nodes[&p].serve, None);
        assert!(!net.nodes[&p].serving(), "q said it is complete");
        assert_done_with_everyone(&net, &[p, q, r], &ins);
    }
}

#[test]
fn a_loss_reported_late_to_the_successor_still_ends_done() {
    let mut resumed = 0;
    for n in 3..=7usize {
        for seed in 0..40u64 {
            let mut rng = Rng::derive(seed, 100 + n as u64);
            let ins = inputs(&mut rng, n, 80);
            let ids: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
            let v = rng.below(n as u64) as usize;
            let (p, d, q) = (ids[(v + n - 1) % n], ids[v], ids[(v + 1) % n]);
            let mut net = Net::new(8, &ins);
            let at = n as u32 + rng.below(n as u64 - 2) as u32;
            assert!(net.run_until(&mut rng, |net| net.nodes[&q].next_recv == at));
            net.kill_silently(d);
            for m in net.survivors() {
                if m != q {
                    net.tell(m, d);
                }
            }
            // Whatever d had sent reaches q before q hears of the loss.
            net.run(&mut rng);
            assert!(net.links.get(&(d, q)).is_none_or(|l| l.is_empty()));
            let k = net.nodes[&q].next_recv;
            net.tell(q, d);
            if k < 2 * (n as u32 - 1) {
                let resume = Message::Resume {
                    op: 8,
                    lost: d,
                    step: k,
                };
                assert_eq!(net.links[&(q, p)].back(), Some(&resume));
                resumed += 1;
            }
            net.run(&mut rng);
            assert_done_with_everyone(&net, &net.survivors(), &ins);
        }
    }
    assert!(resumed > 0);
}

#[test]
fn a_second_loss_aborts_every_survivor_still_running() {
    // By hand: five members, one bypassed, then another lost.
    let ins = inputs(&mut Rng::new(31), 5, 64);
    let ids: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
    let mut rng = Rng::new(1);
    let mut net = Net::new(2, &ins);
    assert!(net.run_until(&mut rng, |net| net.nodes[&ids[2]].next_recv == 5));
    net.kill(ids[1]);
    assert_eq!(net.nodes[&ids[2]].bypassed, Some(ids[1]));
    net.kill(ids[4]);
    net.run(&mut rng);
    for m in [ids[0], ids[2], ids[3]] {
        assert_eq!(net.outcome(m), &Outcome::Lost { member: ids[4] });
    }
    // At random: whoever heard of both losses while running ends lost;
    // whoever finished first holds the full result.
    let mut all_lost = 0;
    for n in 3..=7usize {
        for seed in 0..200u64 {
            let mut rng = Rng::derive(seed, 200 + n as u64);
            let ins = inputs(&mut rng, n, 40);
            let ids: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
            let mut net = Net::new(4, &ins);
            let total = messages_of_exchange(n);
            for _ in 0..rng.below(total + 1) {
                net.step(&mut rng);
            }
            let a = ids[rng.below(n as u64) as usize];
            let late = net.kill_now_or_later(&mut rng, a);
            for _ in 0..rng.below(total / 2 + 1) {
                net.step(&mut rng);
            }
            let rest = net.survivors();
            let b = rest[rng.below(rest.len() as u64) as usize];
            net.kill(b);
            net.run(&mut rng);
            let ctx = format!("n {n} seed {seed} late {late}");
            let survivors = net.survivors();
            for m in &survivors {
                let both = net.lacked.contains(&(*m, a)) && net.lacked.contains(&(*m, b));
                match net.outcome(*m) {
                    Outcome::Done { .. } => assert!(!both, "{ctx}: {m:x} heard of both"),
                    Outcome::Lost { member } => assert!([a, b].contains(member), "{ctx}"),
                    o => panic!("{ctx}: {m:x} ended {o:?}"),
                }
            }
            let done: Vec<MemberId> = survivors
                .iter()
                .copied()
                .filter(|m| net.is_done(*m))
                .collect();
            if done.is_empty() {
                all_lost += 1;
            } else {
                assert_done_with_everyone(&net, &done, &ins);
            }
        }
    }
    assert!(all_lost > 0);
}

#[test]
fn the_survivors_run_it_again_without_the_lost_member() {
    let mut rng = Rng::new(99);
    let ins = inputs(&mut rng, 4, 257);
    let (survivors, mut again) = run_again_without::<RingAllReduce>(&mut rng, &ins, ins[1].0);
    // Late chunks of the aborted operation are ignored by the new one.
    for (id, ..) in &survivors {
        let stale = Message::Chunk {
            op: 1,
            step: 0,
            data: vec![1e9; 64].into(),
        };
        again.nodes.get_mut(id).unwrap().on_message(ins[1].0, stale);
    }
    again.run(&mut rng);
    assert_done_and_identical(&again, &survivors);
}

#[test]
fn a_chunk_out_of_turn_or_of_the_wrong_size_fails_without_adding_anything() {
    let mut rng = Rng::new(5);
    let ins = inputs(&mut rng, 3, 30);
    let ids: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
    let (left, me, right) = (ids[2], ids[0], ids[1]);
    let mine = ins.iter().find(|x| x.0 == me).unwrap();
    let fresh = || RingAllReduce::new(4, me, &ids, &mine.1, mine.2).unwrap();
    let cases: Vec<(MemberId, Message, &str)> = vec![
        (
            left,
            Message::Chunk {
                op: 4,
                step: 0,
                data: vec![0.0; 3].into(),
            },
            "elements",
        ),
        (
            right,
            Message::Chunk {
                op: 4,
                step: 0,
                data: vec![0.0; 10].into(),
            },
            "not the ring neighbour",
        ),
        (
            left,
            Message::Chunk {
                op: 4,
                step: 9,
                data: vec![0.0; 10].into(),
            },
            "expected steps",
        ),
    ];
    for (from, msg, why) in cases {
        let mut r = fresh();
        r.take_outbox();
        r.on_message(from, msg);
        match r.outcome() {
            Outcome::Failed { reason } => assert!(reason.contains(why), "{reason}"),
            o => panic!("{why}: {o:?}"),
        }
        // The others are told to stop (the offender is reported lost).
        let out = r.take_outbox();
        assert!(out.iter().all(|(_, m)| matches!(m, Message::Abort { .. })));
        assert!(!out.is_empty());
    }
    // The same step twice.
    let mut r = fresh();
    let early = Message::Chunk {
        op: 4,
        step: 1,
        data: vec![0.0; 10].into(),
    };
    r.on_message(left, early.clone());
    assert_eq!(r.outcome(), &Outcome::Running);
    r.on_message(left, early);
    assert!(matches!(r.outcome(), Outcome::Failed { .. }));
    // Another operation's chunk changes nothing.
    let mut r = fresh();
    r.on_message(
        left,
        Message::Chunk {
            op: 5,
            step: 0,
            data: vec![0.0; 3].into(),
        },
    );
    assert_eq!(r.outcome(), &Outcome::Running);
}

/// Member `p` (the first of four) with its receives up to wire step 4
/// done, so that a Resume it accepted would be served at once; its right
/// neighbour `d`, `q` after it, then `r`.
fn predecessor_at_step_5() -> (RingAllReduce, [MemberId; 4]) {
    let (ins, ids) = four_members();
    let [_, _, _, r] = ids;
    let mut p = RingAllReduce::new(6, ids[0], &ids, &ins[0].1, ins[0].2).unwrap();
    for step in 0..5 {
        let len = p.chunk_range(p.recv_chunk(step)).len();
        let data = vec![0.5; len].into();
        p.on_message(r, Message::Chunk { op: 6, step, data });
    }
    assert_eq!(p.next_recv, 5);
    p.take_outbox();
    (p, ids)
}

fn resume(lost: MemberId, step: u32) -> Message {
    Message::Resume { op: 6, lost, step }
}

/// `r` failed for `why`, told the `others` other members to stop (the
/// offender is not told), sent no chunk, and its buffer is still `before`.
fn assert_failed(r: &mut RingAllReduce, why: &str, before: &[f32], others: usize) {
    match r.outcome() {
        Outcome::Failed { reason } => assert!(reason.contains(why), "{why}: {reason}"),
        o => panic!("{why}: {o:?}"),
    }
    let out = r.take_outbox();
    assert_eq!(out.len(), others, "{why}: {out:?}");
    assert!(
        out.iter().all(|(_, m)| matches!(m, Message::Abort { .. })),
        "{why}: {out:?}"
    );
    let same = r
        .buf
        .iter()
        .zip(before)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same && r.buf.len() == before.len(),
        "{why}: the buffer changed"
    );
}

#[test]
fn a_resume_the_protocol_cannot_send_fails_without_serving_anything() {
    // The control: the real one is served at once, steps 4 and 5 with the
    // chunks p sent (or would have sent) at steps 3 and 4.
    let (mut p, [_, d, q, _]) = predecessor_at_step_5();
    p.on_message(q, resume(d, 4));
    let out = p.take_outbox();
    assert_eq!(out.len(), 2, "{out:?}");
    for ((to, m), step) in out.iter().zip([4u32, 5]) {
        let want = p.buf[p.chunk_range(p.send_chunk(step - 1))].to_vec();
        let chunk = Message::Chunk {
            op: 6,
            step,
            data: want.into(),
        };
        assert_eq!((*to, m), (q, &chunk));
    }
    assert_eq!(p.bypassed(), Some(d), "the resume counted as the loss");
    assert_eq!(p.outcome(), &Outcome::Running);

    // Then the ones it cannot send: (messages, the last one's problem).
    let (_, [_, d, q, r]) = four_members();
    let complete = || Message::Complete { op: 6 };
    let cases: Vec<(Vec<(MemberId, Message)>, &str)> = vec![
        // From r, not from d's successor.
        (vec![(r, resume(d, 4))], "whose successor is"),
        // For q, which is not my right neighbour.
        (vec![(q, resume(r, 4))], "not my right neighbour"),
        // Before all-gather step 1, or past the end.
        (vec![(q, resume(d, 3))], "expected steps 4..6"),
        (vec![(q, resume(d, 6))], "expected steps 4..6"),
        (vec![(q, resume(d, 4)), (q, resume(d, 5))], "second resume"),
        (
            vec![(q, complete()), (q, resume(d, 4))],
            "said it was complete",
        ),
        (vec![(r, complete())], "two to my right"),
        (vec![(q, complete()), (q, complete())], "second complete"),
    ];
    for (msgs, why) in cases {
        let (mut p, _) = predecessor_at_step_5();
        // Serving reads the buffer, never writes it.
        let before = p.buf.clone();
        let last = msgs.len() - 1;
        for (k, (from, msg)) in msgs.into_iter().enumerate() {
            if k == last {
                // What the earlier (valid) messages sent is not at issue.
                p.take_outbox();
            }
            p.on_message(from, msg);
        }
        // The offender is not told; with d bypassed, d is not either.
        let others = if p.bypassed().is_some() { 1 } else { 2 };
        assert_failed(&mut p, why, &before, others);
    }
    // A Resume for another member after a bypass: my right neighbour is
    // gone and bypassed, then one comes for q.
    let (mut p, _) = predecessor_at_step_5();
    let before = p.buf.clone();
    p.on_peer_lost(d);
    p.on_message(q, resume(q, 4));
    assert_failed(&mut p, "not my right neighbour", &before, 1);
    // Two members: nothing can be bypassed.
    let ins = inputs(&mut Rng::new(2), 2, 10);
    let ids = [ins[0].0, ins[1].0];
    let mut two = RingAllReduce::new(6, ids[0], &ids, &ins[0].1, ins[0].2).unwrap();
    two.take_outbox();
    let before = two.buf.clone();
    two.on_message(ids[1], resume(ids[1], 2));
    // The offender is the only other member.
    assert_failed(&mut two, "ring of 2", &before, 0);
}

#[test]
fn a_resume_after_another_member_was_lost_is_a_second_loss() {
    // p heard that r is gone; q, which did not yet, asks p to stand in for
    // d: two members are lost, and q is not to blame.
    let (mut p, [_, d, q, r]) = predecessor_at_step_5();
    p.on_peer_lost(r);
    assert_eq!(p.bypassed(), Some(r));
    p.on_message(q, resume(d, 4));
    assert_eq!(p.outcome(), &Outcome::Lost { member: d });
    let out = p.take_outbox();
    assert_eq!(out, vec![(q, Message::Abort { op: 6, lost: d })]);
}

#[test]
fn messages_from_the_bypassed_member_are_ignored() {
    let (mut p, [_, d, q, r]) = predecessor_at_step_5();
    p.on_peer_lost(d);
    assert_eq!(p.bypassed(), Some(d));
    // Anything from d, even what would be a violation, changes nothing.
    let chunk = Message::Chunk {
        op: 6,
        step: 5,
        data: vec![9.0; 3].into(),
    };
    for msg in [chunk, resume(d, 4), Message::Abort { op: 6, lost: q }] {
        p.on_message(d, msg);
        assert_eq!(p.outcome(), &Outcome::Running);
        assert!(p.take_outbox().is_empty());
    }
    // The loss reported again changes nothing; a second one aborts.
    p.on_peer_lost(d);
    assert_eq!(p.outcome(), &Outcome::Running);
    p.on_peer_lost(r);
    assert_eq!(p.outcome(), &Outcome::Lost { member: r });
    assert_eq!(
        p.take_outbox(),
        vec![(q, Message::Abort { op: 6, lost: r })]
    );
}

#[test]
fn bad_setups_are_refused() {
    assert_eq!(
        RingAllReduce::new(1, 9, &[1, 2], &[0.0], 1).unwrap_err(),
        SetupError::NotAMember
    );
    assert_eq!(
        RingAllReduce::new(1, 1, &[1, 2, 1], &[0.0], 1).unwrap_err(),
        SetupError::DuplicateMember(1)
    );
    assert!(RingAllReduce::new(1, 1, &[1, 2], &[0.0], 1 << 25).is_err());
}

/// A member that is done keeps its result whatever comes after: chunks
/// and aborts are ignored, a Resume the protocol cannot send stops its
/// serving (no abort: the others may be done too), a second loss as well.
#[test]
fn a_done_member_keeps_its_result_and_serves_only_what_it_may() {
    let (ins, [p, d, q, r]) = four_members();
    let done_p = || {
        let mut net = Net::new(6, &ins);
        let mut rng = Rng::new(3);
        // Hold q's Complete back: p is done and serving.
        assert!(net.run_until(&mut rng, |net| net.is_done(p)));
        while net.step_where(&mut rng, |from, to| (from, to) != (q, p)) {}
        let mut node = net.nodes.remove(&p).unwrap();
        assert!(node.serving());
        node.take_outbox();
        node
    };
    let result = |n: &RingAllReduce| n.outcome().clone();
    // Chunks and aborts change nothing.
    let mut n = done_p();
    let before = result(&n);
    n.on_message(r, Message::Abort { op: 6, lost: q });
    let len = n.chunk_range(n.recv_chunk(5)).len();
    n.on_message(
        r,
        Message::Chunk {
            op: 6,
            step: 5,
            data: vec![9.0; len].into(),
        },
    );
    assert_eq!(result(&n), before);
    assert!(n.serving() && n.take_outbox().is_empty());
    // A Resume the protocol cannot send: no longer serving, no abort.
    let mut n = done_p();
    n.on_message(r, resume(d, 4));
    assert_eq!(result(&n), before);
    assert!(!n.serving() && n.take_outbox().is_empty());
    // A second loss after a first: no longer serving.
    let mut n = done_p();
    n.on_peer_lost(d);
    assert!(n.serving(), "p waits for q's Resume");
    n.on_peer_lost(r);
    assert!(!n.serving());
    assert_eq!(result(&n), before);
    // The real Resume is served after the end, and then p is through.
    let mut n = done_p();
    n.on_message(q, resume(d, 4));
    let out = n.take_outbox();
    assert_eq!(out.len(), 2, "{out:?}");
    assert!(out.iter().all(|(to, _)| *to == q));
    assert!(!n.serving());
    assert_eq!(result(&n), before);
}

/// The simulator does not run these machines: it times a ring's loss by a
/// rule of its own (`sim::allreduce::RingLoss`). The rule and the machines
/// must agree. Driven on the same members, with a member lost at the same
/// point of its successor's progress (the rule's steps of 1 s mapped to the
/// wire steps the successor received), the rule's `Abort` is exactly every
/// survivor ending Lost, and its `Bypass` or `Nothing` exactly every
/// survivor ending Done.
#[test]
fn the_simulators_ring_loss_rule_says_what_the_machines_do() {
    use crate::sim::allreduce::{LossEffect, RingLoss};
    let mut seen = BTreeSet::new();
    for n in 2..=7usize {
        for seed in 0..300u64 {
            let mut rng = Rng::derive(seed ^ 0x5157, n as u64);
            let len = rng.below(120) as usize;
            let ins = inputs(&mut rng, n, len);
            let ids: Vec<MemberId> = ins.iter().map(|x| x.0).collect();
            let mut net = Net::new(3, &ins);
            for _ in 0..rng.below(messages_of_exchange(n) + 1) {
                net.step(&mut rng);
            }
            let v = rng.below(n as u64) as usize;
            let received = net.nodes[&ids[(v + 1) % n]].next_recv;
            let rule = RingLoss {
                n,
                step: 1.0,
                successor_since: Some(received as f64 + 0.5),
                bypassed_before: false,
                notice: 0.0,
                resume: 0.0,
                bypass_step: 1.0,
            }
            .effect();
            net.kill(ids[v]);
            net.run(&mut rng);
            let survivors = net.survivors();
            let done = survivors.iter().filter(|m| net.is_done(**m)).count();
            let ctx = format!("n {n} seed {seed}: successor had {received} steps, rule {rule:?}");
            match rule {
                LossEffect::Abort => assert_eq!(done, 0, "{ctx}"),
                LossEffect::Nothing | LossEffect::Bypass { .. } => {
                    assert_eq!(done, survivors.len(), "{ctx}")
                }
            }
            seen.insert(match rule {
                LossEffect::Abort => "abort",
                LossEffect::Nothing => "nothing",
                LossEffect::Bypass { .. } => "bypass",
            });
        }
    }
    assert_eq!(seen.len(), 3, "every effect of the rule was met: {seen:?}");
}

/// The mean divided in the gathering buffer is the mean divided into a
/// new one, bit for bit, with a count and without.
#[test]
fn the_mean_in_place_is_the_mean_bit_for_bit() {
    let mut rng = Rng::new(31);
    for count in [0.0f32, 1.0, 3.0, 7.0] {
        let mut reduced: Vec<f32> = (0..1001).map(|_| rng.next_f64() as f32 * 9.0).collect();
        reduced.push(count);
        assert_eq!(done_in_place(reduced.clone()), done_with(&reduced));
    }
    assert_eq!(done_in_place(Vec::new()), done_with(&[]));
}
