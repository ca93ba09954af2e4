//! The coordinator's own grants, kept by its deputy: the member that would
//! take over if it died (the next live member by id). The other members'
//! grants survive a coordinator's death (each syncs its own to the
//! successor); without a copy, the coordinator's own were known to nobody,
//! and their microbatches were restarted from the holders, through every
//! stage. With the copy the successor takes them for lost with the hops
//! they came from and went to, and has one stage of each rerun (`Redo`), as
//! for any member that dies.
use super::*;

/// Grants kept per iteration, at most (a coordinator grants itself at most
/// the iteration's microbatches; more is a peer that misbehaves).
const MAX_KEPT: usize = 1 << 16;
/// Iterations kept, at most (those not applied yet: one or two).
const MAX_ITERS: usize = 8;

/// Microbatches with the hop each came from and went to.
type Hops = Vec<(MbId, NodeId, NodeId)>;

#[derive(Debug, Default)]
pub(super) struct DeputyState {
    /// As coordinator: the member last sent all of this node's own grants.
    sent_to: Option<NodeId>,
    /// As deputy: whose grants these are, and which, by iteration.
    of: Option<NodeId>,
    grants: BTreeMap<u32, BTreeMap<MbId, (NodeId, NodeId)>>,
}

impl Node {
    /// The member that would coordinate if this node, coordinating, died.
    fn deputy(&self) -> Option<NodeId> {
        (self.group.members.iter())
            .copied()
            .find(|&m| m != self.id && self.alive(m))
    }

    /// Coordinator: it granted itself `mb` of `iter`; its deputy keeps a
    /// copy (a new deputy gets them all at the next heartbeat).
    pub(super) fn tell_deputy(&mut self, iter: u32, mb: MbId, prev: NodeId, next: NodeId) {
        if let Some(d) = self
            .deputy()
            .filter(|&d| Some(d) == self.deputy_state.sent_to)
        {
            let granted = vec![(mb, prev, next)];
            self.send(d, Msg::Deputy { iter, granted });
        }
    }

    /// Coordinator, each heartbeat: a new deputy gets every grant of this
    /// node's own that is not applied yet.
    pub(super) fn refresh_deputy(&mut self) {
        let d = self.deputy();
        if d == self.deputy_state.sent_to {
            return;
        }
        self.deputy_state.sent_to = d;
        let Some(d) = d else {
            return;
        };
        let me = self.id;
        let mine: Vec<(u32, Hops)> = (self.coordinating.coord_iters.iter())
            .filter(|(_, ci)| !ci.applied)
            .map(|(k, ci)| {
                let g = (ci.granted.iter())
                    .filter(|(_, g)| g.0 == me)
                    .map(|(mb, g)| (*mb, g.1, g.2))
                    .collect();
                (*k, g)
            })
            .collect();
        for (iter, granted) in mine {
            if !granted.is_empty() {
                self.send(d, Msg::Deputy { iter, granted });
            }
        }
    }

    /// This node took over coordinating (it must tell its own deputy
    /// everything, whoever was told before).
    pub(super) fn deputy_reset(&mut self) {
        self.deputy_state.sent_to = None;
    }

    /// Our coordinator's own grants of `iter`, kept in case it dies. From
    /// anyone else, or for an iteration applied here, ignored.
    pub(super) fn on_deputy(&mut self, from: NodeId, iter: u32, granted: Hops) {
        if self.group.coord != Some(from) || from == self.id {
            return;
        }
        if self.iters.last_applied.is_some_and(|a| a >= iter) {
            return;
        }
        let st = &mut self.deputy_state;
        if st.of != Some(from) {
            st.of = Some(from);
            st.grants.clear();
        }
        if !st.grants.contains_key(&iter) && st.grants.len() >= MAX_ITERS {
            return;
        }
        let kept = st.grants.entry(iter).or_default();
        for (mb, prev, next) in granted {
            if mb.iter == iter && kept.len() < MAX_KEPT {
                kept.insert(mb, (prev, next));
            }
        }
    }

    /// Iterations up to `iter` are applied: nothing of them is needed.
    pub(super) fn deputy_forget_upto(&mut self, iter: u32) {
        self.deputy_state.grants.retain(|k, _| *k > iter);
    }

    /// This node took over from `old`, which is gone: the grants `old` gave
    /// itself, as this node kept them, are lost, and one stage of each is
    /// rerun (`redo_lost`: from the hop before, with the gradient of the
    /// hop after) instead of the whole microbatch.
    pub(super) fn inherit_deputy_grants(&mut self, old: NodeId) {
        if self.deputy_state.of != Some(old) {
            return;
        }
        self.deputy_state.of = None;
        let now = self.now;
        for (iter, mbs) in std::mem::take(&mut self.deputy_state.grants) {
            if self.iters.last_applied.is_some_and(|a| a >= iter) {
                continue;
            }
            let ci = self.coordinating.coord_iters.entry(iter).or_default();
            if ci.applied {
                continue;
            }
            let ended: Option<BTreeSet<NodeId>> =
                ci.end.as_ref().map(|e| e.1.iter().copied().collect());
            for (mb, (prev, next)) in mbs {
                if ci.granted.contains_key(&mb) || ci.dropped.contains(&mb) {
                    continue;
                }
                if let (Some(m), Some(h)) = (ci.missing.as_mut(), ended.as_ref()) {
                    if h.contains(&mb.holder) {
                        m.insert(mb);
                    }
                }
                ci.lost.entry(mb).or_insert(Lost {
                    prev: Some(prev),
                    next: Some(next),
                    dead: old,
                    since: now,
                    level: 0,
                });
            }
            self.redo_lost(iter);
        }
    }
}
