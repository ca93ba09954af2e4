//! Helpers for the tests that run swarm nodes in the test's own process
//! (`swarm::runtime::Runtime` on loopback).
use gwtf::engine::NodeOptions;
use gwtf::protocol::{Config, Event, MbId, NodeId, Stage};
use gwtf::swarm::model_trainer::ModelRun;
use gwtf::swarm::runtime::{
    realtime_config, NodeEvent, Peer, Refusal, Runtime, RuntimeOptions, Trainer,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub use super::free_addr;

/// The peers of `layout` (id, stage), each at a free loopback address.
pub fn peers_of(layout: &[(NodeId, Stage)]) -> Vec<Peer> {
    layout
        .iter()
        .map(|&(id, stage)| Peer {
            id,
            stage,
            addr: free_addr(),
        })
        .collect()
}

/// The protocol's settings for a swarm that trains `run` on real time (as
/// `gwtf node` sets them), `mb_per_iter` microbatches per holder and
/// iteration.
pub fn model_protocol_config(run: &ModelRun, mb_per_iter: u32) -> Arc<Config> {
    let mut c = realtime_config((run.stages - 2) as u16, run.activation_bytes() as u64);
    c.mb_per_iter = mb_per_iter;
    c.max_in_flight = 2;
    c.stage_state_bytes = (0..=c.relay_stages)
        .map(|s| run.state_bytes(s).unwrap())
        .collect();
    Arc::new(c)
}

/// What the nodes of a swarm reported.
#[derive(Default)]
pub struct Seen {
    /// Holders: the loss of each final iteration, one per holder.
    pub losses: BTreeMap<u32, Vec<f32>>,
    /// (stage, iteration) -> microbatches committed (by every commit).
    pub committed: BTreeMap<(Stage, u32), Vec<MbId>>,
    /// (stage, iteration) -> the microbatches of its last commit (a stage
    /// commits again after losing a member; the last commit counts).
    pub last_commit: BTreeMap<(Stage, u32), Vec<(MbId, NodeId)>>,
    /// (stage, iteration) -> digests of the members that applied it.
    pub digests: BTreeMap<(Stage, u32), BTreeSet<[u8; 32]>>,
    /// (node, iteration) -> digest.
    pub digests_by: BTreeMap<(NodeId, u32), [u8; 32]>,
    pub errors: Vec<String>,
    /// (node, reason, what was refused)
    pub refused: Vec<(NodeId, Refusal, String)>,
    /// (node, peer) lost
    pub lost: Vec<(NodeId, NodeId)>,
    /// Paths of the microbatches done.
    pub paths: Vec<Vec<NodeId>>,
    /// Stage each node became active in.
    pub active: BTreeMap<NodeId, Stage>,
    /// (joiner, the member it downloaded the state from)
    pub downloads: Vec<(NodeId, NodeId)>,
    /// (holder, stage, iteration) of each copy of a stage's state kept.
    pub copies: Vec<(NodeId, Stage, u32)>,
    /// (stage, iteration, member) of the all-reduces that failed and were
    /// committed again.
    pub aggregate_failed: Vec<(Stage, u32, NodeId)>,
}

impl Seen {
    pub fn take(&mut self, id: NodeId, ev: NodeEvent) {
        if std::env::var_os("GWTF_TEST_TRACE").is_some() {
            eprintln!("{id:x}: {ev:?}");
        }
        match ev {
            NodeEvent::Iteration {
                iteration, loss, ..
            } => self.losses.entry(iteration).or_default().push(loss),
            NodeEvent::Applied {
                stage,
                iteration,
                weights,
                ..
            } => {
                self.digests
                    .entry((stage, iteration))
                    .or_default()
                    .insert(weights);
                self.digests_by.insert((id, iteration), weights);
            }
            NodeEvent::Protocol(Event::StageCommitted {
                stage, iter, mbs, ..
            }) => {
                self.committed
                    .entry((stage, iter))
                    .or_default()
                    .extend(mbs.iter().map(|m| m.0));
                self.last_commit.insert((stage, iter), mbs.to_vec());
            }
            NodeEvent::Protocol(Event::MbDone { path, .. }) => self.paths.push(path.to_vec()),
            NodeEvent::Protocol(Event::Active { stage }) => {
                self.active.insert(id, stage);
            }
            NodeEvent::Protocol(Event::AggregateFailed {
                stage,
                iter,
                member,
            }) => self.aggregate_failed.push((stage, iter, member)),
            NodeEvent::StateDownloaded { from, .. } => self.downloads.push((id, from)),
            NodeEvent::CopyKept {
                stage, iteration, ..
            } => self.copies.push((id, stage, iteration)),
            NodeEvent::PeerLost { peer } => self.lost.push((id, peer)),
            NodeEvent::Refused { reason, detail, .. } => {
                eprintln!("node {id:x} refused ({}): {detail}", reason.name());
                self.refused.push((id, reason, detail))
            }
            NodeEvent::Error(e) => self.errors.push(format!("{id:x}: {e}")),
            _ => {}
        }
    }

    /// Whether node `id` applied an update.
    pub fn applied(&self, id: NodeId) -> bool {
        self.digests_by.keys().any(|(n, _)| *n == id)
    }

    /// What `node` refused for `reason`.
    pub fn refusals(&self, node: NodeId, reason: Refusal) -> Vec<&str> {
        self.refused
            .iter()
            .filter(|(n, r, _)| *n == node && *r == reason)
            .map(|(_, _, d)| d.as_str())
            .collect()
    }
}

/// Starts node `p` (`join`: joining through `bootstrap`) with `key`, the
/// engine's options `net`, and `trainer`.
pub fn start_node(
    p: &Peer,
    bootstrap: &[Peer],
    cfg: &Arc<Config>,
    join: bool,
    key: &[u8],
    net: NodeOptions,
    trainer: impl Trainer,
) -> Runtime {
    Runtime::start(node_options(p, bootstrap, cfg, join, key, net), trainer).unwrap()
}

/// The options [`start_node`] starts a node with (room for 4 microbatches).
pub fn node_options(
    p: &Peer,
    bootstrap: &[Peer],
    cfg: &Arc<Config>,
    join: bool,
    key: &[u8],
    net: NodeOptions,
) -> RuntimeOptions {
    RuntimeOptions {
        // These test swarms choose their members' ids (1, 11, 12, ...):
        // the insecure mode in which ids need not follow from node keys.
        net: NodeOptions {
            chosen_ids: true,
            ..net
        },
        id: p.id,
        stage: p.stage,
        listen: p.addr,
        swarm_key: key.to_vec(),
        bootstrap: bootstrap.to_vec(),
        join,
        protocol: cfg.clone(),
        compute_s: 0.01,
        capacity: 4,
        seed: 1,
        weights_first: None,
    }
}
