//! A data holder's checkpoint rounds (`Config::save_every`): after every
//! `save_every` of its own updates a holder exports its own state and asks
//! one member of each relay stage for a copy of the state of that same
//! iteration (`Msg::CopyRequest`, exported right after the member applies
//! it). Once it holds all of them, the states of one iteration across the
//! stages, the round is complete and handed on
//! ([`super::runtime::NodeEvent::Checkpoint`]); the application writes it
//! (for `gwtf node`, `model_checkpoint`).
//!
//! Bounded: at most [`ROUNDS_OPEN`] rounds are open; an older round still
//! missing a state is dropped when a newer one opens (a member was late or
//! gone: its copy is of another iteration), and said so.
use crate::protocol::{NodeId, Stage};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Rounds waiting for their states at once, at most.
pub(super) const ROUNDS_OPEN: usize = 2;

/// One stage's state in a checkpoint round.
#[derive(Clone, Debug)]
pub struct SavedState {
    pub stage: Stage,
    /// The node whose trainer exported it (the holder itself for stage 0).
    pub from: NodeId,
    /// The state as the stage's trainer exported it.
    pub state: Arc<Vec<u8>>,
}

#[derive(Debug, Default)]
pub(super) struct Saves {
    /// Open rounds by iteration: the states in so far, by stage.
    rounds: BTreeMap<u32, BTreeMap<Stage, SavedState>>,
}

impl Saves {
    /// Opens the round of `iteration`; returns the iterations of the
    /// rounds dropped incomplete to stay within [`ROUNDS_OPEN`].
    pub(super) fn open(&mut self, iteration: u32) -> Vec<u32> {
        self.rounds.entry(iteration).or_default();
        let mut dropped = Vec::new();
        while self.rounds.len() > ROUNDS_OPEN {
            if let Some((it, _)) = self.rounds.pop_first() {
                dropped.push(it);
            }
        }
        dropped
    }

    /// The round of `iteration` will not complete: closed.
    pub(super) fn close(&mut self, iteration: u32) {
        self.rounds.remove(&iteration);
    }

    /// Whether the round of `iteration` is open (waiting for states).
    pub(super) fn is_open(&self, iteration: u32) -> bool {
        self.rounds.contains_key(&iteration)
    }

    /// `s`, of `iteration`, came in: the whole round (stages 0 to
    /// `relay_stages`, in order) when it is complete now.
    pub(super) fn add(
        &mut self,
        iteration: u32,
        s: SavedState,
        relay_stages: Stage,
    ) -> Option<Vec<SavedState>> {
        let round = self.rounds.get_mut(&iteration)?;
        round.insert(s.stage, s);
        if (0..=relay_stages).all(|st| round.contains_key(&st)) {
            let done = self.rounds.remove(&iteration)?;
            return Some(done.into_values().collect());
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(stage: Stage) -> SavedState {
        SavedState {
            stage,
            from: 10 + stage as NodeId,
            state: Arc::new(vec![stage as u8]),
        }
    }

    #[test]
    fn a_round_is_complete_with_every_stage_of_its_iteration() {
        let mut s = Saves::default();
        assert!(s.open(4).is_empty());
        assert!(s.add(4, state(2), 2).is_none());
        assert!(s.add(9, state(1), 2).is_none(), "a round not open");
        assert!(s.add(4, state(0), 2).is_none());
        let done = s.add(4, state(1), 2).expect("complete");
        let stages: Vec<Stage> = done.iter().map(|d| d.stage).collect();
        assert_eq!(stages, [0, 1, 2]);
        assert!(!s.is_open(4));
    }

    #[test]
    fn an_incomplete_round_is_dropped_when_too_many_are_open() {
        let mut s = Saves::default();
        s.open(4);
        s.add(4, state(0), 2);
        s.open(9);
        assert_eq!(s.open(14), [4]);
        assert!(!s.is_open(4) && s.is_open(9) && s.is_open(14));
        assert!(s.add(4, state(1), 2).is_none());
    }
}
