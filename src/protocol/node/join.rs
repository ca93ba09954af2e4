//! Start and join: a starting node becomes active at once; a joining node
//! asks each stage for a summary, picks the bottleneck stage, downloads its
//! state from a member and joins its group.
use super::*;

impl Node {
    pub(super) fn start(&mut self, peers: Vec<(NodeId, Stage)>) {
        for (p, s) in peers {
            if s == self.stage {
                self.members.insert(p);
            } else if p != self.id {
                self.learn(p, s);
            }
        }
        self.members.insert(self.id);
        self.become_active();
        if self.stage == 0 {
            // The holders' coordinator opens the first iteration after the
            // start delay (flows are being built meanwhile).
            self.next_tick = self.now + self.cfg.tick;
        }
    }

    pub(super) fn become_active(&mut self) {
        self.phase = Phase::Active;
        self.next_tick = self.now + self.cfg.tick;
        self.recompute_coord();
        self.introduce_all(None);
        if let Some(c) = self.coord {
            if c != self.id {
                let st = self.stage;
                self.send(c, Msg::GroupJoin { stage: st });
            }
        }
        let st = self.stage;
        self.event(Event::Active { stage: st });
    }

    pub(super) fn join(&mut self, peers: Vec<(NodeId, Stage)>) {
        for (p, s) in peers {
            if p != self.id {
                self.learn(p, s);
            }
        }
        self.phase = Phase::Querying { since: self.now };
        self.next_tick = self.now + self.cfg.tick;
        let targets: Vec<NodeId> = {
            // Up to two peers of every relay stage.
            let mut per: BTreeMap<Stage, Vec<NodeId>> = BTreeMap::new();
            for (id, p) in &self.peers {
                if p.stage > 0 {
                    let v = per.entry(p.stage).or_default();
                    if v.len() < 2 {
                        v.push(*id);
                    }
                }
            }
            per.into_values().flatten().collect()
        };
        for t in targets {
            self.send(t, Msg::StageQuery);
        }
    }

    pub(super) fn choose_stage(&mut self) {
        // Bottleneck first: the stage with the smallest aggregate throughput
        // (largest predicted time per microbatch) gains the most from us.
        let mut best: Option<(f64, Stage)> = None;
        for (s, info) in &self.stage_infos {
            if info.members == 0 {
                continue;
            }
            let t = 1.0 / info.throughput.max(1e-9);
            if best.is_none_or(|b| t > b.0) {
                best = Some((t, *s));
            }
        }
        let Some((_, stage)) = best else {
            // Nobody answered: ask again next tick.
            self.phase = Phase::Querying { since: self.now };
            return;
        };
        let src = self
            .peers
            .iter()
            .filter(|(_, p)| p.stage == stage && !p.dead)
            .map(|(id, _)| *id)
            .next();
        match src {
            Some(src) => {
                self.stage = stage;
                self.phase = Phase::Downloading { stage };
                self.send(src, Msg::StateRequest);
            }
            None => self.phase = Phase::Querying { since: self.now },
        }
    }
}
