//! Helpers for the parts' unit tests: one node, fed its inputs directly
//! (no swarm, no simulator).
use super::*;

/// The test configuration: 4 relay stages, 1 MiB activations.
pub(super) fn config(policy: Policy) -> Arc<Config> {
    Arc::new(Config::new(policy, 4, 1 << 20))
}

/// An active node `id` serving `stage`, started at one second with the
/// other members of its group and the peers it knows (id, stage).
pub(super) fn started(
    policy: Policy,
    id: NodeId,
    stage: Stage,
    members: &[NodeId],
    peers: &[(NodeId, Stage)],
) -> Node {
    started_with(config(policy), id, stage, members, peers)
}

/// [`started`] with configuration `cfg`.
pub(super) fn started_with(
    cfg: Arc<Config>,
    id: NodeId,
    stage: Stage,
    members: &[NodeId],
    peers: &[(NodeId, Stage)],
) -> Node {
    let mut n = Node::new(cfg, id, stage, 0.5, 4, 1);
    let mut all: Vec<(NodeId, Stage)> = members.iter().map(|&m| (m, stage)).collect();
    all.extend_from_slice(peers);
    n.handle(SEC, Input::Start { peers: all });
    n
}

/// The message `msg` from `from`, handled now.
pub(super) fn deliver(n: &mut Node, from: NodeId, msg: Msg) -> Vec<Action> {
    let now = n.now;
    n.handle(now, Input::Message { from, msg })
}

/// Coordinator `n` hears heartbeats from member `m` only, tick after tick
/// from `t`, for longer than the suspicion time (the other members fall
/// silent); returns the time reached.
pub(super) fn hear_only_from(n: &mut Node, m: NodeId, mut t: Time) -> Time {
    let cfg = n.cfg.clone();
    let coord = n.id;
    for _ in 0..(cfg.suspect_ticks + 2 * cfg.heartbeat_ticks) {
        t += cfg.tick;
        let hb = Msg::Heartbeat {
            members: None,
            coord,
            updates: 0,
            version: n.iters.version().1,
        };
        deliver(n, m, hb);
        n.on_timeout(t);
    }
    t
}

/// The messages among `actions`, with their destination.
pub(super) fn sends(actions: &[Action]) -> Vec<(NodeId, &Msg)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg } => Some((*to, msg)),
            _ => None,
        })
        .collect()
}

/// The trainer tasks among `actions`.
pub(super) fn runs(actions: &[Action]) -> Vec<&Task> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Run(t) => Some(t),
            _ => None,
        })
        .collect()
}

pub(super) fn mb(holder: NodeId, iter: u32, idx: u32) -> MbId {
    MbId { holder, iter, idx }
}

/// The snapshot of a microbatch whose forward this node has done and sent
/// to `next` (attempt 0; `path` ends with this node, the input came from the one before).
pub(super) fn forwarded(path: &[NodeId], next: NodeId, now: Time) -> Snap {
    Snap::forwarded(path, next, now)
}

/// A hop of `mb` sent to `to` now and not acknowledged yet.
pub(super) fn awaiting_ack(n: &mut Node, mb: MbId, backward: bool, to: NodeId) {
    let now = n.now;
    n.add_deadline(
        (mb, backward),
        Outstanding::new(to, now, now + 10 * SEC, 1 << 20, 0),
    );
}
