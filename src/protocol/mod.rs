//! The GWTF protocol as a sans-I/O state machine (docs/SPEC.md sections 1-8).
//!
//! A [`Node`] takes inputs ([`Input`]: received messages, trainer
//! completions, peer-lost notices, start/join/leave, a plan) with the
//! current time and returns [`Action`]s: messages to send, tasks for the
//! trainer, events. [`Node::timeout`] says when [`Node::on_timeout`] must run
//! next. The simulator (`crate::sim`) and the real engine are two drivers of
//! the same machine.
//!
//! # Map
//!
//! `Node` (node/mod.rs) holds the identity and the dispatcher's state; it
//! hands each input, each tick and each peer's death to the parts, which own
//! the rest. Shared by all: the peer view (`peers.rs`) and what the node
//! knows of the iterations (`iterations.rs`, changed through its methods).
//!
//! | part | files | owns |
//! | --- | --- | --- |
//! | membership | `peers.rs`, `membership.rs` | the peer view (RTT, bandwidth, liveness, suspicion); the stage group: members, the coordinator (the live member with the smallest id), heartbeats |
//! | join | `join.rs` | start; stage queries, the bottleneck choice, the state download |
//! | restore | `restore.rs` | an emptied stage taken up from the freshest copy the data holders keep (the offers, the download), else rebuilt from its neighbouring stages' states (CheckFree), else restarted; a holder's answers from the copies its runtime keeps |
//! | fencing | `fencing.rs` | a node that was paused, cut off or evicted stops serving its group and joins again as its next incarnation; the coordinator's evictions (silent, lost or diverged members) and the digest comparison before an apply |
//! | flow protocol (GWTF) | `costs.rs`, `flow.rs`, `search.rs` | the cost model and CHANGE gossip; reservations (request, response, idle expiry, push-back, cancel, reroute); the local search (swaps, redirects) |
//! | routing | `routing.rs`, `balancer.rs` | the next hop, and what the GWTF, SWARM, SWARM-plus and planned policies decide differently ([`Policy`] behind one trait); SWARM's cumulative-work heap, its ban on failure and fixed timeouts |
//! | microbatch lifecycle | `holder.rs`, `lifecycle.rs`, `acks.rs`, `recovery.rs` | iterations at a holder and its launches; forward and backward hops with their snapshots; acks, deadlines, queued notices; forward rerouting, stage-only re-runs, restarts (section 5) |
//! | stage group | `group.rs`, `coordinator.rs`, `barrier.rs` | a member's claims and commits; the coordinator's exactly-once grants, commit (as soon as its stage's work is done), aggregation and recomputation of lost grants; the holders' iteration barrier and the opening of an iteration passed along the pipeline (section 6) |
//!
//! A part changes only its own state and the shared peer view; it asks
//! another part, or the iterations, through their methods.
//! `node/testkit.rs` helps the parts' unit tests drive a single node.
//!
//! # Where each message kind is handled
//!
//! | message | part (handler) |
//! | --- | --- |
//! | `Introduce`, `Probe`, `ProbeAck` | membership (`on_introduce`, dispatcher, `on_probe_ack`) |
//! | `Heartbeat`, `Goodbye`, `GroupJoin` | membership (`on_heartbeat`, `peer_dead`, `on_group_join`) |
//! | `Evicted` | fencing (`on_evicted`: the node stops serving its group and joins again) |
//! | `Change` | flow protocol, costs (`on_change`) |
//! | `FlowRequest`, `FlowResponse` | flow protocol, reservations (`on_flow_request`, `on_flow_response`) |
//! | `NotifySwitch`, `NotifyRedirect`, `PushBack`, `Cancel` | flow protocol, reservations (`on_notify_switch`, `on_notify_redirect`, `on_push_back`, `on_cancel`) |
//! | `QueryFlows`, `FlowTable` | flow protocol, local search (`on_query_flows`, `on_flow_table`) |
//! | `ProposeSwap`, `RespondSwap`, `ProposeRedirect`, `RespondRedirect` | flow protocol, local search (`on_propose_swap`, `on_respond_swap`, `on_propose_redirect`, `on_respond_redirect`) |
//! | `Forward`, `Backward` | lifecycle (`on_forward`, `on_backward`) |
//! | `Ack`, `Queued` | lifecycle, acks (`on_ack`, `on_queued`) |
//! | `CrashNotice`, `Redo` | lifecycle, recovery (`on_crash_notice`, `on_redo`) |
//! | `Restart`, `StartIter` | lifecycle, holder (`on_restart_request`, `on_start_iter`); `StartIter` also stage group, barrier (`on_iteration_opened`: passed along the pipeline) |
//! | `Claim`, `Sync`, `EndIter`, `AggDone`, `AggFailed`, `Applied`, `Restarting` | stage group, coordinator (`on_claim`, `on_sync`, `on_end_iter`, `on_agg_done`, `on_agg_failed`, `on_applied`, `on_restarting`) |
//! | `ClaimReply`, `Commit` | stage group, member (`on_claim_reply`, `on_commit`) |
//! | `Deputy` | stage group, deputy (`on_deputy`: the coordinator's own grants, kept by the member that would take over) |
//! | `HolderDone`, `StageDone` | stage group, barrier (`on_holder_done`, `on_stage_done`) |
//! | `Finalize` | nobody (ignored) |
//! | `StageQuery`, `StageInfo`, `StateRequest`, `StateResponse` | join (`on_stage_query`, `on_stage_info`, `on_state_request`, `on_state_response`; a restore's copy through `restored`, a rebuild's neighbour state through `on_neighbour_state`) |
//! | `KeptQuery`, `KeptInfo` | restore (`on_kept_query`, `on_kept_info`) |
//! | `CopyRequest`, `KeptRequest`, `RebuildRequest` | nobody: the runtime serves them (a holder's copies and checkpoints, a restorer's copy, a rebuilder's neighbour state) |
//!
//! **\[decision\]** CHECK_FLOW is replaced by idle expiry of reservations plus
//! PUSH_BACK when a microbatch arrives on an unknown reservation;
//! NOTIFY_COST is not sent (a reservation keeps the cost from source it was
//! made with).
pub mod codec;
mod node;
pub mod rng;
mod types;

pub use node::{AggregatePlan, Node, BUTTERFLY_MAX_MEMBERS};
pub use types::*;
