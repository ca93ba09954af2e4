//! The hierarchical all-reduce on the in-memory network shared with the
//! ring's and the butterfly's tests: small groups (a thread's
//! [`GROUP_MAX`]), so that a few members make several groups and columns.
use super::*;
use crate::protocol::rng::Rng;
use crate::swarm::allreduce_testnet::{
    self, assert_done_with_bits, assert_same_bits_in_every_order, ids_of, inputs,
    run_again_without, Input, Tally, TestMachine,
};
use std::cell::Cell;

type Net = allreduce_testnet::Net<HierarchicalAllReduce>;

thread_local! {
    /// The group size the tests' machines are set up with.
    static GROUP_MAX: Cell<usize> = const { Cell::new(3) };
}

fn with_groups_of<T>(g: usize, f: impl FnOnce() -> T) -> T {
    let before = GROUP_MAX.with(|c| c.replace(g));
    let out = f();
    GROUP_MAX.with(|c| c.set(before));
    out
}

impl TestMachine for HierarchicalAllReduce {
    fn start(op: u64, me: MemberId, members: &[MemberId], sum: &[f32], mbs: u64) -> Self {
        let g = GROUP_MAX.with(|c| c.get());
        HierarchicalAllReduce::new(op, me, members, sum, mbs, g).unwrap()
    }

    fn needs(&self, lost: MemberId) -> bool {
        HierarchicalAllReduce::needs(self, lost)
    }
}

/// The bits the hierarchy must give with groups of at most `g`: each
/// group's elements summed in member order (f32), the group sums in group
/// order, over the total count.
fn exact(ins: &[Input], g: usize) -> Vec<u32> {
    let total: u64 = ins.iter().map(|x| x.2).sum();
    let len = ins[0].1.len();
    let groups = groups(ins.len(), g);
    (0..len)
        .map(|i| {
            let group_sum = |r: &Range<usize>| {
                let mut acc = ins[r.start].1[i];
                for x in &ins[r.start + 1..r.end] {
                    acc += x.1[i];
                }
                acc
            };
            let mut acc = group_sum(&groups[0]);
            for r in &groups[1..] {
                acc += group_sum(r);
            }
            (acc / total as f32).to_bits()
        })
        .collect()
}

/// Every one of `members` is done with the exact bits and total count.
fn assert_done_with_everyone(net: &Net, members: &[MemberId], ins: &[Input], g: usize) {
    assert_done_with_bits(net, members, ins, &exact(ins, g));
}

/// What holds after losses, once everything is delivered and reported:
/// every survivor ends, Done or Lost (for a victim); the Done ones hold the
/// full result; none that heard of a loss while it needed the lost member
/// is Done. Returns the number of survivors done.
fn check_survivors(net: &Net, ins: &[Input], victims: &[MemberId], g: usize, ctx: &str) -> usize {
    let mut done = Vec::new();
    for m in net.survivors() {
        match net.outcome(m) {
            Outcome::Done { .. } => done.push(m),
            Outcome::Lost { member } => assert!(victims.contains(member), "{ctx}: {m:x}"),
            o => panic!("{ctx}: survivor {m:x} ended {o:?}"),
        }
        for v in victims {
            if net.lacked.contains(&(m, *v)) {
                assert!(!net.is_done(m), "{ctx}: {m:x} lacked {v:x}'s share");
            }
        }
    }
    assert_done_with_everyone(net, &done, ins, g);
    done.len()
}

#[test]
fn groups_are_contiguous_nearly_equal_and_at_most_the_limit() {
    for n in 1..=300 {
        for g in [1, 2, 3, 7, 64] {
            let rs = groups(n, g);
            assert_eq!(rs.len(), n.div_ceil(g), "n {n} g {g}");
            assert_eq!((rs[0].start, rs[rs.len() - 1].end), (0, n));
            assert!(rs.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<usize> = rs.iter().map(|r| r.len()).collect();
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(*hi <= g && hi - lo <= 1, "n {n} g {g}: {sizes:?}");
        }
    }
}

#[test]
fn every_member_gets_the_same_weighted_mean() {
    let mut rng = Rng::new(17);
    for g in [1, 2, 3, 4] {
        with_groups_of(g, || {
            for n in 1..=14 {
                for len in [0, 1, 2, n - 1, n, 7, 100, 517] {
                    let ins = inputs(&mut rng, n, len);
                    let mut net = Net::new(1, &ins);
                    net.run(&mut rng);
                    assert_done_with_everyone(&net, &ids_of(&ins), &ins, g);
                    assert!(net.nodes.values().all(|h| h.take_outbox_len() == 0));
                    assert!(net.links.values().all(|q| q.is_empty()));
                }
            }
        });
    }
}

#[test]
fn the_result_does_not_depend_on_delivery_order() {
    let mut rng = Rng::new(12);
    for n in [4, 7, 10] {
        let ins = inputs(&mut rng, n, 211);
        assert_same_bits_in_every_order::<HierarchicalAllReduce>(&ins, &ids_of(&ins));
    }
}

/// The rounds do not grow with the members: five, with groups of up to
/// `g` and at most `g` groups (two in the group, two in the column, one
/// for the parts).
#[test]
fn five_message_rounds_suffice() {
    let mut rng = Rng::new(5);
    for g in [2, 3, 5, 8] {
        with_groups_of(g, || {
            for n in [g + 1, 2 * g, g * g - 1, g * g] {
                let ins = inputs(&mut rng, n, 60);
                let mut net = Net::new(2, &ins);
                let mut rounds = 0;
                while net.links.values().any(|q| !q.is_empty()) {
                    net.round();
                    rounds += 1;
                    assert!(rounds <= 5, "g {g} n {n}: round {rounds}");
                }
                assert_done_with_everyone(&net, &ids_of(&ins), &ins, g);
            }
        });
    }
}

/// Each member's messages: `2 (s-1)` in its group, `2 (G-1)` in its column
/// (positions below `K`), `s-1` parts (the same positions); about three
/// times the buffer in all.
#[test]
fn each_member_sends_its_group_column_and_part_messages() {
    let mut rng = Rng::new(6);
    let g = 4;
    with_groups_of(g, || {
        for n in [5, 9, 13, 16] {
            let len = 400;
            let ins = inputs(&mut rng, n, len);
            let ids = ids_of(&ins);
            let mut net = Net::new(3, &ins);
            net.run(&mut rng);
            let rs = groups(n, g);
            let k = rs.iter().map(|r| r.len()).min().unwrap();
            for (i, id) in ids.iter().enumerate() {
                let r = rs.iter().find(|r| r.contains(&i)).unwrap();
                let (s, pos) = (r.len(), i - r.start);
                let in_column = pos < k;
                let want = 2 * (s - 1)
                    + if in_column {
                        2 * (rs.len() - 1) + s - 1
                    } else {
                        0
                    };
                let sent = &net.sent[id];
                assert_eq!(sent.len(), want, "n {n} member {i}");
                let elements: usize = (sent.iter())
                    .map(|(_, m)| match m {
                        Message::Chunk { data, .. } => data.len(),
                        m => panic!("{m:?}"),
                    })
                    .sum();
                assert!(elements <= 4 * (len + 1), "n {n}: {elements}");
            }
        }
    });
}

#[test]
fn one_member_lost_at_a_random_moment() {
    for g in [2, 3, 4] {
        with_groups_of(g, || {
            let mut tally = Tally::default();
            for n in [g + 1, 2 * g + 1, g * g, g * g + 2] {
                for seed in 0..150u64 {
                    let mut rng = Rng::derive(seed, (g * 100 + n) as u64);
                    let len = rng.below(3 * n as u64 + 40) as usize;
                    let ins = inputs(&mut rng, n, len);
                    let ids = ids_of(&ins);
                    let mut net = Net::new(3, &ins);
                    for _ in 0..rng.below((n * 3 * (n + 2)) as u64 + 1) {
                        net.step(&mut rng);
                    }
                    let victim = ids[rng.below(n as u64) as usize];
                    let late = net.kill_now_or_later(&mut rng, victim);
                    net.run(&mut rng);
                    let ctx = format!("g {g} n {n} seed {seed} late {late}");
                    let done = check_survivors(&net, &ins, &[victim], g, &ctx);
                    if !net.lacked.iter().any(|(_, v)| *v == victim) {
                        assert_eq!(done, n - 1, "{ctx}: nobody needed anything from it");
                    }
                    tally.add(done, n - 1);
                }
            }
            eprintln!("g {g}: {tally:?}");
            assert!(tally.all_lost > 0 && tally.all_done > 0, "g {g}: {tally:?}");
        });
    }
}

#[test]
fn two_or_more_losses_still_end_every_survivor() {
    let mut tally = Tally::default();
    with_groups_of(3, || {
        for n in [7, 10, 12] {
            for seed in 0..150u64 {
                let mut rng = Rng::derive(seed, 700 + n as u64);
                let len = rng.below(2 * n as u64 + 30) as usize;
                let ins = inputs(&mut rng, n, len);
                let mut net = Net::new(4, &ins);
                let losses = 2 + rng.below(n as u64 - 4) as usize;
                let mut victims = Vec::new();
                for _ in 0..losses {
                    for _ in 0..rng.below((n * 3 * (n + 2)) as u64 + 1) {
                        net.step(&mut rng);
                    }
                    let rest = net.survivors();
                    let v = rest[rng.below(rest.len() as u64) as usize];
                    victims.push(v);
                    net.kill_now_or_later(&mut rng, v);
                }
                net.run(&mut rng);
                let ctx = format!("n {n} seed {seed} victims {victims:x?}");
                let done = check_survivors(&net, &ins, &victims, 3, &ctx);
                tally.add(done, n - losses);
            }
        }
    });
    eprintln!("{tally:?}");
    assert!(tally.all_lost > 0 && tally.all_done > 0, "{tally:?}");
}

/// The coordinator's redo among the survivors gives every survivor their
/// mean, the lost member's microbatches out.
#[test]
fn a_redo_among_the_survivors_finishes() {
    let mut rng = Rng::new(9);
    let ins = inputs(&mut rng, 10, 77);
    let lost = ins[4].0;
    let (survivors, mut again) = run_again_without::<HierarchicalAllReduce>(&mut rng, &ins, lost);
    again.run(&mut rng);
    assert_done_with_everyone(&again, &ids_of(&survivors), &survivors, 3);
}

/// Member 0 of nine in groups of three ({0,1,2} {3,4,5} {6,7,8}; three
/// columns: 0, 3 and 6 are column 0), nothing received yet, its outbox
/// taken.
fn fresh() -> (HierarchicalAllReduce, Vec<MemberId>) {
    let ins = inputs(&mut Rng::new(8), 9, 30);
    let ids = ids_of(&ins);
    let mut h = HierarchicalAllReduce::new(4, ids[0], &ids, &ins[0].1, ins[0].2, 3).unwrap();
    assert_eq!(h.take_outbox().len(), 2);
    (h, ids)
}

fn chunk(step: u32, len: usize) -> Message {
    Message::Chunk {
        op: 4,
        step,
        data: vec![0.5; len].into(),
    }
}

#[test]
fn a_message_the_protocol_cannot_send_fails_and_tells_the_group_and_column() {
    let (_, ids) = fresh();
    // Part sizes of 31 elements over 3 columns: 10, 10, 11.
    let cases: Vec<(MemberId, Message, &str)> = vec![
        (ids[3], chunk(0, 10), "of another group"),
        (ids[1], chunk(COLUMN_STEP, 10), "not of my column"),
        (ids[4], chunk(COLUMN_STEP, 10), "not of my column"),
        (
            ids[3],
            chunk(COLUMN_STEP + 1, 10),
            "before my slice was sent",
        ),
        (ids[2], chunk(PART_STEP + 1, 10), "does not own it"),
        (ids[1], chunk(PART_STEP + 1, 9), "9 elements, 10 expected"),
        (ids[1], chunk(PART_STEP + 7, 10), "does not own it"),
        (ids[0], chunk(0, 10), "from myself"),
        (
            ids[1],
            Message::Resume {
                op: 4,
                lost: ids[2],
                step: 3,
            },
            "a ring's message",
        ),
    ];
    for (from, msg, want) in cases {
        let (mut h, ids) = fresh();
        h.on_message(from, msg.clone());
        let Outcome::Failed { reason } = h.outcome() else {
            panic!("{msg:?}: {:?}", h.outcome())
        };
        assert!(reason.contains(want), "{msg:?}: {reason}");
        assert!(h.gathered.iter().all(|g| !g), "{msg:?} added something");
        // The group (1, 2) and the column (3, 6), the offender left out.
        let mut told: Vec<MemberId> = (h.take_outbox().into_iter())
            .map(|(to, m)| {
                assert_eq!(m, Message::Abort { op: 4, lost: from });
                to
            })
            .collect();
        told.sort_unstable();
        let mut want: Vec<MemberId> = [1, 2, 3, 6]
            .iter()
            .map(|&k| ids[k])
            .filter(|&m| m != from)
            .collect();
        want.sort_unstable();
        assert_eq!(told, want, "{msg:?}");
        // Nothing after the end.
        h.on_message(ids[1], chunk(0, 10));
        assert!(h.take_outbox().is_empty());
    }
    // Two early column slices from one member.
    let (mut h, ids) = fresh();
    h.on_message(ids[3], chunk(COLUMN_STEP, 10));
    assert_eq!(*h.outcome(), Outcome::Running);
    h.on_message(ids[3], chunk(COLUMN_STEP, 10));
    assert!(matches!(h.outcome(), Outcome::Failed { reason } if reason.contains("two column")));
}

#[test]
fn messages_of_another_op_or_from_non_members_are_ignored() {
    let (mut h, ids) = fresh();
    h.on_message(ids[1], Message::Abort { op: 5, lost: 1 });
    h.on_message(12345, chunk(0, 10));
    h.on_peer_lost(12345);
    assert_eq!(*h.outcome(), Outcome::Running);
    assert!(h.take_outbox().is_empty());
}

#[test]
fn an_abort_ends_it_lost_and_is_passed_to_the_group_and_column() {
    let (mut h, ids) = fresh();
    h.on_message(
        ids[6],
        Message::Abort {
            op: 4,
            lost: ids[7],
        },
    );
    assert_eq!(*h.outcome(), Outcome::Lost { member: ids[7] });
    let mut told: Vec<MemberId> = h.take_outbox().into_iter().map(|(to, _)| to).collect();
    told.sort_unstable();
    let mut want = vec![ids[1], ids[2], ids[3], ids[6]];
    want.sort_unstable();
    assert_eq!(told, want);
}

#[test]
fn a_loss_outside_the_group_and_column_changes_nothing() {
    let (mut h, ids) = fresh();
    h.on_peer_lost(ids[4]);
    h.on_peer_lost(ids[8]);
    assert_eq!(*h.outcome(), Outcome::Running);
    assert!(!h.needs(ids[4]) && h.needs(ids[1]) && h.needs(ids[3]));
    // A column member's loss before its slice came: that slice can never come.
    h.on_peer_lost(ids[3]);
    assert_eq!(*h.outcome(), Outcome::Lost { member: ids[3] });
}

#[test]
fn bad_setups_are_refused() {
    assert_eq!(
        HierarchicalAllReduce::new(1, 9, &[1, 2], &[0.0], 1, 3).unwrap_err(),
        SetupError::NotAMember
    );
    assert_eq!(
        HierarchicalAllReduce::new(1, 1, &[1, 2, 3, 4, 1], &[0.0], 1, 2).unwrap_err(),
        SetupError::DuplicateMember(1)
    );
    assert!(HierarchicalAllReduce::new(1, 1, &[1, 2], &[0.0], 1 << 25, 3).is_err());
    // A group size of zero is taken as one.
    assert!(HierarchicalAllReduce::new(1, 1, &[1, 2], &[0.0], 1, 0).is_ok());
}

impl HierarchicalAllReduce {
    fn take_outbox_len(&self) -> usize {
        self.outbox.len()
    }
}

/// The simulator's loss rule for the hierarchy
/// (`crate::sim::allreduce::hierarchy_owes`) held to the machines: a
/// member lost at a random moment (every survivor told at once). Where the
/// rule says it owed nothing, every survivor ends Done; where it says a
/// member outside the columns owed something, some survivor ends Lost (the
/// rule is exact there); a column member may be lost after everything it
/// sent arrived but before its own end, where the rule aborts and the
/// machines finish (the simulator is conservative there), counted.
/// (The simulator judges "arrived" by time: the member and those who wait
/// for it ended.)
#[test]
fn the_simulators_loss_rule_says_what_the_machines_do() {
    use crate::sim::allreduce::hierarchy_owes;
    let g = 3;
    with_groups_of(g, || {
        let (mut nothing, mut abort, mut conservative) = (0, 0, 0);
        for n in [4, 7, 9, 11] {
            let rs = groups(n, g);
            let k = rs.iter().map(|r| r.len()).min().unwrap();
            for seed in 0..300u64 {
                let mut rng = Rng::derive(seed, 900 + n as u64);
                let len = rng.below(2 * n as u64 + 20) as usize;
                let ins = inputs(&mut rng, n, len);
                let ids = ids_of(&ins);
                let mut net = Net::new(6, &ins);
                for _ in 0..rng.below((n * 3 * (n + 2)) as u64 + 1) {
                    net.step(&mut rng);
                }
                let vi = rng.below(n as u64) as usize;
                let v = ids[vi];
                let r = rs.iter().find(|r| r.contains(&vi)).unwrap();
                let column = vi - r.start < k;
                let group_chunk =
                    |m: &Message| matches!(m, Message::Chunk { step, .. } if *step < COLUMN_STEP);
                let sent = (net.sent.get(&v).into_iter().flatten())
                    .filter(|(_, m)| group_chunk(m))
                    .count();
                let from_v = (net.links.iter())
                    .filter(|((from, _), _)| *from == v)
                    .flat_map(|(_, q)| q.iter());
                let group_in_flight = from_v.clone().any(group_chunk);
                let group_over = sent == 2 * (r.len() - 1) && !group_in_flight;
                // Done, it sent everything it ever sends.
                let all_arrived = net.is_done(v) && from_v.count() == 0;
                let owes = hierarchy_owes(column, group_over, all_arrived);
                net.kill(v);
                net.run(&mut rng);
                let ctx = format!("n {n} seed {seed} member {vi}");
                let done = check_survivors(&net, &ins, &[v], g, &ctx);
                let lost_any = done < n - 1;
                if !owes {
                    assert!(!lost_any, "{ctx}: the rule said nothing, {done} done");
                    nothing += 1;
                } else if lost_any {
                    abort += 1;
                } else {
                    assert!(column, "{ctx}: it owed its group, yet all finished");
                    conservative += 1;
                }
            }
        }
        eprintln!("nothing {nothing}, abort {abort}, conservative {conservative}");
        assert!(nothing > 0 && abort > 0, "{nothing} {abort}");
    });
}
