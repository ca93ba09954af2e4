//! How big a swarm node's buffers, queue and patience are, from what its
//! trainer declares: one rule for every way a node is made (the C API's
//! `gwtf_peer_new`, the `gwtf node` tool, a Rust embedder), so that two
//! nodes of one swarm never disagree on a frame limit or a timeout because
//! they were started differently.
//!
//! - **Patience** ([`Liveness`]): a large model's node is busy longer with
//!   its gradient, so the swarm waits as much longer before it takes a node
//!   for gone ([`Liveness::for_state_bytes`] of the largest stage state).
//! - **Capacity**: microbatches this node keeps in flight, its memory budget
//!   over one microbatch's memory, 1 to [`MAX_CAPACITY`].
//! - **Largest frame payload**: a whole stage state (plus its header), the
//!   largest tensor, a bandwidth probe, and at least 1 MiB.
//! - **Frame pool**: the memory budget, and at least four of the largest
//!   slots (a pool slot is a power of two): two states served at once, one
//!   received, and one carved up by the small frames.

use super::runtime::{realtime_config_with, Liveness, REALTIME_PROBE_BYTES};
use crate::engine::NodeOptions;
use crate::protocol::{Config, Stage};

/// The most microbatches one node keeps in flight, whatever its memory.
pub const MAX_CAPACITY: u32 = 64;

/// What a node's sizes follow from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeNeeds {
    /// Every stage's state bytes, the data holders' (stage 0) first.
    pub stage_state_bytes: Vec<u64>,
    /// The largest activation or gradient that crosses a link.
    pub largest_tensor_bytes: u64,
    /// Memory one microbatch in flight takes on this node.
    pub microbatch_bytes: u64,
    /// Memory this node may spend on microbatches in flight.
    pub memory_budget_bytes: u64,
}

/// A node's sizes (see the module doc for the rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeSizing {
    pub liveness: Liveness,
    /// Microbatches in flight, 1..=[`MAX_CAPACITY`].
    pub capacity: u32,
    /// The largest frame payload this node sends or accepts.
    pub max_payload: u64,
    /// Bytes of the frame pool.
    pub pool_bytes: usize,
}

impl NodeSizing {
    /// The sizes for `needs`. Errors when the frame pool would not fit in
    /// this machine's address space.
    pub fn of(needs: &NodeNeeds) -> Result<NodeSizing, String> {
        let state_max = needs.stage_state_bytes.iter().copied().max().unwrap_or(0);
        let liveness = Liveness::for_state_bytes(state_max);
        let capacity = (needs.memory_budget_bytes / needs.microbatch_bytes.max(1))
            .clamp(1, MAX_CAPACITY as u64) as u32;
        let max_payload = state_max
            .saturating_add(64)
            .max(needs.largest_tensor_bytes)
            .max(REALTIME_PROBE_BYTES)
            .max(1 << 20);
        let slot = max_payload
            .checked_next_power_of_two()
            .and_then(|s| s.checked_mul(4));
        let pool = slot
            .map(|s| s.max(needs.memory_budget_bytes))
            .and_then(|p| usize::try_from(p).ok())
            .ok_or_else(|| {
                format!(
                    "a frame pool for {} MiB of microbatches and {} MiB frames does not fit \
                     in this machine's memory",
                    needs.memory_budget_bytes >> 20,
                    max_payload >> 20
                )
            })?;
        Ok(NodeSizing {
            liveness,
            capacity,
            max_payload,
            pool_bytes: pool,
        })
    }

    /// The protocol's real-time settings with this patience, for a swarm of
    /// `needs`' stages (`stage_state_bytes` set); the caller sets what is
    /// not a size (iterations, microbatches, saving, ...).
    pub fn protocol(&self, needs: &NodeNeeds) -> Config {
        let relay_stages = needs.stage_state_bytes.len().saturating_sub(1) as Stage;
        let mut c = realtime_config_with(relay_stages, needs.largest_tensor_bytes, self.liveness);
        c.stage_state_bytes = needs.stage_state_bytes.clone();
        c
    }

    /// Sets the transport's sizes and timeouts in `net`.
    pub fn apply(&self, net: &mut NodeOptions) {
        net.max_payload = self.max_payload;
        net.pool_bytes = self.pool_bytes;
        net.heartbeat_interval = self.liveness.heartbeat();
        net.peer_timeout = self.liveness.transport_timeout();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needs() -> NodeNeeds {
        NodeNeeds {
            stage_state_bytes: vec![40 << 20, 85 << 20, 85 << 20],
            largest_tensor_bytes: 2 << 20,
            microbatch_bytes: 8 << 20,
            memory_budget_bytes: 256 << 20,
        }
    }

    #[test]
    fn sizes_follow_the_largest_state_and_the_budget() {
        let s = NodeSizing::of(&needs()).unwrap();
        assert_eq!(s.capacity, 32);
        assert_eq!(s.max_payload, (85 << 20) + 64);
        // Four slots of the next power of two (128 MiB) beat the 256 MiB budget.
        assert_eq!(s.pool_bytes, 4 * (128 << 20));
        assert_eq!(s.liveness, Liveness::for_state_bytes(85 << 20));
        assert!(s.liveness.suspicion() > Liveness::RUNTIME.suspicion());
    }

    #[test]
    fn capacity_is_at_least_one_and_at_most_the_cap() {
        let mut n = needs();
        n.memory_budget_bytes = 1;
        assert_eq!(NodeSizing::of(&n).unwrap().capacity, 1);
        n.memory_budget_bytes = 1 << 40;
        n.microbatch_bytes = 0;
        assert_eq!(NodeSizing::of(&n).unwrap().capacity, MAX_CAPACITY);
    }

    #[test]
    fn a_tiny_model_still_gets_megabyte_frames_and_the_runtime_patience() {
        let n = NodeNeeds {
            stage_state_bytes: vec![1000, 2000],
            largest_tensor_bytes: 100,
            microbatch_bytes: 400,
            memory_budget_bytes: 1 << 20,
        };
        let s = NodeSizing::of(&n).unwrap();
        assert_eq!(s.max_payload, 1 << 20);
        assert_eq!(s.pool_bytes, 4 << 20);
        assert_eq!(s.liveness, Liveness::RUNTIME);
    }

    #[test]
    fn the_protocol_and_the_transport_get_the_same_patience() {
        let n = needs();
        let s = NodeSizing::of(&n).unwrap();
        let c = s.protocol(&n);
        assert_eq!(c.relay_stages, 2);
        assert_eq!(c.stage_state_bytes, n.stage_state_bytes);
        assert_eq!(c.suspect_ticks, s.liveness.suspect_ticks);
        assert!(c.probe_bytes <= s.max_payload);
        let mut net = NodeOptions::default();
        s.apply(&mut net);
        assert_eq!(net.max_payload, s.max_payload);
        assert_eq!(net.pool_bytes, s.pool_bytes);
        assert_eq!(net.heartbeat_interval, s.liveness.heartbeat());
        assert_eq!(net.peer_timeout, s.liveness.transport_timeout());
    }

    #[test]
    fn sizes_that_overflow_are_an_error_not_a_wrap() {
        let mut n = needs();
        n.stage_state_bytes = vec![u64::MAX - 10];
        assert!(NodeSizing::of(&n).is_err());
    }
}
