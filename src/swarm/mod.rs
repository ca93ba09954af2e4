//! The runtime that makes real swarm nodes (docs/ARCHITECTURE.md): it will
//! drive a `protocol::Node` with the engine and a trainer behind one task
//! interface. What exists so far is the stage's crash-tolerant all-reduce:
//! the ring algorithm as a sans-I/O machine ([`allreduce`]) and its driver
//! over the engine's connections ([`allreduce_net`]).
pub mod allreduce;
pub mod allreduce_net;
