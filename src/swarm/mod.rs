//! The runtime that makes real swarm nodes (docs/ARCHITECTURE.md): a
//! `protocol::Node` driven on real time over the engine, with a trainer
//! behind one task interface ([`runtime`]), and the stage's crash-tolerant
//! all-reduce: the ring algorithm as a sans-I/O machine ([`allreduce`]) and
//! its driver over the engine's connections ([`allreduce_net`]).
pub mod allreduce;
pub mod allreduce_net;
pub mod bulk;
pub mod runtime;
