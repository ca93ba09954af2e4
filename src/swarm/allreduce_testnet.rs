//! The in-memory network the all-reduce machines' tests run on (the ring's
//! and the butterfly's alike): FIFO per link (as TCP is), links interleaved
//! at random, members lost at random moments and told at once, later or
//! never; and the inputs and the reference mean they are checked against.
use super::allreduce::Machine;
use super::allreduce::{MemberId, Message, Outcome};
use crate::protocol::rng::Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// An all-reduce machine as the tests set it up and watch it.
pub(super) trait TestMachine: Machine + Sized {
    /// Member `me`'s side of operation `op` among `members` (a valid setup).
    fn start(op: u64, me: MemberId, members: &[MemberId], sum: &[f32], mbs: u64) -> Self;
    /// Whether it still needs something from `lost` (counted in
    /// [`Net::lacked`] when it hears of the loss while running).
    fn needs(&self, lost: MemberId) -> bool;
}

/// Members and the links between them.
pub(super) struct Net<M> {
    pub(super) nodes: BTreeMap<MemberId, M>,
    /// (from, to) -> messages in flight, in order.
    pub(super) links: BTreeMap<(MemberId, MemberId), VecDeque<Message>>,
    dead: BTreeSet<MemberId>,
    /// Losses not yet reported: (the survivor to tell, the lost member),
    /// each reported at a random moment of the delivery.
    news: Vec<(MemberId, MemberId)>,
    /// (survivor, lost member) for each loss reported while the survivor
    /// was running and still needed something from the lost member
    /// ([`TestMachine::needs`]).
    pub(super) lacked: BTreeSet<(MemberId, MemberId)>,
    /// Everything each member sent, in order: (to, message).
    pub(super) sent: BTreeMap<MemberId, Vec<(MemberId, Message)>>,
}

impl<M: TestMachine> Net<M> {
    pub(super) fn new(op: u64, inputs: &[Input]) -> Net<M> {
        let ids = ids_of(inputs);
        let mut net = Net {
            nodes: BTreeMap::new(),
            links: BTreeMap::new(),
            dead: BTreeSet::new(),
            news: Vec::new(),
            lacked: BTreeSet::new(),
            sent: BTreeMap::new(),
        };
        for (id, sum, mbs) in inputs {
            net.nodes.insert(*id, M::start(op, *id, &ids, sum, *mbs));
        }
        net.collect();
        net
    }

    /// Moves every live member's outbox onto its links (a dead member sends
    /// nothing; what is sent to one is lost).
    fn collect(&mut self) {
        for (&id, node) in self.nodes.iter_mut() {
            if self.dead.contains(&id) {
                continue;
            }
            for (to, msg) in node.take_outbox() {
                self.sent.entry(id).or_default().push((to, msg.clone()));
                if !self.dead.contains(&to) {
                    self.links.entry((id, to)).or_default().push_back(msg);
                }
            }
        }
    }

    /// Delivers one message of a random non-empty link, or reports one
    /// pending loss; false when nothing is left.
    pub(super) fn step(&mut self, rng: &mut Rng) -> bool {
        self.step_where(rng, |_, _| true)
    }

    /// As [`Net::step`], choosing only among the links `(from, to)` that
    /// `ok` accepts (and the pending losses).
    pub(super) fn step_where(
        &mut self,
        rng: &mut Rng,
        ok: impl Fn(MemberId, MemberId) -> bool,
    ) -> bool {
        let busy: Vec<(MemberId, MemberId)> = self
            .links
            .iter()
            .filter(|((from, to), q)| !q.is_empty() && ok(*from, *to))
            .map(|(k, _)| *k)
            .collect();
        let k = busy.len() + self.news.len();
        if k == 0 {
            return false;
        }
        let pick = rng.below(k as u64) as usize;
        if pick >= busy.len() {
            let (who, lost) = self.news.swap_remove(pick - busy.len());
            self.tell(who, lost);
            return true;
        }
        let (from, to) = busy[pick];
        let msg = self
            .links
            .get_mut(&(from, to))
            .unwrap()
            .pop_front()
            .unwrap();
        self.deliver(from, to, msg);
        true
    }

    fn deliver(&mut self, from: MemberId, to: MemberId, msg: Message) {
        if !self.dead.contains(&to) {
            self.nodes.get_mut(&to).unwrap().on_message(from, msg);
            self.collect();
        }
    }

    /// One round: delivers every message in flight now (what they cause
    /// waits for the next round).
    pub(super) fn round(&mut self) {
        let now = std::mem::take(&mut self.links);
        for ((from, to), q) in now {
            for msg in q {
                self.deliver(from, to, msg);
            }
        }
    }

    /// Delivers at random until `stop` holds (checked before each
    /// delivery); false if the exchange ended first.
    pub(super) fn run_until(&mut self, rng: &mut Rng, stop: impl Fn(&Net<M>) -> bool) -> bool {
        loop {
            if stop(self) {
                return true;
            }
            if !self.step(rng) {
                return false;
            }
        }
    }

    /// Delivers at random until nothing is left.
    pub(super) fn run(&mut self, rng: &mut Rng) {
        let mut budget = 1_000_000;
        while self.step(rng) {
            budget -= 1;
            assert!(budget > 0, "the exchange does not end");
        }
    }

    pub(super) fn survivors(&self) -> Vec<MemberId> {
        self.nodes
            .keys()
            .copied()
            .filter(|m| !self.dead.contains(m))
            .collect()
    }

    /// `id` crashes, and nobody is told yet: what it sent may still arrive
    /// (it is in the kernel's buffers), what is sent to it is lost, and it
    /// hears of no loss any more.
    pub(super) fn kill_silently(&mut self, id: MemberId) {
        self.dead.insert(id);
        self.links.retain(|(_, to), _| *to != id);
        self.news.retain(|(who, _)| *who != id);
    }

    /// The runtime reports to `who` (if alive) that `lost` is gone.
    pub(super) fn tell(&mut self, who: MemberId, lost: MemberId) {
        if self.dead.contains(&who) {
            return;
        }
        let node = &self.nodes[&who];
        if node.outcome() == &Outcome::Running && node.needs(lost) {
            self.lacked.insert((who, lost));
        }
        self.nodes.get_mut(&who).unwrap().on_peer_lost(lost);
        self.collect();
    }

    /// `id` crashes and every survivor is told at once.
    pub(super) fn kill(&mut self, id: MemberId) {
        self.kill_silently(id);
        for m in self.survivors() {
            self.tell(m, id);
        }
    }

    /// `id` crashes; each survivor is told at its own random later moment.
    pub(super) fn kill_later(&mut self, id: MemberId) {
        self.kill_silently(id);
        for m in self.survivors() {
            self.news.push((m, id));
        }
    }

    /// `id` crashes; with even odds every survivor is told at once
    /// ([`Net::kill`]) or each later ([`Net::kill_later`], true).
    pub(super) fn kill_now_or_later(&mut self, rng: &mut Rng, id: MemberId) -> bool {
        let late = rng.below(2) == 0;
        if late {
            self.kill_later(id);
        } else {
            self.kill(id);
        }
        late
    }

    pub(super) fn outcome(&self, id: MemberId) -> &Outcome {
        self.nodes[&id].outcome()
    }

    pub(super) fn is_done(&self, id: MemberId) -> bool {
        matches!(self.outcome(id), Outcome::Done { .. })
    }
}

/// A member's id, contribution (sum) and microbatches.
pub(super) type Input = (MemberId, Vec<f32>, u64);

/// `n` members with distinct random ids, random contributions of `len`
/// gradients and 1 to 4 microbatches each.
pub(super) fn inputs(rng: &mut Rng, n: usize, len: usize) -> Vec<Input> {
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

pub(super) fn ids_of(ins: &[Input]) -> Vec<MemberId> {
    ins.iter().map(|x| x.0).collect()
}

/// Four members. The tests' victim `d` is the second: in a ring, its
/// predecessor `p` is the first, its successor `q` the third, `r` the fourth.
pub(super) fn four_members() -> (Vec<Input>, [MemberId; 4]) {
    let ins = inputs(&mut Rng::new(21), 4, 101);
    let ids = [ins[0].0, ins[1].0, ins[2].0, ins[3].0];
    (ins, ids)
}

/// The weighted mean in f64.
pub(super) fn reference(ins: &[Input]) -> Vec<f64> {
    let total: u64 = ins.iter().map(|x| x.2).sum();
    let len = ins[0].1.len();
    (0..len)
        .map(|i| ins.iter().map(|x| x.1[i] as f64).sum::<f64>() / total as f64)
        .collect()
}

/// Runs a full exchange among `ins` (operation 9) in 20 delivery orders
/// (seeds 0 to 19): each of `members` ends done, with the same bits in
/// every order.
pub(super) fn assert_same_bits_in_every_order<M: TestMachine>(ins: &[Input], members: &[MemberId]) {
    let mut bits: Option<Vec<u32>> = None;
    for seed in 0..20 {
        let mut net = Net::<M>::new(9, ins);
        net.run(&mut Rng::new(seed));
        for id in members {
            let Outcome::Done { mean, .. } = net.outcome(*id) else {
                panic!()
            };
            let b: Vec<u32> = mean.iter().map(|x| x.to_bits()).collect();
            match &bits {
                None => bits = Some(b),
                Some(prev) => assert_eq!(prev, &b, "delivery order {seed} changed the result"),
            }
        }
    }
}

/// An exchange among `ins` (operation 1) that loses `lost` after one
/// delivery and runs to its end; then the survivors' inputs and their
/// next exchange (operation 2), set up, nothing delivered yet.
pub(super) fn run_again_without<M: TestMachine>(
    rng: &mut Rng,
    ins: &[Input],
    lost: MemberId,
) -> (Vec<Input>, Net<M>) {
    let mut net = Net::<M>::new(1, ins);
    net.step(rng);
    net.kill(lost);
    net.run(rng);
    let survivors: Vec<Input> = ins.iter().filter(|x| x.0 != lost).cloned().collect();
    let again = Net::new(2, &survivors);
    (survivors, again)
}

/// Every one of `members` is done with `bits` (the mean the algorithm must
/// give, bit for bit), close to the weighted mean in f64, and the total
/// microbatch count.
pub(super) fn assert_done_with_bits<M: TestMachine>(
    net: &Net<M>,
    members: &[MemberId],
    ins: &[Input],
    bits: &[u32],
) {
    let want = reference(ins);
    let total: u64 = ins.iter().map(|x| x.2).sum();
    for id in members {
        let o = net.outcome(*id);
        let Outcome::Done { mean, microbatches } = o else {
            panic!("{id:x} did not finish: {o:?}")
        };
        assert_eq!(*microbatches, total, "{id:x}");
        assert_eq!(mean.len(), want.len());
        for (got, want) in mean.iter().zip(&want) {
            assert!(
                (*got as f64 - want).abs() <= 1e-5 * want.abs().max(1e-2),
                "{id:x}: {got} vs {want}"
            );
        }
        let got: Vec<u32> = mean.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, bits, "{id:x} holds other bits");
    }
}

/// How runs with losses ended.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) all_lost: u32,
    pub(super) all_done: u32,
    /// Some survivors done, some lost.
    pub(super) mixed: u32,
}

impl Tally {
    pub(super) fn add(&mut self, done: usize, survivors: usize) {
        if done == 0 {
            self.all_lost += 1;
        } else if done == survivors {
            self.all_done += 1;
        } else {
            self.mixed += 1;
        }
    }
}
