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
//! What this node produced is kept shared ([`SharedFrame`]): each send is
//! the same slot, not a copy of it.
use crate::engine::{Frame, SharedFrame};
use crate::protocol::MbId;
use std::collections::HashMap;

/// What is kept of one microbatch.
#[derive(Default)]
struct Entry {
    /// The attempt the tensors below belong to.
    attempt: u32,
    input: Option<Frame>,
    grad_in: Option<Frame>,
    /// A copy of the input, kept for a forward recomputed at the backward.
    checkpoint: Option<Frame>,
    output: Option<SharedFrame>,
    grad_out: Option<SharedFrame>,
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
    /// A copy of the input kept until the backward, which recomputes the
    /// forward from it (the protocol's `recompute`).
    Checkpoint,
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
        match slot {
            Slot::Input => e.input = Some(f),
            Slot::GradIn => e.grad_in = Some(f),
            Slot::Checkpoint => e.checkpoint = Some(f),
            Slot::Output => e.output = Some(f.into()),
            Slot::GradOut => e.grad_out = Some(f.into()),
        }
        true
    }

    /// Takes the input `slot` (`Input`, `GradIn` or `Checkpoint`) of `mb`
    /// out, for the trainer; None for what this node produced (it stays
    /// kept).
    pub fn take(&mut self, mb: MbId, slot: Slot) -> Option<Frame> {
        let e = self.entries.get_mut(&mb)?;
        match slot {
            Slot::Input => e.input.take(),
            Slot::GradIn => e.grad_in.take(),
            Slot::Checkpoint => e.checkpoint.take(),
            Slot::Output | Slot::GradOut => None,
        }
    }

    /// What this node produced for `mb` (`Output` or `GradOut`), to send.
    pub fn kept(&self, mb: MbId, slot: Slot) -> Option<&SharedFrame> {
        let e = self.entries.get(&mb)?;
        match slot {
            Slot::Output => e.output.as_ref(),
            Slot::GradOut => e.grad_out.as_ref(),
            Slot::Input | Slot::GradIn | Slot::Checkpoint => None,
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
                [
                    e.input.is_some(),
                    e.grad_in.is_some(),
                    e.checkpoint.is_some(),
                ]
                .into_iter()
                .chain([e.output.is_some(), e.grad_out.is_some()])
                .filter(|x| *x)
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
