//! The ring all-reduce on an in-memory network: FIFO per link (as TCP is),
//! links interleaved at random, members lost at random moments.
use super::*;
use crate::protocol::rng::Rng;
use std::collections::{BTreeSet, VecDeque};

/// Members and the links between them.
struct Net {
    nodes: BTreeMap<MemberId, RingAllReduce>,
    /// (from, to) -> messages in flight, in order.
    links: BTreeMap<(MemberId, MemberId), VecDeque<Message>>,
    dead: BTreeSet<MemberId>,
}

impl Net {
    fn new(op: u64, inputs: &[(MemberId, Vec<f32>, u64)]) -> Net {
        let ids: Vec<MemberId> = inputs.iter().map(|x| x.0).collect();
        let mut net = Net {
            nodes: BTreeMap::new(),
            links: BTreeMap::new(),
            dead: BTreeSet::new(),
        };
        for (id, sum, mbs) in inputs {
            let r = RingAllReduce::new(op, *id, &ids, sum, *mbs).unwrap();
            net.nodes.insert(*id, r);
        }
        net.collect();
        net
    }

    fn collect(&mut self) {
        for (&id, node) in self.nodes.iter_mut() {
            for (to, msg) in node.take_outbox() {
                self.links.entry((id, to)).or_default().push_back(msg);
            }
        }
    }

    /// Delivers one message of a random non-empty link; false when none is left.
    fn step(&mut self, rng: &mut Rng) -> bool {
        let busy: Vec<(MemberId, MemberId)> = self
            .links
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(k, _)| *k)
            .collect();
        if busy.is_empty() {
            return false;
        }
        let (from, to) = busy[rng.below(busy.len() as u64) as usize];
        let msg = self
            .links
            .get_mut(&(from, to))
            .unwrap()
            .pop_front()
            .unwrap();
        if !self.dead.contains(&to) {
            self.nodes.get_mut(&to).unwrap().on_message(from, msg);
            self.collect();
        }
        true
    }

    /// `id` crashes: what it sent may still arrive (it is in the kernel's
    /// buffers); every survivor is then told it is gone.
    fn kill(&mut self, id: MemberId) {
        self.dead.insert(id);
        self.links.retain(|(_, to), _| *to != id);
        let survivors: Vec<MemberId> = self
            .nodes
            .keys()
            .copied()
            .filter(|m| !self.dead.contains(m))
            .collect();
        for m in survivors {
            self.nodes.get_mut(&m).unwrap().on_peer_lost(id);
        }
        self.collect();
    }

    fn run(&mut self, rng: &mut Rng) {
        let mut budget = 1_000_000;
        while self.step(rng) {
            budget -= 1;
            assert!(budget > 0, "the exchange does not end");
        }
    }

    fn outcome(&self, id: MemberId) -> &Outcome {
        self.nodes[&id].outcome()
    }
}

fn inputs(rng: &mut Rng, n: usize, len: usize) -> Vec<(MemberId, Vec<f32>, u64)> {
    (0..n)
        .map(|k| {
            let id = 1000 + rng.below(1 << 40) * 16 + k as u64;
            let sum = (0..len)
                .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
                .collect();
            (id, sum, 1 + rng.below(4))
        })
        .collect()
}

/// The weighted mean in f64.
fn reference(inputs: &[(MemberId, Vec<f32>, u64)]) -> Vec<f64> {
    let total: u64 = inputs.iter().map(|x| x.2).sum();
    let len = inputs[0].1.len();
    (0..len)
        .map(|i| inputs.iter().map(|x| x.1[i] as f64).sum::<f64>() / total as f64)
        .collect()
}

fn assert_done_and_identical(net: &Net, ins: &[(MemberId, Vec<f32>, u64)]) {
    let want = reference(ins);
    let total: u64 = ins.iter().map(|x| x.2).sum();
    let first = net.outcome(ins[0].0).clone();
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
    for (id, ..) in ins {
        let o = net.outcome(*id);
        let Outcome::Done { mean: m, .. } = o else {
            panic!("{id:x}: {o:?}")
        };
        let same = m.iter().zip(mean).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{id:x} holds different bits");
    }
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
        }
    }
}

#[test]
fn the_result_does_not_depend_on_delivery_order() {
    let mut rng = Rng::new(11);
    let ins = inputs(&mut rng, 5, 333);
    let mut bits: Option<Vec<u32>> = None;
    for seed in 0..20 {
        let mut net = Net::new(9, &ins);
        net.run(&mut Rng::new(seed));
        let Outcome::Done { mean, .. } = net.outcome(ins[2].0) else {
            panic!()
        };
        let b: Vec<u32> = mean.iter().map(|x| x.to_bits()).collect();
        match &bits {
            None => bits = Some(b),
            Some(prev) => assert_eq!(prev, &b, "delivery order {seed} changed the result"),
        }
    }
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

#[test]
fn a_member_lost_mid_way_ends_the_operation_for_every_survivor() {
    for seed in 0..200u64 {
        let mut rng = Rng::new(seed);
        let n = 2 + rng.below(5) as usize;
        let len = 50 + rng.below(200) as usize;
        let ins = inputs(&mut rng, n, len);
        let mut net = Net::new(3, &ins);
        // Deliver a random number of messages, then kill a random member.
        for _ in 0..rng.below(4 * n as u64) {
            net.step(&mut rng);
        }
        let victim = ins[rng.below(n as u64) as usize].0;
        net.kill(victim);
        net.run(&mut rng);
        let mut done = Vec::new();
        for (id, ..) in &ins {
            if *id == victim {
                continue;
            }
            match net.outcome(*id) {
                Outcome::Lost { member } => assert_eq!(*member, victim, "seed {seed}"),
                Outcome::Done { mean, .. } => done.push(mean.clone()),
                o => panic!("seed {seed}: survivor {id:x} ended {o:?}"),
            }
        }
        // A survivor may have finished before the loss; all that finished
        // hold the same bits (the stage coordinator decides what is applied).
        for d in &done {
            assert!(d
                .iter()
                .zip(&done[0])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}

#[test]
fn the_survivors_run_it_again_without_the_lost_member() {
    let mut rng = Rng::new(99);
    let ins = inputs(&mut rng, 4, 257);
    let mut net = Net::new(1, &ins);
    net.step(&mut rng);
    net.kill(ins[1].0);
    net.run(&mut rng);
    let survivors: Vec<_> = ins.iter().filter(|x| x.0 != ins[1].0).cloned().collect();
    // Late chunks of the aborted operation are ignored by the new one.
    let mut again = Net::new(2, &survivors);
    for (id, ..) in &survivors {
        let stale = Message::Chunk {
            op: 1,
            step: 0,
            data: vec![1e9; 64],
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
                data: vec![0.0; 3],
            },
            "elements",
        ),
        (
            right,
            Message::Chunk {
                op: 4,
                step: 0,
                data: vec![0.0; 10],
            },
            "not the ring neighbour",
        ),
        (
            left,
            Message::Chunk {
                op: 4,
                step: 9,
                data: vec![0.0; 10],
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
        data: vec![0.0; 10],
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
            data: vec![0.0; 3],
        },
    );
    assert_eq!(r.outcome(), &Outcome::Running);
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
