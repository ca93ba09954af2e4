//! The runtime's part of rebuilding an emptied relay stage from its
//! neighbours, CheckFree's way (the protocol's part is
//! `protocol/node/restore.rs`; `Config::rebuild_from_neighbours`): a member
//! of a neighbouring relay stage sends its state to the rebuilder like a
//! download; the rebuilder keeps the states that come, verified, and once
//! the protocol takes the stage up ([`Event::StageRebuilt`]) hands them to
//! its trainer to average ([`WorkKind::AverageStates`]). Where the trainer
//! cannot (it fails the work), the stage restarts from the initial weights.
use super::driver::{NodeLoop, Pending};
use super::intake::Refusal;
use super::runtime::NodeEvent;
use super::work::{Output, WorkKind};
use crate::engine::Frame;
use crate::protocol::{NodeId, Stage};
use std::sync::Arc;
use std::time::Instant;

/// The neighbours' states a rebuilder received, waiting for the protocol's
/// verdict: (member, its stage, its state).
#[derive(Default)]
pub(super) struct NeighbourStates {
    states: Vec<(NodeId, Stage, Vec<u8>)>,
}

impl NodeLoop {
    /// A joiner rebuilding emptied relay `stage` asks for this node's
    /// state: exported now and sent like a download, when this node serves
    /// a relay stage next to it and holds its state.
    pub(super) fn serve_rebuild(&mut self, to: NodeId, stage: Stage) {
        let mine = self.me.stage;
        let relays = 1..=self.cfg.relay_stages;
        if !(relays.contains(&mine) && relays.contains(&stage) && mine.abs_diff(stage) == 1) {
            let e = format!(
                "a request from {to:x} for a state to rebuild stage {stage} from: \
                 this node serves stage {mine}"
            );
            self.refuse(Some(to), Refusal::Message, e);
            return;
        }
        if !self.node.is_active() || self.resync.is_some() {
            self.log(format!(
                "the state to rebuild stage {stage} from not sent to {to:x}: \
                 this node holds no stage state now"
            ));
            return;
        }
        // Training waits for the stage: served even when other states are.
        if !self.serving.admit_urgent(to, Instant::now()) {
            self.log(format!("the state for {to:x} is on its way already"));
            return;
        }
        self.export_copy_for(to, false);
    }

    /// A neighbour's state for the stage this node rebuilds: kept when
    /// whole and its hash right (false: refused, and its server cut off).
    pub(super) fn keep_neighbour_state(&mut self, from: NodeId, bytes: u64, data: Frame) -> bool {
        let stage = data.header.stage as Stage;
        match self.verify_state(data, bytes) {
            Ok(state) => {
                self.log(format!(
                    "the state of stage {stage} from {from:x} ({} bytes) is in, to rebuild from",
                    state.len()
                ));
                (self.neighbours.states).push((from, stage, state.payload().to_vec()));
                true
            }
            Err(e) => {
                let e = format!("the state from {from:x}: {e}");
                self.refuse_and_cut(from, Refusal::State, e);
                false
            }
        }
    }

    /// The protocol serves `stage` rebuilt from the states of `from`: the
    /// trainer averages them before any work of the stage reaches it.
    pub(super) fn rebuild(&mut self, stage: Stage, from: &[NodeId], applied: Option<u32>) {
        let states: Vec<(Stage, Vec<u8>)> = std::mem::take(&mut self.neighbours.states)
            .into_iter()
            .filter(|(id, _, _)| from.contains(id))
            .map(|(_, s, state)| (s, state))
            .collect();
        self.log(format!(
            "stage {stage} had no live node and no copy kept: rebuilding it from the \
             weights of {} neighbouring stage member(s) ({})",
            states.len(),
            from.iter()
                .map(|id| format!("{id:x}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let kind = WorkKind::AverageStates {
            applied,
            states: Arc::new(states),
        };
        let p = Pending::Rebuild {
            from: from.to_vec(),
            applied,
        };
        self.give(kind, None, None, p);
    }

    /// The trainer rebuilt the stage (`out`), or failed to (`None`): then
    /// it restarts from the initial weights.
    pub(super) fn rebuilt(&mut self, from: Vec<NodeId>, applied: Option<u32>, out: Option<Output>) {
        let stage = self.me.stage;
        match out {
            Some(Output::Rebuilt { weights, averaged }) => {
                self.node
                    .set_weights_digest(super::driver::digest_u64(&weights));
                self.emit(NodeEvent::StageRebuilt {
                    stage,
                    from,
                    applied,
                    averaged,
                    weights,
                });
            }
            _ => {
                let kind = WorkKind::InitState { applied };
                self.give(kind, None, None, Pending::Init);
                self.emit(NodeEvent::StageRebuilt {
                    stage,
                    from,
                    applied,
                    averaged: 0,
                    weights: [0; 32],
                });
            }
        }
    }
}
