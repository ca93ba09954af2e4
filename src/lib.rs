//! libgwtf: Go With The Flow. Many unreliable, far-apart machines train one
//! model together: microbatches are routed through pipeline stages as a
//! flow problem, decided by the nodes themselves, and a crash costs one
//! stage of one microbatch, never the whole step.
//!
//! # Where to start
//!
//! - [`protocol`]: the heart, a sans-I/O state machine per node. Its module
//!   doc has the map of its parts and a table of every message.
//! - [`swarm`]: a node for real. It runs that machine on real time over
//!   the [`engine`]'s connections, with a trainer behind one work interface.
//! - [`sim`]: the discrete-event simulator. It drives the same machines on
//!   a virtual clock.
//! - [`ffi`]: the C API (`include/gwtf.h`), for C, C++, Go and Python.
//! - `docs/ARCHITECTURE.md` in the repository: modules, threads, buffers.
//!
//! # Threads of a running node
//!
//! ```text
//!  trainer threads            swarm driver thread          engine poll thread
//!  (built-in, or C/Go/Py)     (owns protocol::Node)        (owns every socket)
//!  next_work() <------------- Run(task) -> Work
//!  complete()  -------------> Input::TaskDone
//!                             Action::Send --------------> control / data frames
//!                             Input::Message <------------ frames in
//!                             on_timeout() every tick      timers, link emulation
//! ```
//!
//! The trainer never touches a socket, and the protocol never touches a
//! socket or a clock: the driver turns one into the other.
//!
//! # Driving the protocol by hand
//!
//! A [`protocol::Node`] takes an [`protocol::Input`] with the time and
//! returns [`protocol::Action`]s: messages to send, tasks for the trainer,
//! events. [`protocol::Node::timeout`] says when to call
//! [`protocol::Node::on_timeout`] next. Here one data holder and one relay
//! train one iteration; messages take 10 ms, and every task is done at
//! once (a real driver hands it to a trainer and reports its end).
//!
//! ```
//! use gwtf::protocol::{Action, Config, Event, Input, Node, NodeId, Policy, Time, SEC};
//! use std::collections::{BTreeMap, VecDeque};
//! use std::sync::Arc;
//!
//! let mut cfg = Config::new(Policy::Gwtf, 1, 1 << 20); // one relay stage
//! cfg.mb_per_iter = 2;
//! cfg.iterations = Some(1);
//! cfg.stage_state_bytes = vec![1 << 20; 2];
//! let cfg = Arc::new(cfg);
//! let mut nodes = BTreeMap::new();
//! nodes.insert(1, Node::new(cfg.clone(), 1, 0, 0.1, 4, 7)); // the holder
//! nodes.insert(2, Node::new(cfg.clone(), 2, 1, 0.1, 4, 7)); // a relay
//!
//! // (when, to, input), in order of time.
//! let mut queue: VecDeque<(Time, NodeId, Input)> = VecDeque::new();
//! queue.push_back((0, 1, Input::Start { peers: vec![(2, 1)] }));
//! queue.push_back((0, 2, Input::Start { peers: vec![(1, 0)] }));
//! let mut finalized = false;
//! let (mut now, mut steps): (Time, u32) = (0, 0);
//! while !finalized && now < 600 * SEC && steps < 1_000_000 {
//!     steps += 1;
//!     // The next thing to happen: a queued input, or a node's timer.
//!     let next_input = queue.front().map(|q| q.0);
//!     let next_timer = nodes.iter().filter_map(|(&id, n)| n.timeout().map(|t| (t, id))).min();
//!     let (id, actions) = match (next_input, next_timer) {
//!         (Some(t), Some((tt, _))) if t <= tt => {
//!             let (t, id, input) = queue.pop_front().unwrap();
//!             now = t;
//!             (id, nodes.get_mut(&id).unwrap().handle(now, input))
//!         }
//!         (Some(_), None) => {
//!             let (t, id, input) = queue.pop_front().unwrap();
//!             now = t;
//!             (id, nodes.get_mut(&id).unwrap().handle(now, input))
//!         }
//!         (_, Some((t, id))) => {
//!             now = now.max(t);
//!             (id, nodes.get_mut(&id).unwrap().on_timeout(now))
//!         }
//!         (None, None) => break,
//!     };
//!     for action in actions {
//!         match action {
//!             Action::Send { to, msg } => {
//!                 let input = Input::Message { from: id, msg };
//!                 let at = now + SEC / 100;
//!                 let i = queue.partition_point(|q| q.0 <= at);
//!                 queue.insert(i, (at, to, input));
//!             }
//!             Action::Run(task) => {
//!                 let i = queue.partition_point(|q| q.0 <= now);
//!                 queue.insert(i, (now, id, Input::TaskDone { id: task.id }));
//!             }
//!             Action::Event(Event::IterFinalized { iter: 0, .. }) => finalized = true,
//!             Action::Event(_) => {}
//!         }
//!     }
//! }
//! assert!(finalized, "the holder and the relay trained iteration 0");
//! ```
pub mod cuda;
pub mod engine;
pub mod ffi;
pub mod flow;
pub mod model;
pub mod pool;
pub mod protocol;
pub mod sim;
pub mod swarm;
pub mod wire;

/// The library's version, "MAJOR.MINOR.PATCH" (what `gwtf_version()` returns
/// to C; the `gwtf` tool, a crate of its own, prints it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
