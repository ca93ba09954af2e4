//! The run audit: the facts of a swarm run, from the lines its nodes print
//! and what its operator did, and the verdict on them (every microbatch
//! counted exactly once, the replicas of each stage agree, recovery times,
//! the loss against a reference).
//!
//! Pure: no processes, no clock. Whoever runs the swarm (`gwtf demo`, a
//! Rust embedder, or a C, C++ or Go operator through `gwtf_audit_*`)
//! timestamps every line a node prints and every action of its own
//! (launch, kill, exit) as an [`Entry`] and feeds them to [`Facts::push`],
//! which keeps the live view (who is alive, in which stage) an orchestrator
//! steers by; [`Facts::summary`] turns the whole run into the numbers
//! `gwtf demo --json` writes, its report draws, and its exit status depends
//! on.
//!
//! The node's event lines are `gwtf node --json`'s contract, the library's
//! `swarm::event_log` schema (one JSON object per line, `"event"` names the
//! kind). A line that is not JSON, or a known event with missing fields, is
//! garbage: counted per node, never fatal. An unknown event kind is counted
//! too (a newer node may print more).
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

pub type NodeId = u64;

/// One line of `gwtf node --json`: the library's event schema.
pub use super::event_log::{parse_line, LogEvent as Event};

/// What happened, as the orchestrator saw it.
#[derive(Clone, Debug, PartialEq)]
pub enum What {
    /// A node process was started. `stage`: the stage it was told (founding
    /// members; joiners with `--stage K`), `None` when the protocol picks.
    Launched {
        node: NodeId,
        holder: bool,
        joiner: bool,
        stage: Option<u32>,
    },
    /// A line on the node's stdout (`None`: garbage).
    Line { node: NodeId, event: Option<Event> },
    /// The orchestrator sent SIGKILL; `aim` says what the kill was timed to
    /// hit; `joiner`: the joiner whose state download it was timed to hit;
    /// `carrying`: microbatches in flight on the victim then (see
    /// [`Facts::in_flight`]; None: not known).
    Killed {
        node: NodeId,
        aim: String,
        joiner: Option<NodeId>,
        carrying: Option<u64>,
    },
    /// The orchestrator sent SIGSTOP, to send SIGCONT `for_s` seconds later;
    /// with `cut`, SIGUSR1 (the node's link cut), to send SIGUSR2.
    Paused {
        node: NodeId,
        aim: String,
        for_s: f64,
        carrying: Option<u64>,
        cut: bool,
    },
    /// The orchestrator sent SIGCONT to a paused node.
    Resumed { node: NodeId },
    /// The orchestrator sent SIGTERM (a graceful leave, at the end of the run).
    Stopped { node: NodeId },
    /// The process ended (`code` None: by a signal).
    Exited { node: NodeId, code: Option<i32> },
}

/// `what` at `t` seconds after the demo started.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub t: f64,
    pub what: What,
}

/// What is known of one node.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NodeFacts {
    pub holder: bool,
    pub joiner: bool,
    /// The stage it was told or announced (`active`).
    pub stage: Option<u32>,
    pub addr: Option<String>,
    pub launched_s: f64,
    pub active_s: Option<f64>,
    pub killed_s: Option<f64>,
    pub exited_s: Option<f64>,
    /// Exit status; `None` while running or when ended by a signal.
    pub exit_code: Option<i32>,
    pub done: bool,
    pub left: bool,
    /// Stopped by the orchestrator (SIGSTOP, or its link cut) now.
    pub paused: bool,
    /// Its link cut by the orchestrator now (`paused` too).
    pub cut: bool,
    /// It fenced itself and is not active again yet: no member meanwhile.
    pub fenced: bool,
    /// Updates applied since it last became active (a node back from a
    /// fence holds a downloaded state, like a joiner).
    pub applied_since_active: u64,
    /// It fenced itself at least once.
    pub ever_fenced: bool,
    /// The last `stats` (cumulative compute and useful milliseconds).
    pub compute_ms: f64,
    pub useful_ms: f64,
    /// Lines per event kind, and lines that were not events.
    pub events: BTreeMap<String, u64>,
    pub garbage_lines: u64,
    pub errors: Vec<String>,
}

impl NodeFacts {
    /// Running (not killed, not exited).
    pub fn alive(&self) -> bool {
        self.killed_s.is_none() && self.exited_s.is_none()
    }
    /// Running and a member of its stage.
    pub fn member(&self) -> bool {
        self.alive() && self.active_s.is_some() && !self.left && !self.fenced
    }
    /// A member that is not paused (SIGSTOP): one that can serve its stage.
    pub fn available(&self) -> bool {
        self.member() && !self.paused
    }
    /// A member whose state is known current: a founding one, or a joiner
    /// that applied an iteration since (a joiner whose download missed an
    /// update until it applies one may hold a stale state).
    pub fn in_sync(&self) -> bool {
        self.member() && ((!self.joiner && !self.ever_fenced) || self.applied_since_active > 0)
    }
}

/// One holder's report of one iteration.
#[derive(Clone, Debug)]
struct HolderIteration {
    t: f64,
    node: NodeId,
    loss: f64,
    microbatches: u64,
    tokens: u64,
}

/// One `committed` line.
#[derive(Clone, Debug, PartialEq)]
struct Commit {
    node: NodeId,
    microbatches: u64,
    dropped: u64,
    /// (holder, index) of each microbatch counted, when the line lists them.
    mbs: Option<Vec<(u64, u64)>>,
}

/// One kill.
#[derive(Clone, Debug)]
struct Kill {
    t: f64,
    node: NodeId,
    stage: Option<u32>,
    aim: String,
    joiner: Option<NodeId>,
    carrying: Option<u64>,
}

/// One pause (SIGSTOP, then SIGCONT).
#[derive(Clone, Debug)]
struct Pause {
    t: f64,
    node: NodeId,
    stage: Option<u32>,
    aim: String,
    for_s: f64,
    carrying: Option<u64>,
    resumed: Option<f64>,
    /// A cut link (not a pause).
    cut: bool,
}

/// A microbatch a holder started and has not reported done (`mb_done`), with
/// the relays it is expected on: those of the path the same holder's
/// microbatch of the same index took last (the holders route a microbatch
/// index much the same way from one iteration to the next), the dead ones
/// left out. Empty before any of that index was done.
#[derive(Clone, Debug, PartialEq)]
pub struct InFlight {
    pub holder: NodeId,
    pub iteration: u64,
    pub index: u64,
    pub path: Vec<NodeId>,
}

/// The run's record, updated line by line.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// Stages of the protocol: 0 (holders) and the relay stages 1..=S-2.
    pub protocol_stages: u32,
    pub nodes: BTreeMap<NodeId, NodeFacts>,
    iterations: BTreeMap<u64, Vec<HolderIteration>>,
    applied: BTreeMap<(u32, u64), BTreeMap<NodeId, String>>,
    commits: BTreeMap<(u32, u64), Vec<Commit>>,
    /// (t, reporting node, kind, stage, iteration)
    recovered: Vec<(f64, NodeId, String, u32, u64)>,
    kills: Vec<Kill>,
    pauses: Vec<Pause>,
    /// The last path of each (holder, microbatch index).
    mb_paths: BTreeMap<(NodeId, u64), Vec<NodeId>>,
    /// (holder, iteration, index) of every microbatch reported done.
    mb_done: BTreeSet<(NodeId, u64, u64)>,
    /// Each holder's last iteration reported final.
    holder_iteration: BTreeMap<NodeId, u64>,
    /// (t, reporting node, stage, iteration)
    stalls: Vec<(f64, NodeId, u32, u64)>,
    /// Times a node fenced itself (paused, cut off, evicted).
    pub fences: u64,
    /// (t, joiner)
    joins: Vec<(f64, NodeId)>,
    /// The state downloads, in order.
    downloads: Vec<DownloadRow>,
    /// (t, reporting node, stage)
    stage_empty: Vec<(f64, NodeId, u32)>,
    /// Emptied stages taken up again.
    restores: Vec<RestoreRow>,
    /// Members per protocol stage after each change.
    membership: Vec<(f64, Vec<u32>)>,
    peer_lost: u64,
    last_t: f64,
}

impl Facts {
    /// A record for a model cut into `model_stages` pipeline stages.
    pub fn new(model_stages: u32) -> Facts {
        Facts {
            protocol_stages: model_stages.saturating_sub(1).max(1),
            ..Facts::default()
        }
    }

    pub fn push(&mut self, e: &Entry) {
        let t = e.t;
        self.last_t = self.last_t.max(t);
        match &e.what {
            What::Launched {
                node,
                holder,
                joiner,
                stage,
            } => {
                self.nodes.insert(
                    *node,
                    NodeFacts {
                        holder: *holder,
                        joiner: *joiner,
                        stage: if *holder { Some(0) } else { *stage },
                        launched_s: t,
                        ..NodeFacts::default()
                    },
                );
                if *joiner {
                    self.joins.push((t, *node));
                }
            }
            What::Killed {
                node,
                aim,
                joiner,
                carrying,
            } => {
                let was_member = self.nodes.get(node).is_some_and(|n| n.member());
                let stage = self.nodes.get(node).and_then(|n| n.stage);
                if let Some(n) = self.nodes.get_mut(node) {
                    n.killed_s.get_or_insert(t);
                    n.paused = false;
                }
                self.kills.push(Kill {
                    t,
                    node: *node,
                    stage,
                    aim: aim.clone(),
                    joiner: *joiner,
                    carrying: *carrying,
                });
                if was_member {
                    self.record_membership(t);
                }
            }
            What::Paused {
                node,
                aim,
                for_s,
                carrying,
                cut,
            } => {
                let stage = self.nodes.get(node).and_then(|n| n.stage);
                if let Some(n) = self.nodes.get_mut(node) {
                    n.paused = true;
                    n.cut = *cut;
                }
                self.pauses.push(Pause {
                    t,
                    node: *node,
                    stage,
                    aim: aim.clone(),
                    for_s: *for_s,
                    carrying: *carrying,
                    resumed: None,
                    cut: *cut,
                });
            }
            What::Resumed { node } => {
                if let Some(n) = self.nodes.get_mut(node) {
                    n.paused = false;
                    n.cut = false;
                }
                if let Some(p) = self
                    .pauses
                    .iter_mut()
                    .rev()
                    .find(|p| p.node == *node && p.resumed.is_none())
                {
                    p.resumed = Some(t);
                }
            }
            What::Stopped { .. } => {}
            What::Exited { node, code } => {
                let was_member = self.nodes.get(node).is_some_and(|n| n.member());
                if let Some(n) = self.nodes.get_mut(node) {
                    n.exited_s.get_or_insert(t);
                    n.exit_code = *code;
                }
                if was_member {
                    self.record_membership(t);
                }
            }
            What::Line { node, event } => self.line(t, *node, event.as_ref()),
        }
    }

    fn line(&mut self, t: f64, node: NodeId, event: Option<&Event>) {
        let n = self.nodes.entry(node).or_default();
        let Some(ev) = event else {
            n.garbage_lines += 1;
            return;
        };
        *n.events.entry(ev.kind().to_string()).or_default() += 1;
        // The node field of a line is the node's word; the orchestrator knows
        // which process printed it and files it under that one.
        match ev {
            Event::Listening { addr, .. } => n.addr = addr.clone(),
            Event::Active { stage, .. } => {
                let stage = if n.holder { 0 } else { *stage };
                let became = n.active_s.is_none() || n.stage != Some(stage) || n.fenced;
                n.stage = Some(stage);
                n.active_s.get_or_insert(t);
                n.fenced = false;
                n.applied_since_active = 0;
                if became && n.alive() {
                    self.record_membership(t);
                }
            }
            Event::Applied {
                stage,
                iteration,
                weights_sha256,
                ..
            } => {
                n.applied_since_active += 1;
                self.applied
                    .entry((*stage, *iteration))
                    .or_default()
                    .insert(node, weights_sha256.clone());
            }
            Event::Iteration {
                iteration,
                loss,
                microbatches,
                tokens,
                ..
            } => {
                if n.holder {
                    let last = self.holder_iteration.entry(node).or_insert(*iteration);
                    *last = (*last).max(*iteration);
                }
                let v = self.iterations.entry(*iteration).or_default();
                v.retain(|h| h.node != node);
                v.push(HolderIteration {
                    t,
                    node,
                    loss: *loss,
                    microbatches: *microbatches,
                    tokens: *tokens,
                });
            }
            Event::PeerLost { .. } => self.peer_lost += 1,
            Event::Recovered {
                kind,
                stage,
                iteration,
                ..
            } => self
                .recovered
                .push((t, node, kind.clone(), *stage, *iteration)),
            Event::StageEmpty { stage, .. } => self.stage_empty.push((t, node, *stage)),
            Event::StageRestored {
                stage,
                from,
                iteration,
                applied,
                ..
            } => {
                let how = Taken::Copy(*from, *iteration);
                self.restored(t, node, *stage, how, Some(*applied))
            }
            Event::StageRebuilt {
                stage,
                from,
                applied,
                ..
            } => {
                let how = Taken::Neighbours(from.clone());
                self.restored(t, node, *stage, how, *applied)
            }
            Event::StageRestarted { stage, applied, .. } => {
                self.restored(t, node, *stage, Taken::Initial, *applied)
            }
            Event::StateDownload {
                from,
                bytes,
                ms,
                bytes_per_s,
                weights_ms,
                ..
            } => self.downloads.push(DownloadRow {
                t_s: t,
                node,
                from: *from,
                bytes: *bytes,
                ms: *ms,
                bytes_per_s: *bytes_per_s,
                weights_ms: *weights_ms,
            }),
            Event::Stats {
                compute_ms,
                useful_ms,
                ..
            } => {
                n.compute_ms = *compute_ms;
                n.useful_ms = *useful_ms;
            }
            Event::Committed {
                stage,
                iteration,
                microbatches,
                dropped,
                mbs,
                ..
            } => self
                .commits
                .entry((*stage, *iteration))
                .or_default()
                .push(Commit {
                    node,
                    microbatches: *microbatches,
                    dropped: *dropped,
                    mbs: mbs.as_ref().map(|v| {
                        v.iter()
                            .map(|&[holder, index, _]| (holder, index))
                            .collect()
                    }),
                }),
            Event::Stalled {
                stage, iteration, ..
            } => self.stalls.push((t, node, *stage, *iteration)),
            Event::MbDone {
                holder,
                index,
                iteration,
                path,
                ..
            } => {
                self.mb_done.insert((*holder, *iteration, *index));
                self.mb_paths.insert((*holder, *index), path.clone());
            }
            Event::Done { .. } => n.done = true,
            Event::Left { .. } => {
                let was = n.member();
                n.left = true;
                if was {
                    self.record_membership(t);
                }
            }
            Event::Error { message, .. } => n.errors.push(message.clone()),
            Event::Fenced { .. } => {
                self.fences += 1;
                // Not a member, nor one to keep its stage, until it is
                // active again and applied an update since.
                let was_member = n.member();
                n.fenced = true;
                n.ever_fenced = true;
                if was_member {
                    self.record_membership(t);
                }
            }
            // Kinds the run's facts do not need, and kinds of newer builds.
            _ => {}
        }
    }

    /// `node` took up emptied `stage` at `t`, as `how` says, standing for
    /// `applied`. The
    /// updates after `applied` that its dead members printed were lost with
    /// them: the stage makes them again, so they are no replica's to
    /// compare.
    fn restored(&mut self, t: f64, node: NodeId, stage: u32, how: Taken, applied: Option<u64>) {
        let copy = match how {
            Taken::Copy(h, k) => Some((h, k)),
            _ => None,
        };
        let after = applied.map_or(0, |a| a + 1);
        let dead: BTreeSet<NodeId> = (self.nodes.iter())
            .filter(|(_, n)| n.killed_s.is_some())
            .map(|(id, _)| *id)
            .collect();
        for ((s, _), by) in self.applied.range_mut((stage, after)..=(stage, u64::MAX)) {
            debug_assert_eq!(*s, stage);
            by.retain(|id, _| !dead.contains(id));
        }
        self.applied.retain(|_, by| !by.is_empty());
        // The updates the weights taken up miss.
        let lost = after.saturating_sub(copy.map_or(0, |c| c.1 + 1));
        self.restores.push(RestoreRow {
            t_s: t,
            node,
            stage,
            from: copy.map(|c| c.0),
            iteration: copy.map(|c| c.1),
            rebuilt_from: match how {
                Taken::Neighbours(n) => n,
                _ => Vec::new(),
            },
            applied,
            updates_lost: lost,
            joiner_started_s: self.nodes.get(&node).map_or(t, |n| n.launched_s),
            resumed_s: None,
        });
    }

    /// The restores, each with when training resumed on it: the first
    /// holder's report of the first iteration on the weights taken up.
    fn restores_resumed(&self) -> Vec<RestoreRow> {
        let mut rows = self.restores.clone();
        for r in &mut rows {
            let first = r.applied.map_or(0, |a| a + 1);
            r.resumed_s = (self.iterations.get(&first).into_iter().flatten())
                .map(|h| h.t)
                .filter(|&t| t >= r.t_s)
                .min_by(f64::total_cmp);
        }
        rows
    }

    fn record_membership(&mut self, t: f64) {
        let counts = self.members_per_stage();
        if self.membership.last().map(|m| &m.1) != Some(&counts) {
            self.membership.push((t, counts));
        }
    }

    /// Live members per protocol stage (index 0: holders).
    pub fn members_per_stage(&self) -> Vec<u32> {
        let mut c = vec![0u32; self.protocol_stages as usize];
        for n in self.nodes.values().filter(|n| n.member()) {
            if let Some(s) = n.stage.filter(|&s| s < self.protocol_stages) {
                c[s as usize] += 1;
            }
        }
        c
    }

    /// Members that are not paused, per stage.
    pub fn available_per_stage(&self) -> Vec<u32> {
        let mut c = vec![0u32; self.protocol_stages as usize];
        for n in self.nodes.values().filter(|n| n.available()) {
            if let Some(s) = n.stage.filter(|&s| s < self.protocol_stages) {
                c[s as usize] += 1;
            }
        }
        c
    }

    /// Members known to hold their stage's current state (and not paused:
    /// able to serve it), per stage.
    pub fn in_sync_per_stage(&self) -> Vec<u32> {
        let mut c = vec![0u32; self.protocol_stages as usize];
        for n in self.nodes.values().filter(|n| n.in_sync() && !n.paused) {
            if let Some(s) = n.stage.filter(|&s| s < self.protocol_stages) {
                c[s as usize] += 1;
            }
        }
        c
    }

    /// The microbatches in flight now, `microbatches` per holder and
    /// iteration: those of each running holder's open iteration (the one
    /// after the last it reported final) it has not reported done.
    pub fn in_flight(&self, microbatches: u64) -> Vec<InFlight> {
        let mut v = Vec::new();
        for (&h, n) in self.holders() {
            if !n.alive() || n.done || n.active_s.is_none() {
                continue;
            }
            let iteration = self.holder_iteration.get(&h).map_or(0, |i| i + 1);
            for index in 0..microbatches {
                if self.mb_done.contains(&(h, iteration, index)) {
                    continue;
                }
                let path = self
                    .mb_paths
                    .get(&(h, index))
                    .map(|p| {
                        p.iter()
                            .copied()
                            .filter(|id| self.nodes.get(id).is_some_and(|x| !x.holder && x.alive()))
                            .collect()
                    })
                    .unwrap_or_default();
                v.push(InFlight {
                    holder: h,
                    iteration,
                    index,
                    path,
                });
            }
        }
        v
    }

    pub fn holders(&self) -> impl Iterator<Item = (&NodeId, &NodeFacts)> {
        self.nodes.iter().filter(|(_, n)| n.holder)
    }

    /// Every holder printed `done`.
    pub fn holders_done(&self) -> bool {
        self.holders().count() > 0 && self.holders().all(|(_, n)| n.done)
    }

    /// Iterations every holder reported, in order, with the swarm's view of
    /// each: (iteration, time of the last holder's report, loss as the mean
    /// over all holders' microbatches, microbatches, tokens).
    pub fn completed_iterations(&self) -> Vec<IterationRow> {
        let holders: BTreeSet<NodeId> = self.holders().map(|(&id, _)| id).collect();
        self.iterations
            .iter()
            .filter(|(_, v)| {
                !holders.is_empty() && holders.iter().all(|h| v.iter().any(|x| x.node == *h))
            })
            .map(|(&i, v)| {
                let mbs: u64 = v.iter().map(|h| h.microbatches).sum();
                let weighted: f64 = v.iter().map(|h| h.loss * h.microbatches as f64).sum();
                let loss = if mbs > 0 {
                    weighted / mbs as f64
                } else {
                    v.iter().map(|h| h.loss).sum::<f64>() / v.len() as f64
                };
                IterationRow {
                    iteration: i,
                    t_s: v.iter().map(|h| h.t).fold(0.0, f64::max),
                    loss,
                    microbatches: mbs,
                    tokens: v.iter().map(|h| h.tokens).sum(),
                }
            })
            .collect()
    }

    /// Crashes so far and microbatch hops recovered so far.
    pub fn crashes(&self) -> usize {
        self.kills.len()
    }
    pub fn pause_count(&self) -> usize {
        self.pauses.iter().filter(|p| !p.cut).count()
    }

    /// Links cut so far.
    pub fn cut_count(&self) -> usize {
        self.pauses.iter().filter(|p| p.cut).count()
    }
    pub fn recovered_count(&self) -> usize {
        self.recovered.len()
    }
    pub fn joins(&self) -> usize {
        self.joins.len()
    }

    /// What became of joiner `j`'s state download, for a kill timed to hit it.
    fn join_outcome(&self, k: &Kill, j: NodeId) -> String {
        let dl = self.downloads.iter().find(|d| d.node == j);
        match dl {
            Some(d) if d.from == k.node && d.t_s <= k.t => {
                "missed: the joiner had its state from the victim before the kill".into()
            }
            Some(d) if d.t_s <= k.t => format!(
                "missed: the joiner had its state (from node {}) before the kill",
                d.from
            ),
            Some(d) => format!(
                "the joiner downloaded its state from node {} {:.0} ms after the kill",
                d.from,
                (d.t_s - k.t) * 1000.0
            ),
            None => "the joiner never downloaded a state".into(),
        }
    }

    /// The run's numbers. `plan`: what was asked for; `reference`: the
    /// single-process loss per iteration, when it ran; `wall_s`: the demo's
    /// whole duration.
    pub fn summary(&self, plan: &Plan, reference: Option<&[f64]>, wall_s: f64) -> Summary {
        let rows = self.completed_iterations();
        let mut failures: Vec<String> = Vec::new();

        // Training started when the last founding member became active.
        let founders_active = self
            .nodes
            .values()
            .filter(|n| !n.joiner)
            .map(|n| n.active_s.unwrap_or(n.launched_s))
            .fold(0.0, f64::max);
        let t_last = rows.last().map_or(founders_active, |r| r.t_s);
        let tokens: u64 = rows.iter().map(|r| r.tokens).sum();
        let train_s = (t_last - founders_active).max(0.0);
        let tokens_per_s = if train_s > 0.0 {
            tokens as f64 / train_s
        } else {
            0.0
        };
        let mut throughput = Vec::new();
        let mut prev = founders_active;
        for r in &rows {
            let dt = r.t_s - prev;
            if dt > 0.0 {
                throughput.push((r.t_s, r.tokens as f64 / dt));
            }
            prev = r.t_s;
        }

        // Replicas: every (stage, iteration) whose nodes printed more than
        // one distinct hash. The last update a killed node applied does not
        // count: it may be one its stage then committed again without it
        // (its coordinator died after telling only it); it died with it.
        // Every earlier update of that node was confirmed by the next
        // aggregate, where members compare their weights.
        let mut last_applied: BTreeMap<u64, u64> = BTreeMap::new();
        for ((_, it), by_node) in &self.applied {
            for id in by_node.keys() {
                let e = last_applied.entry(*id).or_insert(*it);
                *e = (*e).max(*it);
            }
        }
        let mut disagreements = Vec::new();
        let mut replica_checks = 0u64;
        for ((stage, it), by_node) in &self.applied {
            let by_node: BTreeMap<u64, String> = by_node
                .iter()
                .filter(|(id, _)| {
                    let killed = self.nodes.get(id).is_some_and(|n| n.killed_s.is_some());
                    !(killed && last_applied.get(*id) == Some(it))
                })
                .map(|(id, h)| (*id, h.clone()))
                .collect();
            let by_node = &by_node;
            let distinct: BTreeSet<&String> = by_node.values().collect();
            if by_node.len() >= 2 {
                replica_checks += 1;
            }
            if distinct.len() > 1 {
                // Who printed what (the first 8 hex digits), and who was
                // killed afterwards: a member that applied an aggregate its
                // stage later replaced forked the stage's state.
                let who: Vec<String> = by_node
                    .iter()
                    .map(|(id, h)| {
                        let fate = self
                            .nodes
                            .get(id)
                            .and_then(|n| n.killed_s)
                            .map_or(String::new(), |t| format!(", killed at {t:.2} s"));
                        format!("node {id} {}{fate}", &h[..h.len().min(8)])
                    })
                    .collect();
                disagreements.push(format!(
                    "stage {stage} iteration {it}: {} nodes printed {} different weights_sha256 \
                     ({})",
                    by_node.len(),
                    distinct.len(),
                    who.join("; ")
                ));
            }
        }
        let replicas_agree = disagreements.is_empty();
        failures.extend(disagreements.iter().cloned());

        // Microbatch accounting per stage and completed iteration.
        let mut lost = 0u64;
        let mut double = 0u64;
        let mut dropped = 0u64;
        let mut recommits = 0u64;
        let mut accounting = Vec::new();
        let stages_with_commits: BTreeSet<u32> = self.commits.keys().map(|k| k.0).collect();
        let checked: Vec<u32> = (0..self.protocol_stages)
            .filter(|&s| s > 0 || stages_with_commits.contains(&0))
            .collect();
        let mut unverified = Vec::new();
        let mut prev_t = founders_active;
        for r in &rows {
            let planned = plan.microbatches * self.holders().count() as u64;
            if r.microbatches < planned {
                lost += planned - r.microbatches;
                failures.push(format!(
                    "iteration {}: the holders trained {} microbatches, {} were planned",
                    r.iteration, r.microbatches, planned
                ));
            }
            for &stage in &checked {
                let Some(cs) = self.commits.get(&(stage, r.iteration)) else {
                    let killed_here = self.kills.iter().any(|k| {
                        k.stage == Some(stage) && k.t > prev_t && k.t <= r.t_s + KILL_GRACE_S
                    });
                    if killed_here {
                        unverified.push(format!(
                            "stage {stage} iteration {}: no committed line (a member was \
                             killed during the iteration)",
                            r.iteration
                        ));
                    } else {
                        failures.push(format!(
                            "stage {stage} iteration {}: no committed line",
                            r.iteration
                        ));
                    }
                    continue;
                };
                // A coordinator commits again when a member is lost during
                // the commit: the last commit is the one applied.
                let last = cs.last().expect("non-empty");
                recommits += cs.len() as u64 - 1;
                let n = last.microbatches;
                let (l, d) = match &last.mbs {
                    // The list names them: each planned (holder, index) once.
                    Some(mbs) => {
                        let mut seen: BTreeMap<(u64, u64), u64> = BTreeMap::new();
                        for &m in mbs {
                            *seen.entry(m).or_default() += 1;
                        }
                        let planned: BTreeSet<(u64, u64)> = self
                            .holders()
                            .flat_map(|(&h, _)| (0..plan.microbatches).map(move |i| (h, i)))
                            .collect();
                        let missing = planned.iter().filter(|m| !seen.contains_key(m)).count();
                        let twice: u64 = seen.values().map(|&c| c - 1).sum();
                        let foreign = seen.keys().filter(|m| !planned.contains(m)).count();
                        if foreign > 0 {
                            failures.push(format!(
                                "stage {stage} iteration {}: {foreign} committed microbatch(es) \
                                 no holder planned",
                                r.iteration
                            ));
                        }
                        ((missing as u64).max(last.dropped), twice)
                    }
                    None => (
                        r.microbatches.saturating_sub(n).max(last.dropped),
                        n.saturating_sub(r.microbatches),
                    ),
                };
                dropped += last.dropped;
                if l > 0 {
                    failures.push(format!(
                        "stage {stage} iteration {}: {l} microbatch(es) lost ({n} committed, {} \
                         trained by the holders, {} dropped)",
                        r.iteration, r.microbatches, last.dropped
                    ));
                }
                if d > 0 {
                    failures.push(format!(
                        "stage {stage} iteration {}: {d} microbatch(es) counted twice ({n} \
                         committed, {} trained by the holders)",
                        r.iteration, r.microbatches
                    ));
                }
                lost += l;
                double += d;
                accounting.push(StageAccount {
                    stage,
                    iteration: r.iteration,
                    committed: n,
                    expected: r.microbatches,
                    dropped: last.dropped,
                    commits: cs.len() as u64,
                });
            }
            prev_t = r.t_s;
        }

        // Wasted compute: every node's last stats, killed ones included.
        let compute: f64 = self.nodes.values().map(|n| n.compute_ms).sum();
        let useful: f64 = self.nodes.values().map(|n| n.useful_ms).sum();
        let wasted_compute_pct = if compute > 0.0 {
            Some(((compute - useful) / compute * 100.0).max(0.0))
        } else {
            None
        };

        // Recovery: from a kill to the first `recovered` line for the killed
        // node's stage (a hop rerouted in that stage, or a microbatch
        // restarted from the start) before the next kill of a node of that
        // stage.
        let mut kills = Vec::new();
        for (i, k) in self.kills.iter().enumerate() {
            let next_same = self.kills[i + 1..]
                .iter()
                .find(|n| n.stage == k.stage)
                .map_or(f64::INFINITY, |n| n.t);
            let rec = k.stage.and_then(|s| {
                self.recovered
                    .iter()
                    .find(|r| (r.3 == s || r.2 == "restarted") && r.0 >= k.t && r.0 < next_same)
                    .map(|r| (r.0 - k.t) * 1000.0)
            });
            kills.push(KillRow {
                t_s: k.t,
                node: k.node,
                stage: k.stage,
                aim: k.aim.clone(),
                recovery_ms: rec,
                joiner: k.joiner,
                join_outcome: k.joiner.map(|j| self.join_outcome(k, j)),
                carrying: k.carrying,
            });
        }
        let pauses: Vec<PauseRow> = self
            .pauses
            .iter()
            .map(|p| {
                let next_same = self
                    .kills
                    .iter()
                    .map(|k| (k.t, k.stage))
                    .chain(self.pauses.iter().map(|q| (q.t, q.stage)))
                    .filter(|&(t, s)| t > p.t && s == p.stage)
                    .map(|(t, _)| t)
                    .fold(f64::INFINITY, f64::min);
                let rec = p.stage.and_then(|s| {
                    self.recovered
                        .iter()
                        .find(|r| (r.3 == s || r.2 == "restarted") && r.0 >= p.t && r.0 < next_same)
                        .map(|r| (r.0 - p.t) * 1000.0)
                });
                PauseRow {
                    t_s: p.t,
                    node: p.node,
                    stage: p.stage,
                    aim: p.aim.clone(),
                    for_s: p.for_s,
                    resumed_s: p.resumed,
                    carrying: p.carrying,
                    recovery_ms: rec,
                    kind: if p.cut { "cut" } else { "pause" },
                }
            })
            .collect();
        let mut rec: Vec<f64> = kills.iter().filter_map(|k| k.recovery_ms).collect();
        rec.sort_by(f64::total_cmp);
        let recovery_ms_median = median(&rec);

        let finished = self.holders_done() && rows.len() as u64 >= plan.iterations;
        if !self.holders_done() {
            failures.push(format!(
                "the run did not finish: {} of {} iterations completed, {} of {} holders done",
                rows.len(),
                plan.iterations,
                self.holders().filter(|(_, n)| n.done).count(),
                self.holders().count()
            ));
        } else if (rows.len() as u64) < plan.iterations {
            failures.push(format!(
                "the holders said done after {} of {} iterations",
                rows.len(),
                plan.iterations
            ));
        }
        for (id, n) in self.holders() {
            if let Some(c) = n.exit_code.filter(|&c| c != 0) {
                failures.push(format!("holder {id} exited with status {c}"));
            }
        }

        let loss: Vec<f64> = rows.iter().map(|r| r.loss).collect();
        // The swarm trains exactly the reference's microbatches: its loss
        // should be the reference's, crashes or not.
        let mut warnings = Vec::new();
        let gap = reference.and_then(|r| {
            loss.iter()
                .zip(r)
                .enumerate()
                .map(|(i, (a, b))| (i, (a - b).abs()))
                .max_by(|x, y| x.1.total_cmp(&y.1))
        });
        if let Some((i, g)) = gap.filter(|g| g.1 > LOSS_TOLERANCE) {
            let why = if self.restores.is_empty() {
                String::new()
            } else {
                "; expected: an emptied stage was taken up with weights that miss updates \
                 the other stages made"
                    .into()
            };
            warnings.push(format!(
                "the swarm's loss departs from the single-process reference by up to {g:.4} \
                 (iteration {}: {:.4} against {:.4}){why}",
                rows[i].iteration,
                loss[i],
                reference.map_or(f64::NAN, |r| r[i])
            ));
        }
        for (t, node, stage, it) in &self.stalls {
            warnings.push(format!(
                "{t:.1} s: node {node} says stage {stage} stalled in iteration {it}"
            ));
        }
        Summary {
            ok: failures.is_empty(),
            failures,
            warnings,
            unverified,
            finished,
            model: plan.model.clone(),
            model_stages: plan.stages,
            holders: self.holders().count() as u64,
            relays_founding: self
                .nodes
                .values()
                .filter(|n| !n.holder && !n.joiner)
                .count() as u64,
            microbatches_per_holder: plan.microbatches,
            iterations_planned: plan.iterations,
            iterations: rows.len() as u64,
            lost_microbatches: lost,
            double_counted_microbatches: double,
            dropped_microbatches: dropped,
            recommits,
            replicas_agree,
            replica_checks,
            crashes: self.kills.len() as u64,
            stalls: self
                .stalls
                .iter()
                .map(|&(t_s, node, stage, iteration)| StallRow {
                    t_s,
                    node,
                    stage,
                    iteration,
                })
                .collect(),
            joins: self.joins.len() as u64,
            joins_active: self
                .joins
                .iter()
                .filter(|(_, id)| self.nodes.get(id).is_some_and(|n| n.active_s.is_some()))
                .count() as u64,
            recovered_hops: self.recovered.len() as u64,
            recovered_rerouted: self.recovered.iter().filter(|r| r.2 == "rerouted").count() as u64,
            recovered_restarted: self.recovered.iter().filter(|r| r.2 == "restarted").count()
                as u64,
            peer_lost_lines: self.peer_lost,
            stage_empty: self
                .stage_empty
                .iter()
                .map(|&(t_s, node, stage)| StageEmptyRow { t_s, node, stage })
                .collect(),
            restores: self.restores_resumed(),
            state_downloads: self.downloads.clone(),
            loss_first: loss.first().copied(),
            loss_last: loss.last().copied(),
            reference_loss_first: reference.and_then(|r| r.first().copied()),
            reference_loss_last: reference.and_then(|r| r.last().copied()),
            reference_loss: reference.map(|r| r.to_vec()),
            loss_max_diff_vs_reference: gap.map(|g| g.1),
            wasted_compute_pct,
            compute_ms: compute,
            useful_ms: useful,
            recovery_ms_median,
            recovery_ms_max: rec.last().copied(),
            kills_without_recovery: kills.iter().filter(|k| k.recovery_ms.is_none()).count() as u64,
            kills_carrying: kills.iter().filter(|k| k.carrying.unwrap_or(0) > 0).count() as u64,
            pause_count: pauses.iter().filter(|p| p.kind == "pause").count() as u64,
            cut_count: pauses.iter().filter(|p| p.kind == "cut").count() as u64,
            pauses_carrying: pauses
                .iter()
                .filter(|p| p.carrying.unwrap_or(0) > 0)
                .count() as u64,
            fences: self.fences,
            tokens_per_s,
            tokens,
            training_start_s: founders_active,
            wall_s,
            per_iteration: rows,
            throughput,
            membership: self
                .membership
                .iter()
                .map(|(t_s, members)| MembershipRow {
                    t_s: *t_s,
                    members: members.clone(),
                })
                .collect(),
            kills,
            pauses,
            join_times_s: self.joins.iter().map(|j| j.0).collect(),
            accounting,
            nodes: self.nodes.clone(),
        }
    }
}

/// Loss differences below this are float noise (the swarm sums the same
/// gradients in the same order as the reference).
pub const LOSS_TOLERANCE: f64 = 1e-3;

/// A kill this soon after an iteration's last report may still have cost that
/// iteration's commit line (the coordinator prints it after the holders).
const KILL_GRACE_S: f64 = 1.0;

fn median(sorted: &[f64]) -> Option<f64> {
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[n / 2]),
        n => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// What the demo asked for (the parts the checks need).
#[derive(Clone, Debug)]
pub struct Plan {
    pub model: String,
    pub stages: u32,
    pub iterations: u64,
    pub microbatches: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct IterationRow {
    pub iteration: u64,
    pub t_s: f64,
    pub loss: f64,
    pub microbatches: u64,
    pub tokens: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StageAccount {
    pub stage: u32,
    pub iteration: u64,
    pub committed: u64,
    pub expected: u64,
    pub dropped: u64,
    /// Committed lines for this stage and iteration (more than one: committed
    /// again after losing a member during the commit; the last one counts).
    pub commits: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct KillRow {
    pub t_s: f64,
    pub node: NodeId,
    pub stage: Option<u32>,
    pub aim: String,
    pub recovery_ms: Option<f64>,
    /// The joiner whose state download the kill was timed to hit, and what
    /// became of that download.
    pub joiner: Option<NodeId>,
    pub join_outcome: Option<String>,
    /// Microbatches in flight on the victim when it was killed (None: not
    /// known).
    pub carrying: Option<u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PauseRow {
    pub t_s: f64,
    pub node: NodeId,
    pub stage: Option<u32>,
    pub aim: String,
    /// How long the node was to stay stopped, and when it was resumed (None:
    /// killed, or the run ended, first).
    pub for_s: f64,
    pub resumed_s: Option<f64>,
    /// Microbatches in flight on the node when it was stopped.
    pub carrying: Option<u64>,
    /// From the pause to the first `recovered` line for its stage (before
    /// the next kill or pause of that stage).
    pub recovery_ms: Option<f64>,
    /// "pause" (SIGSTOP, SIGCONT) or "cut" (its link cut and restored).
    pub kind: &'static str,
}

#[derive(Clone, Debug, Serialize)]
pub struct StallRow {
    pub t_s: f64,
    pub node: NodeId,
    pub stage: u32,
    pub iteration: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct MembershipRow {
    pub t_s: f64,
    /// Live members per protocol stage, index 0 = holders.
    pub members: Vec<u32>,
}

/// What an emptied stage was taken up from.
enum Taken {
    /// A holder's copy: (holder, iteration).
    Copy(NodeId, u64),
    /// The average of its neighbours' weights (CheckFree): their members.
    Neighbours(Vec<NodeId>),
    Initial,
}

/// An emptied stage taken up again.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RestoreRow {
    pub t_s: f64,
    /// The joiner that took it up.
    pub node: NodeId,
    pub stage: u32,
    /// The holder whose copy it took (None: the initial weights).
    pub from: Option<NodeId>,
    /// The copy's iteration.
    pub iteration: Option<u64>,
    /// With no copy: the neighbouring stages' members whose weights it
    /// averaged (CheckFree; empty: the initial weights).
    pub rebuilt_from: Vec<NodeId>,
    /// The iteration the weights stand for.
    pub applied: Option<u64>,
    /// Updates the weights taken up miss (after the copy's iteration, up to
    /// `applied`): lost with the stage's nodes.
    pub updates_lost: u64,
    /// When the joiner that took it up was started.
    pub joiner_started_s: f64,
    /// When the first iteration on the weights taken up (`applied` + 1)
    /// was final at a holder: training resumed (None: never in the run).
    pub resumed_s: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct StageEmptyRow {
    pub t_s: f64,
    pub node: NodeId,
    pub stage: u32,
}

#[derive(Clone, Debug, Serialize)]
pub struct DownloadRow {
    pub t_s: f64,
    pub node: NodeId,
    pub from: NodeId,
    pub bytes: u64,
    /// From the joiner's request to the whole state, its hash checked.
    pub ms: f64,
    pub bytes_per_s: f64,
    /// From the request to its weights, when they were imported first (a
    /// restorer computes from then on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights_ms: Option<f64>,
}

/// "N (request to verified state: median M ms, max X ms; median R MB/s)".
pub fn downloads_line(rows: &[DownloadRow]) -> String {
    if rows.is_empty() {
        return "0".into();
    }
    let mut ms: Vec<f64> = rows.iter().map(|r| r.ms).collect();
    let mut rate: Vec<f64> = rows.iter().map(|r| r.bytes_per_s).collect();
    let mut weights: Vec<f64> = rows.iter().filter_map(|r| r.weights_ms).collect();
    ms.sort_by(f64::total_cmp);
    rate.sort_by(f64::total_cmp);
    weights.sort_by(f64::total_cmp);
    let first = match weights.len() {
        0 => String::new(),
        n => format!(
            "; weights first in {n}: request to weights median {:.0} ms",
            weights[n / 2]
        ),
    };
    format!(
        "{} (request to verified state: median {:.0} ms, max {:.0} ms; median {:.1} MB/s{first})",
        rows.len(),
        ms[ms.len() / 2],
        ms[ms.len() - 1],
        rate[rate.len() / 2] / 1e6
    )
}

/// The emptied stages taken up again, and the loss on the first iteration
/// that ran on their weights against the reference's.
pub fn restores_line(s: &Summary) -> String {
    let loss_at = |k: u64| {
        let swarm = s
            .per_iteration
            .iter()
            .find(|r| r.iteration == k)
            .map(|r| r.loss);
        let reference = s
            .reference_loss
            .as_ref()
            .and_then(|r| r.get(k as usize).copied());
        match (swarm, reference) {
            (Some(a), Some(b)) => format!("; loss of iteration {k}: {a:.4}, reference {b:.4}"),
            (Some(a), None) => format!("; loss of iteration {k}: {a:.4}"),
            _ => String::new(),
        }
    };
    let lines: Vec<String> = (s.restores.iter())
        .map(|r| {
            let first = r.applied.map_or(0, |a| a + 1);
            let how = match (r.from, r.iteration) {
                (Some(h), Some(k)) => format!("from holder {h}'s copy of iteration {k}"),
                _ if !r.rebuilt_from.is_empty() => format!(
                    "from the average of its neighbours' weights (nodes {}; no copy kept)",
                    ids_list(&r.rebuilt_from)
                ),
                _ => "from the initial weights (no copy kept)".into(),
            };
            let resumed = match r.resumed_s {
                Some(t) => format!(
                    "; training resumed {:.1} s after the joiner started",
                    t - r.joiner_started_s
                ),
                None => "; training did not resume on it".into(),
            };
            format!(
                "stage {} at {:.1} s by node {}, {how}, standing for iteration {} ({} updates \
                 lost){}{resumed}",
                r.stage,
                r.t_s,
                r.node,
                r.applied.map_or("-".into(), |a| a.to_string()),
                r.updates_lost,
                loss_at(first)
            )
        })
        .collect();
    lines.join(" | ")
}

fn ids_list(ids: &[NodeId]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What `--json` writes (times in seconds since the demo started).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// No failure below.
    pub ok: bool,
    /// Why the run failed, one line each (lost or double-counted microbatches,
    /// replicas that disagree, a missing commit, the run unfinished).
    pub failures: Vec<String>,
    /// Not failures, but worth a look: the loss departing from the
    /// reference, stalls.
    pub warnings: Vec<String>,
    /// Commits that could not be checked because their stage lost a member
    /// during the iteration (the coordinator may die before printing).
    pub unverified: Vec<String>,
    pub finished: bool,
    pub model: String,
    pub model_stages: u32,
    pub holders: u64,
    pub relays_founding: u64,
    pub microbatches_per_holder: u64,
    pub iterations_planned: u64,
    pub iterations: u64,
    pub lost_microbatches: u64,
    pub double_counted_microbatches: u64,
    pub dropped_microbatches: u64,
    /// Commits made again (a member lost during the commit).
    pub recommits: u64,
    pub replicas_agree: bool,
    /// (stage, iteration) pairs that two or more nodes applied, so compared.
    pub replica_checks: u64,
    pub crashes: u64,
    /// `stalled` lines: an iteration that could not go on in a stage.
    pub stalls: Vec<StallRow>,
    pub joins: u64,
    /// Joiners that became members of a stage.
    pub joins_active: u64,
    pub recovered_hops: u64,
    pub recovered_rerouted: u64,
    pub recovered_restarted: u64,
    pub peer_lost_lines: u64,
    pub stage_empty: Vec<StageEmptyRow>,
    /// Emptied stages taken up again, from a holder's copy or afresh.
    pub restores: Vec<RestoreRow>,
    pub state_downloads: Vec<DownloadRow>,
    pub loss_first: Option<f64>,
    pub loss_last: Option<f64>,
    pub reference_loss_first: Option<f64>,
    pub reference_loss_last: Option<f64>,
    pub reference_loss: Option<Vec<f64>>,
    /// The largest |swarm loss - reference loss| over the iterations.
    pub loss_max_diff_vs_reference: Option<f64>,
    /// (compute - useful) / compute over every node's last stats, in percent.
    pub wasted_compute_pct: Option<f64>,
    pub compute_ms: f64,
    pub useful_ms: f64,
    /// Median over kills of: kill -> first `recovered` line for the killed
    /// node's stage (before another node of that stage is killed).
    pub recovery_ms_median: Option<f64>,
    pub recovery_ms_max: Option<f64>,
    /// Kills after which no hop of that stage was recovered (the node held no
    /// work in flight, or the run ended first).
    pub kills_without_recovery: u64,
    /// Kills whose victim carried microbatches in flight (by the paths the
    /// holders reported; see `Facts::in_flight`).
    pub kills_carrying: u64,
    /// Pauses (SIGSTOP, then SIGCONT), links cut (then restored), and
    /// those of either whose node carried microbatches in flight.
    pub pause_count: u64,
    pub cut_count: u64,
    pub pauses_carrying: u64,
    /// Times a node fenced itself (paused, cut off, evicted) and joined
    /// again.
    pub fences: u64,
    /// Tokens of the completed iterations over the time from the last founding
    /// member's `active` to the last iteration.
    pub tokens_per_s: f64,
    pub tokens: u64,
    pub training_start_s: f64,
    pub wall_s: f64,
    pub per_iteration: Vec<IterationRow>,
    /// (time, tokens/s of the iteration that ended then).
    pub throughput: Vec<(f64, f64)>,
    pub membership: Vec<MembershipRow>,
    pub kills: Vec<KillRow>,
    pub pauses: Vec<PauseRow>,
    pub join_times_s: Vec<f64>,
    pub accounting: Vec<StageAccount>,
    pub nodes: BTreeMap<NodeId, NodeFacts>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t: f64, what: What) -> Entry {
        Entry { t, what }
    }
    fn launched(t: f64, node: NodeId, holder: bool, stage: Option<u32>) -> Entry {
        at(
            t,
            What::Launched {
                node,
                holder,
                joiner: false,
                stage,
            },
        )
    }
    fn line(t: f64, node: NodeId, text: &str) -> Entry {
        at(
            t,
            What::Line {
                node,
                event: parse_line(text),
            },
        )
    }

    /// Two holders (0, 1), two relays per relay stage (2..=5) of a 4-stage
    /// cut, 2 microbatches per holder, `iters` iterations, commits and
    /// applies as a healthy run prints them.
    fn healthy(iters: u64) -> (Facts, Plan) {
        let mut f = Facts::new(4);
        for id in 0..2 {
            f.push(&launched(0.0, id, true, Some(0)));
        }
        for id in 2..6 {
            f.push(&launched(0.0, id, false, Some(1 + (id as u32 % 2))));
        }
        for id in 0..6 {
            let stage = if id < 2 { 0 } else { 1 + (id % 2) };
            f.push(&line(
                0.5,
                id,
                &format!(r#"{{"event":"active","node":{id},"stage":{stage}}}"#),
            ));
        }
        for i in 0..iters {
            let t = 1.0 + i as f64;
            for stage in 1..3u32 {
                f.push(&line(
                    t,
                    1 + stage as u64,
                    &format!(
                        r#"{{"event":"committed","node":{},"stage":{stage},"iteration":{i},"microbatches":4,"dropped":0}}"#,
                        1 + stage
                    ),
                ));
            }
            for id in 0..6u64 {
                let stage = if id < 2 { 0 } else { 1 + (id % 2) };
                f.push(&line(t, id, &format!(
                    r#"{{"event":"applied","node":{id},"stage":{stage},"iteration":{i},"weights_sha256":"s{stage}i{i}"}}"#
                )));
            }
            for h in 0..2u64 {
                let loss = 5.0 - i as f64 * 0.1 + h as f64 * 0.2;
                f.push(&line(t, h, &format!(
                    r#"{{"event":"iteration","node":{h},"iteration":{i},"loss":{loss},"microbatches":2,"tokens":256}}"#
                )));
            }
        }
        for h in 0..2u64 {
            f.push(&line(
                iters as f64 + 1.0,
                h,
                &format!(r#"{{"event":"done","node":{h}}}"#),
            ));
        }
        let plan = Plan {
            model: "llama-tiny".into(),
            stages: 4,
            iterations: iters,
            microbatches: 2,
        };
        (f, plan)
    }

    /// A joiner is a member once active, but holds its stage's current
    /// state only once it applied an iteration (its download may have
    /// missed an update): the chaos keeps a stage's last member in sync.
    #[test]
    fn a_joiner_is_in_sync_once_it_applied_an_iteration() {
        let (mut f, _) = healthy(1);
        f.push(&at(
            2.0,
            What::Launched {
                node: 9,
                holder: false,
                joiner: true,
                stage: None,
            },
        ));
        f.push(&line(2.5, 9, r#"{"event":"active","node":9,"stage":1}"#));
        assert!(f.nodes[&9].member() && !f.nodes[&9].in_sync());
        assert!(f.nodes[&2].in_sync(), "a founding member");
        assert_eq!(f.members_per_stage()[1], 3);
        assert_eq!(f.in_sync_per_stage()[1], 2);
        f.push(&line(
            3.0,
            9,
            r#"{"event":"applied","node":9,"stage":1,"iteration":1,"weights_sha256":"s1i1"}"#,
        ));
        assert!(f.nodes[&9].in_sync());
        assert_eq!(f.in_sync_per_stage()[1], 3);
    }

    #[test]
    fn parses_every_event_kind_and_refuses_garbage() {
        let ok = [
            (
                r#"{"event":"listening","node":3,"addr":"127.0.0.1:4000"}"#,
                "listening",
            ),
            (r#"{"event":"active","node":3,"stage":1}"#, "active"),
            (
                r#"{"event":"applied","node":3,"stage":1,"iteration":0,"weights_sha256":"ab"}"#,
                "applied",
            ),
            (
                r#"{"event":"iteration","node":0,"iteration":2,"loss":5.5,"microbatches":4,"tokens":512}"#,
                "iteration",
            ),
            (r#"{"event":"peer_lost","node":0,"peer":4}"#, "peer_lost"),
            (
                r#"{"event":"recovered","node":0,"kind":"rerouted","stage":2,"iteration":1}"#,
                "recovered",
            ),
            (
                r#"{"event":"stage_empty","node":0,"stage":2}"#,
                "stage_empty",
            ),
            (
                r#"{"event":"stage_restored","node":8,"stage":2,"from":1,"iteration":9,"applied":10,"source":"kept"}"#,
                "stage_restored",
            ),
            (
                r#"{"event":"stage_restarted","node":8,"stage":2,"applied":null,"source":"initial"}"#,
                "stage_restarted",
            ),
            (
                r#"{"event":"state_download","node":9,"from":3,"bytes":1000,"ms":12}"#,
                "state_download",
            ),
            (
                r#"{"event":"stats","node":3,"compute_ms":10.5,"useful_ms":9}"#,
                "stats",
            ),
            (
                r#"{"event":"committed","node":3,"stage":1,"iteration":0,"microbatches":8,"dropped":0}"#,
                "committed",
            ),
            (
                r#"{"event":"mb_done","node":1,"holder":1,"index":2,"iteration":0,"path":[1,7,8]}"#,
                "mb_done",
            ),
            (r#"{"event":"done","node":0}"#, "done"),
            (r#"{"event":"left","node":5}"#, "left"),
            (r#"{"event":"error","node":5,"message":"boom"}"#, "error"),
            (r#"{"event":"something_new","node":5,"x":[1]}"#, "unknown"),
            // Extra fields are fine, surrounding blanks too.
            ("  {\"event\":\"done\",\"node\":0,\"extra\":true}\r", "done"),
        ];
        for (text, kind) in ok {
            let ev = parse_line(text).unwrap_or_else(|| panic!("refused {text}"));
            assert_eq!(ev.kind(), kind, "{text}");
        }
        assert_eq!(
            parse_line(r#"{"event":"stats","node":3,"compute_ms":10.5,"useful_ms":9}"#),
            Some(Event::Stats {
                node: 3,
                compute_ms: 10.5,
                useful_ms: 9.0
            })
        );
        let garbage = [
            "",
            "hello",
            "thread 'main' panicked at src/x.rs:1:1",
            "{",
            "{\"event\":\"active\",\"node\":3}",
            "{\"event\":\"active\",\"node\":\"three\",\"stage\":1}",
            "{\"event\":42,\"node\":3}",
            "{\"node\":3}",
            "[1,2,3]",
            "{\"event\":\"applied\",\"node\":-1,\"stage\":0,\"iteration\":0,\"weights_sha256\":\"x\"}",
            "\u{0}\u{1}binary\u{fffd}",
        ];
        for text in garbage {
            assert_eq!(parse_line(text), None, "{text:?}");
        }
    }

    #[test]
    fn garbage_lines_are_counted_per_node() {
        let (mut f, _) = healthy(1);
        f.push(&line(3.0, 2, "not json"));
        f.push(&line(3.0, 2, r#"{"event":"active"}"#));
        assert_eq!(f.nodes[&2].garbage_lines, 2);
        assert_eq!(f.nodes[&3].garbage_lines, 0);
    }

    #[test]
    fn a_healthy_run_passes() {
        let (f, plan) = healthy(3);
        let s = f.summary(&plan, Some(&[5.0, 4.9, 4.8]), 5.0);
        assert!(s.ok, "{:?}", s.failures);
        assert!(s.finished && s.replicas_agree);
        assert_eq!(s.iterations, 3);
        assert_eq!((s.lost_microbatches, s.double_counted_microbatches), (0, 0));
        // Loss: mean over both holders' microbatches.
        assert!((s.loss_first.unwrap() - 5.1).abs() < 1e-9);
        assert!((s.loss_last.unwrap() - 4.9).abs() < 1e-9);
        assert_eq!(s.reference_loss_last, Some(4.8));
        // 3 x 512 tokens from t=0.5 (all active) to t=3.
        assert_eq!(s.tokens, 1536);
        assert!((s.tokens_per_s - 1536.0 / 2.5).abs() < 1e-9);
        assert_eq!(s.throughput.len(), 3);
        // 2 relay stages x 3 iterations, holders' stage has no commits.
        assert_eq!(s.accounting.len(), 6);
        // Holders and relay stages: every (stage, iteration) was compared.
        assert_eq!(s.replica_checks, 9);
        assert_eq!(s.membership.last().unwrap().members, vec![2, 2, 2]);
    }

    #[test]
    fn replicas_that_disagree_fail_the_run() {
        // The last update of a node killed after it is not compared.
        let (mut f, plan) = healthy(2);
        f.push(&line(
            2.0,
            4,
            r#"{"event":"applied","node":4,"stage":1,"iteration":1,"weights_sha256":"other"}"#,
        ));
        f.push(&at(
            2.5,
            What::Killed {
                node: 4,
                aim: "forward".into(),
                joiner: None,
                carrying: None,
            },
        ));
        assert!(f.summary(&plan, None, 4.0).replicas_agree);
        // An earlier one is.
        let (mut f, plan) = healthy(2);
        f.push(&line(
            2.0,
            4,
            r#"{"event":"applied","node":4,"stage":1,"iteration":1,"weights_sha256":"other"}"#,
        ));
        f.push(&line(
            2.1,
            4,
            r#"{"event":"applied","node":4,"stage":1,"iteration":2,"weights_sha256":"s1i2"}"#,
        ));
        f.push(&at(
            2.5,
            What::Killed {
                node: 4,
                aim: "forward".into(),
                joiner: None,
                carrying: None,
            },
        ));
        let s = f.summary(&plan, None, 4.0);
        assert!(!s.replicas_agree && !s.ok);
        assert!(
            s.failures.contains(
                &"stage 1 iteration 1: 2 nodes printed 2 different weights_sha256 (node 2 s1i1; \
                  node 4 other, killed at 2.50 s)"
                    .to_string()
            ),
            "{:?}",
            s.failures
        );
        // One node alone cannot disagree with itself.
        let (mut f, plan) = healthy(1);
        f.push(&line(
            2.0,
            9,
            r#"{"event":"applied","node":9,"stage":1,"iteration":7,"weights_sha256":"lonely"}"#,
        ));
        assert!(f.summary(&plan, None, 4.0).replicas_agree);
    }

    #[test]
    fn lost_and_double_counted_microbatches_fail_the_run() {
        let (mut f, plan) = healthy(2);
        // Stage 1's coordinator re-announces iteration 0 with one fewer.
        f.commits.get_mut(&(1, 0)).unwrap()[0].microbatches = 3;
        // Stage 2 counted iteration 1 with one more.
        f.commits.get_mut(&(2, 1)).unwrap()[0].microbatches = 5;
        let s = f.summary(&plan, None, 4.0);
        assert_eq!(s.lost_microbatches, 1);
        assert_eq!(s.double_counted_microbatches, 1);
        assert!(!s.ok);
        assert!(s.failures.iter().any(|x| x.contains("lost")));
        assert!(s.failures.iter().any(|x| x.contains("counted twice")));

        // Dropped microbatches are lost; a commit made again replaces the first.
        let (mut f, plan) = healthy(1);
        f.push(&line(
            1.1,
            2,
            r#"{"event":"committed","node":2,"stage":1,"iteration":0,"microbatches":3,"dropped":1}"#,
        ));
        let s = f.summary(&plan, None, 4.0);
        assert_eq!(s.lost_microbatches, 1, "{:?}", s.failures);
        assert_eq!((s.dropped_microbatches, s.recommits), (1, 1));
        let (mut f, plan) = healthy(1);
        f.push(&line(
            1.1,
            4,
            r#"{"event":"committed","node":4,"stage":1,"iteration":0,"microbatches":4,"dropped":0}"#,
        ));
        let s = f.summary(&plan, None, 4.0);
        assert!(s.ok, "{:?}", s.failures);
        assert_eq!(s.recommits, 1);

        // Holders that trained fewer than planned lost some.
        let (f, mut plan) = healthy(1);
        plan.microbatches = 3;
        let s = f.summary(&plan, None, 4.0);
        assert_eq!(s.lost_microbatches, 2);
    }

    #[test]
    fn a_missing_commit_fails_unless_its_stage_lost_a_member() {
        let (mut f, plan) = healthy(2);
        f.commits.remove(&(2, 1));
        let s = f.summary(&plan, None, 4.0);
        assert!(s
            .failures
            .iter()
            .any(|x| x == "stage 2 iteration 1: no committed line"));
        let (mut f, plan) = healthy(2);
        f.commits.remove(&(2, 1));
        f.push(&at(
            1.5,
            What::Killed {
                node: 5,
                aim: "aggregation".into(),
                joiner: None,
                carrying: None,
            },
        ));
        let s = f.summary(&plan, None, 4.0);
        assert!(s.ok, "{:?}", s.failures);
        assert_eq!(s.unverified.len(), 1);
    }

    #[test]
    fn an_unfinished_run_fails() {
        let (mut f, plan) = healthy(2);
        f.nodes.get_mut(&1).unwrap().done = false;
        let s = f.summary(&plan, None, 4.0);
        assert!(!s.finished && !s.ok);
        assert!(s.failures[0].contains("did not finish"), "{:?}", s.failures);
        let (f, mut plan) = healthy(2);
        plan.iterations = 3;
        let s = f.summary(&plan, None, 4.0);
        assert!(
            s.failures[0].contains("done after 2 of 3"),
            "{:?}",
            s.failures
        );
    }

    #[test]
    fn wasted_compute_counts_the_last_stats_of_killed_nodes() {
        let (mut f, plan) = healthy(1);
        f.push(&line(
            1.0,
            2,
            r#"{"event":"stats","node":2,"compute_ms":100,"useful_ms":100}"#,
        ));
        f.push(&line(
            1.5,
            3,
            r#"{"event":"stats","node":3,"compute_ms":50,"useful_ms":50}"#,
        ));
        f.push(&line(
            2.0,
            3,
            r#"{"event":"stats","node":3,"compute_ms":100,"useful_ms":60}"#,
        ));
        f.push(&at(
            2.1,
            What::Killed {
                node: 3,
                aim: "random".into(),
                joiner: None,
                carrying: None,
            },
        ));
        f.push(&at(
            2.2,
            What::Exited {
                node: 3,
                code: None,
            },
        ));
        let s = f.summary(&plan, None, 4.0);
        assert_eq!((s.compute_ms, s.useful_ms), (200.0, 160.0));
        assert!((s.wasted_compute_pct.unwrap() - 20.0).abs() < 1e-9);
        assert_eq!(
            healthy(1).0.summary(&plan, None, 1.0).wasted_compute_pct,
            None
        );
    }

    #[test]
    fn recovery_time_is_from_the_kill_to_the_next_recovery_in_its_stage() {
        let (mut f, plan) = healthy(1);
        let kill = |t, node| {
            at(
                t,
                What::Killed {
                    node,
                    aim: "forward".into(),
                    joiner: None,
                    carrying: None,
                },
            )
        };
        let rec = |t, stage| {
            line(
                t,
                0,
                &format!(
                    r#"{{"event":"recovered","node":0,"kind":"rerouted","stage":{stage},"iteration":1}}"#
                ),
            )
        };
        f.push(&kill(10.0, 3)); // stage 2
        f.push(&rec(10.1, 1)); // another stage: not this kill's
        f.push(&rec(10.4, 2)); // 400 ms
        f.push(&kill(20.0, 2)); // stage 1
        f.push(&rec(20.2, 1)); // 200 ms
        f.push(&rec(20.3, 1));
        f.push(&kill(30.0, 4)); // stage 1, 3 members left... never recovered
        f.push(&kill(31.0, 5)); // stage 2
        f.push(&rec(31.6, 2)); // 600 ms
        let s = f.summary(&plan, None, 40.0);
        let got: Vec<Option<f64>> = s
            .kills
            .iter()
            .map(|k| k.recovery_ms.map(|x| x.round()))
            .collect();
        assert_eq!(got, vec![Some(400.0), Some(200.0), None, Some(600.0)]);
        assert_eq!(s.recovery_ms_median.map(f64::round), Some(400.0));
        assert_eq!(s.kills_without_recovery, 1);
        assert_eq!(s.crashes, 4);
        assert_eq!(f.members_per_stage(), vec![2, 0, 0]);
    }

    #[test]
    fn pauses_and_cuts_are_reported_like_kills_and_their_member_is_not_available() {
        let (mut f, plan) = healthy(1);
        // Stage 1: nodes 2 and 4.
        assert_eq!(f.available_per_stage()[1], 2);
        f.push(&at(
            10.0,
            What::Paused {
                node: 2,
                aim: "microbatches in flight".into(),
                for_s: 3.0,
                carrying: Some(2),
                cut: false,
            },
        ));
        assert!(f.nodes[&2].member() && !f.nodes[&2].available());
        assert!(!f.nodes[&2].cut);
        assert_eq!(f.available_per_stage()[1], 1);
        assert_eq!(f.in_sync_per_stage()[1], 1);
        assert_eq!(f.members_per_stage()[1], 2, "still a member");
        f.push(&line(
            10.3,
            0,
            r#"{"event":"recovered","node":0,"kind":"rerouted","stage":1,"iteration":1}"#,
        ));
        f.push(&at(13.0, What::Resumed { node: 2 }));
        assert!(f.nodes[&2].available());
        f.push(&at(
            14.0,
            What::Paused {
                node: 3,
                aim: "random".into(),
                for_s: 3.0,
                carrying: Some(0),
                cut: true,
            },
        ));
        // A cut link: not available either, and restored with SIGUSR2.
        assert!(f.nodes[&3].cut && !f.nodes[&3].available());
        assert_eq!(f.cut_count(), 1);
        assert_eq!(f.pause_count(), 1);
        let s = f.summary(&plan, None, 20.0);
        assert_eq!((s.pause_count, s.cut_count, s.pauses_carrying), (1, 1, 1));
        assert_eq!((s.pauses[0].kind, s.pauses[1].kind), ("pause", "cut"));
        let p = &s.pauses[0];
        assert_eq!((p.node, p.stage, p.carrying), (2, Some(1), Some(2)));
        assert_eq!(p.resumed_s, Some(13.0));
        assert_eq!(p.recovery_ms.map(f64::round), Some(300.0));
        // Not resumed (the run ended first), no recovery in its stage.
        assert_eq!(
            (s.pauses[1].resumed_s, s.pauses[1].recovery_ms),
            (None, None)
        );
        assert_eq!(s.crashes, 0, "a pause is no crash");
    }

    #[test]
    fn membership_follows_activity_kills_and_leaves() {
        let mut f = Facts::new(4);
        f.push(&launched(0.0, 0, true, Some(0)));
        f.push(&launched(0.0, 1, false, Some(1)));
        f.push(&line(0.1, 0, r#"{"event":"active","node":0,"stage":0}"#));
        f.push(&line(0.2, 1, r#"{"event":"active","node":1,"stage":1}"#));
        f.push(&at(
            1.0,
            What::Launched {
                node: 7,
                holder: false,
                joiner: true,
                stage: None,
            },
        ));
        assert_eq!(f.members_per_stage(), vec![1, 1, 0]);
        f.push(&line(1.5, 7, r#"{"event":"active","node":7,"stage":2}"#));
        assert_eq!(f.members_per_stage(), vec![1, 1, 1]);
        f.push(&at(
            2.0,
            What::Killed {
                node: 1,
                aim: "x".into(),
                joiner: None,
                carrying: None,
            },
        ));
        f.push(&at(
            2.1,
            What::Exited {
                node: 1,
                code: None,
            },
        ));
        f.push(&line(3.0, 7, r#"{"event":"left","node":7}"#));
        let m: Vec<(f64, Vec<u32>)> = f.membership.iter().map(|m| (m.0, m.1.clone())).collect();
        assert_eq!(
            m,
            vec![
                (0.1, vec![1, 0, 0]),
                (0.2, vec![1, 1, 0]),
                (1.5, vec![1, 1, 1]),
                (2.0, vec![1, 0, 1]),
                (3.0, vec![1, 0, 0]),
            ]
        );
        assert_eq!(f.joins(), 1);
    }

    /// The downloads' line: how many, the median and longest time from a
    /// request to the verified state, the median rate.
    #[test]
    fn downloads_are_summed_up_by_their_times_and_rates() {
        let row = |ms: f64, mbps: f64| DownloadRow {
            t_s: 1.0,
            node: 9,
            from: 3,
            bytes: 1000,
            ms,
            bytes_per_s: mbps * 1e6,
            weights_ms: None,
        };
        assert_eq!(downloads_line(&[]), "0");
        assert_eq!(
            downloads_line(&[row(12.0, 1.0), row(40.0, 3.0), row(20.0, 2.0)]),
            "3 (request to verified state: median 20 ms, max 40 ms; median 2.0 MB/s)"
        );
        let first = DownloadRow {
            weights_ms: Some(4.0),
            ..row(30.0, 1.0)
        };
        assert_eq!(
            downloads_line(&[row(12.0, 1.0), first]),
            "2 (request to verified state: median 30 ms, max 30 ms; median 1.0 MB/s; \
             weights first in 1: request to weights median 4 ms)"
        );
        let e = parse_line(
            r#"{"event":"state_download","node":9,"from":3,"bytes":1000,"ms":12,"bytes_per_s":83333.3,"import_ms":0.5}"#,
        );
        assert!(
            matches!(e, Some(Event::StateDownload { ms, bytes_per_s, .. }) if ms == 12.0 && bytes_per_s == 83333.3),
            "{e:?}"
        );
    }
}
