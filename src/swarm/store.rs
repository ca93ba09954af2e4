//! The tensors a node keeps for its microbatches, as the protocol's
//! recovery needs them.
//!
//! Per microbatch: the *input* that arrived with its forward (or the
//! gradient that arrived with its backward) waits here until the trainer
//! takes it; the *output* this node sent on (its activation) and the
//! *gradient* it sent back are kept until the protocol forgets the
//! microbatch's iteration, because a crash downstream makes the protocol
//! send the same activation to another node, and a re-sent forward from
//! upstream is answered with the kept gradient, without recomputing.
//! Each kept tensor holds one pool slot; the pool is sized from the node's
//! memory budget, and so is the capacity the node offers in the flows.
use crate::engine::Frame;
use crate::protocol::MbId;
use std::collections::HashMap;

/// What is kept of one microbatch.
#[derive(Default)]
struct Entry {
    /// The attempt the tensors below belong to.
    attempt: u32,
    input: Option<Frame>,
    grad_in: Option<Frame>,
    output: Option<Frame>,
    grad_out: Option<Frame>,
}

/// The kept tensors, by microbatch.
#[derive(Default)]
pub struct TensorStore {
    entries: HashMap<MbId, Entry>,
}

/// Which tensor of a microbatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The activation that came with a forward.
    Input,
    /// The gradient that came with a backward.
    GradIn,
    /// The activation this node produced.
    Output,
    /// The gradient this node produced (of its input).
    GradOut,
}

impl TensorStore {
    /// Keeps `f` as `slot` of attempt `attempt` of `mb`. A newer attempt
    /// replaces what an older one kept; a tensor of an older attempt than
    /// the kept one is dropped (returns false).
    pub fn put(&mut self, mb: MbId, attempt: u32, slot: Slot, f: Frame) -> bool {
        let e = self.entries.entry(mb).or_default();
        if attempt < e.attempt {
            return false;
        }
        if attempt > e.attempt {
            *e = Entry {
                attempt,
                ..Entry::default()
            };
        }
        *e.slot(slot) = Some(f);
        true
    }

    /// Takes `slot` of `mb` out (the trainer's input).
    pub fn take(&mut self, mb: MbId, slot: Slot) -> Option<Frame> {
        self.entries.get_mut(&mb)?.slot(slot).take()
    }

    /// The kept `slot` of `mb`.
    pub fn get(&self, mb: MbId, slot: Slot) -> Option<&Frame> {
        let e = self.entries.get(&mb)?;
        match slot {
            Slot::Input => e.input.as_ref(),
            Slot::GradIn => e.grad_in.as_ref(),
            Slot::Output => e.output.as_ref(),
            Slot::GradOut => e.grad_out.as_ref(),
        }
    }

    /// The attempt whose tensors `mb` keeps.
    pub fn attempt(&self, mb: MbId) -> Option<u32> {
        self.entries.get(&mb).map(|e| e.attempt)
    }

    /// Drops everything of iterations before `iter`; returns how many
    /// microbatches were dropped.
    pub fn forget_before(&mut self, iter: u32) -> usize {
        let n = self.entries.len();
        self.entries.retain(|mb, _| mb.iter >= iter);
        n - self.entries.len()
    }

    /// Tensors kept, all slots counted.
    pub fn frames(&self) -> usize {
        self.entries
            .values()
            .map(|e| {
                [&e.input, &e.grad_in, &e.output, &e.grad_out]
                    .iter()
                    .filter(|f| f.is_some())
                    .count()
            })
            .sum()
    }

    /// Microbatches with something kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl Entry {
    fn slot(&mut self, s: Slot) -> &mut Option<Frame> {
        match s {
            Slot::Input => &mut self.input,
            Slot::GradIn => &mut self.grad_in,
            Slot::Output => &mut self.output,
            Slot::GradOut => &mut self.grad_out,
        }
    }
}
