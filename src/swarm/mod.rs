//! The runtime that makes real swarm nodes (docs/ARCHITECTURE.md): a
//! `protocol::Node` driven on real time over the engine, with a trainer
//! behind one work interface ([`runtime`], [`work`]), the tensors kept for
//! recovery ([`store`]), and the stage's crash-tolerant all-reduce: the
//! butterfly, the hierarchy of butterflies and the ring as sans-I/O
//! machines ([`butterfly`], [`hierarchy`], [`allreduce`]), their frames ([`allreduce_net`]) and the operation a
//! node runs for its stage ([`aggregate`]); what a node refuses of what its
//! peers send ([`intake`]); the states it serves to joiners ([`serving`]);
//! a data holder's copies of the relay stages' states (`copies`) and its
//! checkpoint rounds ([`saves`]), written for the built-in model by
//! [`model_checkpoint`]; an emptied stage rebuilt from its neighbours'
//! states (`rebuild`).
pub mod aggregate;
pub mod allreduce;
pub mod allreduce_net;
#[cfg(test)]
mod allreduce_testnet;
pub mod audit;
pub mod background;
pub mod bulk;
pub mod butterfly;
pub(crate) mod copies;
pub mod directory;
mod driver;
pub mod emulated;
mod event_from;
pub mod event_log;
pub mod hierarchy;
pub mod intake;
pub mod model_checkpoint;
pub mod model_pieces;
pub mod model_trainer;
mod rebuild;
pub mod runtime;
pub mod saves;
mod serving;
pub mod sizing;
mod state_stream;
mod states_asked;
pub mod store;
mod weights_first;
pub mod work;
