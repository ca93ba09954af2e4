//! A joiner computes on the weights before the rest of the state came.
//!
//! A relay's state is its weights, then the optimizer's moments and the
//! weights from before the last update: four times the weights (85 MB for
//! a llama-small stage, 6.8 s at 100 Mbit/s). A microbatch's forward and
//! backward need only the weights. Where the trainer lays its state out
//! weights first and says where they end
//! ([`super::runtime::RuntimeOptions::weights_first`]), the protocol's own
//! download (a joiner's, an emptied stage's restore) hands the weights to
//! the trainer as soon as they came ([`WorkKind::ImportWeights`]) and the
//! node takes its place in the stage; the rest follows
//! ([`WorkKind::ImportRest`]).
//!
//! Only where the stage has no other member: restoring an emptied stage
//! from a kept copy, where the whole swarm waits for this node. A joiner
//! of a stage that trains on counts in its stage's all-reduce from the
//! moment it is a member, and its gradient would wait for the rest:
//! measured with ten llama-small joins at 100 Mbit/s, the longest time
//! without a final iteration went from about 4 s to 8.7 s. It downloads
//! its state whole, as before, while its stage trains without it.
//!
//! Until the rest is in, what needs it waits: the
//! update, the gradient (its digest covers the moments), an export, and
//! a microbatch of an iteration the state's update covers (it runs on the
//! weights from before it).
//!
//! The weights were checked by each frame's tag as they came; the state's
//! hash checks them again with the rest. When the rest does not come (its
//! server lost, the state refused), the state is downloaded again from
//! another member of the stage (a resync); with none, the node stops with
//! an error rather than apply updates without the optimizer's state. A
//! whole state that comes meanwhile (a resync's, or a new download after
//! a fence) replaces it; what waited for the rest then goes after it.
use super::driver::{NodeLoop, Pending};
use super::intake::Refusal;
use super::serving::DIGEST_LEN;
use super::work::{Work, WorkKind};
use crate::engine::Frame;
use crate::protocol::NodeId;
use std::collections::VecDeque;
use std::time::Instant;

/// A download whose weights were imported; its rest awaited.
pub(super) struct RestAwaited {
    pub(super) from: NodeId,
    /// The state's bytes as announced (its hash included).
    pub(super) bytes: u64,
    /// When the state was asked for, and when its weights had come.
    pub(super) asked: Instant,
    pub(super) weights_at: Instant,
    /// The update the state stands for (as the import's).
    pub(super) applied: Option<u32>,
    /// The iteration of the state's version.
    pub(super) iteration: u32,
    /// Works that need the rest, in the order they were given.
    pub(super) held: VecDeque<Work>,
}

impl RestAwaited {
    /// Whether `w` may run on the weights alone.
    pub(super) fn passes(&self, w: &Work) -> bool {
        match &w.kind {
            WorkKind::ImportWeights { .. }
            | WorkKind::ImportRest { .. }
            | WorkKind::ImportState { .. }
            | WorkKind::InitState { .. }
            | WorkKind::AverageStates { .. }
            | WorkKind::Forget { .. }
            | WorkKind::Discard => true,
            // A microbatch of an iteration the update covers runs on the
            // weights from before it, which come with the rest.
            k if k.is_microbatch_compute() => match (w.mb, self.applied) {
                (Some(mb), Some(a)) => mb.iter > a,
                _ => true,
            },
            // The update, an export, a gradient (its weights digest covers
            // the moments).
            _ => false,
        }
    }
}

impl NodeLoop {
    /// The rule for the weights at the head of `from`'s state, when this
    /// node's own download from it may go weights first.
    pub(super) fn weights_rule(
        &self,
        from: NodeId,
    ) -> Option<impl Fn(&[u8], usize) -> Option<usize>> {
        let rule = self.weights_first?;
        let downloading = !self.node.is_active()
            && self.resync.is_none()
            && self.node.restores_emptied_stage()
            && self.node.downloading_from() == Some(from)
            && !self.node.rebuild_awaits(from);
        // The state travels with its hash after it.
        downloading
            .then_some(move |head: &[u8], total: usize| rule(head, total.checked_sub(DIGEST_LEN)?))
    }

    /// The whole state whose weights were imported first came: checked,
    /// and the rest imported.
    pub(super) fn on_rest(&mut self, from: NodeId, whole: Frame) {
        let Some(r) = self.rest.as_ref().filter(|r| r.from == from) else {
            self.log(format!(
                "the rest of a state from {from:x} not waited for: dropped"
            ));
            return;
        };
        let (bytes, asked, weights_at) = (r.bytes, r.asked, r.weights_at);
        let (applied, iteration) = (r.applied, r.iteration);
        match self.verify_state(whole, bytes) {
            Ok(state) => {
                let p = Pending::Import {
                    from,
                    bytes: state.len(),
                    asked,
                    verified: Instant::now(),
                    iteration,
                    weights_at: Some(weights_at),
                };
                self.give(WorkKind::ImportRest { applied }, None, Some(state), p);
            }
            Err(e) => {
                let e = format!("the state from {from:x}: {e}");
                self.refuse_and_cut(from, Refusal::State, e);
            }
        }
    }

    /// The rest of the state from `peer` will not come (`why`): downloaded
    /// again from another member of the stage, or, with none, the node
    /// stops.
    pub(super) fn rest_lost(&mut self, peer: NodeId, why: &str) {
        if self.rest.as_ref().is_none_or(|r| r.from != peer) {
            return;
        }
        let r = self.rest.take().expect("checked");
        let me = self.me.id;
        let others = self.node.stage_members().into_iter().any(|m| m != me);
        if !others {
            self.error(format!(
                "the optimizer state after the weights from {peer:x} did not come ({why}) \
                 and no other member of the stage holds it: stopping rather than train \
                 without it"
            ));
            self.failed = true;
            return;
        }
        self.log(format!(
            "the rest of the state from {peer:x} did not come ({why}): downloading it again"
        ));
        self.start_resync(r.iteration);
        for w in r.held {
            self.dispatch(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MbId;
    use std::sync::Arc;

    fn work(kind: WorkKind, iter: Option<u32>) -> Work {
        Work {
            id: 1,
            kind,
            stage: 2,
            mb: iter.map(|iter| MbId {
                holder: 1,
                iter,
                idx: 0,
            }),
            input: None,
        }
    }

    /// With the weights of the update of iteration 6 imported and the rest
    /// awaited, a microbatch of iteration 7 runs; one of iteration 6 (on
    /// the weights from before that update), the update, the gradient and
    /// an export wait; imports, forgetting and discarding go on.
    #[test]
    fn only_what_needs_the_weights_alone_runs_before_the_rest() {
        let now = Instant::now();
        let r = RestAwaited {
            from: 1,
            bytes: 100,
            asked: now,
            weights_at: now,
            applied: Some(6),
            iteration: 6,
            held: VecDeque::new(),
        };
        let runs = |kind: WorkKind, iter: Option<u32>| r.passes(&work(kind, iter));
        for k in [WorkKind::Forward, WorkKind::Backward, WorkKind::Discard] {
            assert!(runs(k.clone(), Some(7)), "{k:?}");
        }
        assert!(!runs(WorkKind::Forward, Some(6)));
        assert!(!runs(WorkKind::Backward, Some(5)));
        let apply = WorkKind::Apply {
            iteration: 7,
            mean: Arc::new(Vec::new()),
            microbatches: 4,
        };
        let gradient = WorkKind::Gradient {
            iteration: 7,
            granted: Vec::new(),
        };
        for k in [apply, gradient, WorkKind::ExportState] {
            assert!(!runs(k.clone(), None), "{k:?}");
        }
        for k in [
            WorkKind::ImportRest { applied: Some(6) },
            WorkKind::ImportState { applied: Some(6) },
            WorkKind::Forget { before: 5 },
        ] {
            assert!(runs(k.clone(), None), "{k:?}");
        }
        // Before any update (version (0, 0)) every microbatch runs.
        let fresh = RestAwaited { applied: None, ..r };
        assert!(fresh.passes(&work(WorkKind::Forward, Some(0))));
    }
}
