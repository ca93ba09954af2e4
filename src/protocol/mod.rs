//! The GWTF protocol as a sans-I/O state machine.
//!
//! A [`Node`] takes inputs ([`Input`]: received messages, trainer
//! completions, peer-lost notices, start/join/leave) with the current time
//! and returns [`Action`]s: messages to send, tasks for the trainer, events.
//! [`Node::timeout`] says when [`Node::on_timeout`] must run next. The
//! simulator (`crate::sim`) and the real engine are two drivers of the same
//! machine.
//!
//! What a node does (GWTF.md sections 2-6, 8):
//! - **Membership**: a partial view of the previous, next and same stage,
//!   introductions with an RTT probe and a bandwidth probe, heartbeats inside
//!   a stage's group (members to the coordinator and back), suspicion after
//!   `suspect_ticks` of silence, goodbye on graceful leave. The group
//!   coordinator of a stage is its live member with the smallest id.
//! - **Decentralized flow protocol** (policy [`Policy::Gwtf`]): holders
//!   reserve up to `max_in_flight` units of flow; a FLOW_REQUEST travels
//!   toward the sink and each hop reserves its downstream capacity before it
//!   accepts upstream (the FLOW_RESPONSEs come back from the sink end, so a
//!   unit is offered upstream only once reserved downstream); a stale
//!   expected cost is rejected with the fresh one; CHANGE gossips spare
//!   capacity and the best costs to the nearest sinks upstream every
//!   `gossip_ticks`; same-stage relays run simulated annealing (QUERY_FLOWS,
//!   PROPOSE_SWAP / PROPOSE_REDIRECT) minimising the larger of the affected
//!   flow costs; costs are EMAs of measured compute times, RTTs and transfer
//!   rates. **[decision]** CHECK_FLOW is replaced by idle expiry of
//!   reservations plus PUSH_BACK when a microbatch arrives on an unknown
//!   reservation; NOTIFY_COST is not sent (a reservation keeps the cost from
//!   source it was made with).
//! - **Microbatch lifecycle**: iterations opened by the holders' coordinator,
//!   at most `max_in_flight` microbatches in flight per holder, every hop
//!   acknowledged once its work is done, adaptive ack timeouts, snapshots of
//!   each microbatch's input/output/path kept until the iteration is final,
//!   forward-crash rerouting, backward-crash recovery of only the crashed
//!   stage (the node before the dead one re-sends its stored activation to a
//!   replacement which sends to the unchanged next node, which re-sends its
//!   stored gradient), data-holder crash (its microbatches are dropped).
//! - **Aggregation**: each backward result is *claimed* at the stage's
//!   coordinator, which grants each microbatch to exactly one node; when the
//!   iteration ended and every expected microbatch is granted to a live node
//!   it commits, the members all-reduce (a trainer task) and the coordinator
//!   applies a new weights version. A member lost before the apply loses its
//!   grants: the coordinator has them recomputed (GWTF: re-run of only that
//!   stage from the stored activation upstream and the stored gradient
//!   downstream; SWARM: restart from the holder) and commits again.
//! - **Join and leave**: a joining node asks each stage for a summary, picks
//!   the stage with the smallest throughput (bottleneck first), downloads the
//!   state from a member and joins its group; leaving nodes say goodbye.
//! - **SWARM** ([`Policy::Swarm`]) and the centrally planned **optimal**
//!   routing ([`Policy::Optimal`]) run in the same framework.
pub mod codec;
mod node;
pub mod rng;
mod types;

pub use node::Node;
pub use types::*;
