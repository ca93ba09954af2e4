//! A size-faithful trainer without a model, for runs of real processes
//! that the simulator predicts (`gwtf bench testbed`): each piece of work
//! takes the time the simulator gives it on this node's GPU (its FLOPs
//! over the GPU's speed, by the same rules as `sim`'s task times), and
//! every tensor, gradient and state it hands the runtime has the real
//! model's size. So a swarm of a llama-500m's shape fits on a few cores:
//! only the network, the protocol and the all-reduce do real work.
//!
//! Its "weights" are a digest of every update it applied (the iteration,
//! the microbatches and a sample of the mean), so replicas agree when they
//! applied the same updates, and a state it exports is the digest followed
//! by zeros, as long as the real stage's state. Its gradients are zeros:
//! their size is what the all-reduce and the links feel.
use std::collections::BTreeSet;
use std::time::Duration;

use super::runtime::Trainer;
use super::sizing::NodeNeeds;
use super::work::{Output, Work, WorkKind, WorkPort};
use crate::protocol::{MbId, Stage};
use crate::sim::model::ModelPreset;

/// What one node's work takes, per stage: seconds on its GPU and bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct EmulatedShape {
    /// Forward seconds of relay stage s (index s-1); a backward is two
    /// forwards, three when it recomputes the forward first.
    pub forward_s: Vec<f64>,
    /// The embedding's forward (its backward counts twice that).
    pub embed_s: f64,
    /// Head forward, loss and head backward at a data holder.
    pub loss_s: f64,
    /// Parameters (gradient elements): index 0 the holders' (embedding and
    /// head), s relay stage s.
    pub params: Vec<usize>,
    /// Bytes of a stage's exported state (weights, gradient, Adam moments):
    /// index as `params`.
    pub state_bytes: Vec<usize>,
    /// Bytes of an activation (and of its gradient) between stages.
    pub activation_bytes: usize,
}

impl EmulatedShape {
    /// The shape of `model` on a GPU of `flops` FLOP/s: the simulator's
    /// task times (`sim::Sim::task_time`) and sizes.
    pub fn of(model: &ModelPreset, flops: f64) -> Result<EmulatedShape, String> {
        if !(flops.is_finite() && flops > 0.0) {
            return Err(format!("a GPU of {flops} FLOP/s"));
        }
        let stages = model.relay_stages;
        let size = |b: u64, what: &str| {
            usize::try_from(b).map_err(|_| format!("{what} of {b} bytes does not fit in memory"))
        };
        Ok(EmulatedShape {
            forward_s: (1..=stages)
                .map(|s| model.stage_fwd_flops(s) / flops)
                .collect(),
            embed_s: model.embed_flops() / flops,
            loss_s: model.loss_flops() / flops,
            params: (0..=stages)
                .map(|s| size(model.stage_params(s), "a stage's parameters"))
                .collect::<Result<_, _>>()?,
            state_bytes: (0..=stages)
                .map(|s| size(model.stage_state_bytes(s), "a stage's state"))
                .collect::<Result<_, _>>()?,
            activation_bytes: size(model.activation_bytes(), "an activation")?,
        })
    }

    /// Relay stages.
    pub fn relay_stages(&self) -> Stage {
        self.forward_s.len() as Stage
    }

    fn forward(&self, stage: Stage) -> Result<f64, String> {
        (stage as usize)
            .checked_sub(1)
            .and_then(|i| self.forward_s.get(i))
            .copied()
            .ok_or_else(|| format!("no relay stage {stage}"))
    }

    fn index(&self, stage: Stage) -> Result<usize, String> {
        let i = stage as usize;
        (i < self.params.len())
            .then_some(i)
            .ok_or_else(|| format!("no stage {stage}"))
    }

    /// Seconds `work` takes on this GPU (0 for what is not compute);
    /// `recomputes`: a backward whose forward kept only its input.
    pub fn seconds(&self, work: &WorkKind, stage: Stage, recomputes: bool) -> Result<f64, String> {
        Ok(match work {
            WorkKind::Embed => self.embed_s,
            WorkKind::EmbedBackward => 2.0 * self.embed_s,
            WorkKind::Loss => self.loss_s,
            WorkKind::Forward => self.forward(stage)?,
            WorkKind::Backward if recomputes => 3.0 * self.forward(stage)?,
            WorkKind::Backward => 2.0 * self.forward(stage)?,
            _ => 0.0,
        })
    }
}

/// What an emulated node of `model` declares to the library's sizing rule
/// (`swarm::sizing`), with `memory_bytes` for its microbatches: every
/// node of a swarm, and a simulator that runs the same protocol settings
/// (`gwtf bench testbed`), derive the same settings from it.
pub fn node_needs(model: &ModelPreset, memory_bytes: u64) -> NodeNeeds {
    NodeNeeds {
        stage_state_bytes: (0..=model.relay_stages)
            .map(|s| model.stage_state_bytes(s))
            .collect(),
        largest_tensor_bytes: model.activation_bytes(),
        microbatch_bytes: model.activation_bytes(),
        memory_budget_bytes: memory_bytes,
    }
}

/// The trainer of [`EmulatedShape`]: see the module's doc.
pub struct EmulatedTrainer {
    shape: EmulatedShape,
    weights: [u8; 32],
    /// Microbatches whose forward's activations were dropped
    /// (`WorkKind::Discard`): their backward recomputes the forward.
    discarded: BTreeSet<MbId>,
    /// Seconds of emulated compute so far.
    busy_s: f64,
}

impl EmulatedTrainer {
    pub fn new(shape: EmulatedShape) -> EmulatedTrainer {
        EmulatedTrainer {
            shape,
            weights: [0; 32],
            discarded: BTreeSet::new(),
            busy_s: 0.0,
        }
    }

    /// Seconds of emulated compute it has waited so far.
    pub fn busy_s(&self) -> f64 {
        self.busy_s
    }

    /// A new digest from the current one and `parts`.
    fn digest(&mut self, parts: &[&[u8]]) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(&self.weights);
        for p in parts {
            h.update(p);
        }
        self.weights = *h.finalize().as_bytes();
        self.weights
    }

    fn state_frame(&self, stage: Stage, port: &WorkPort) -> Result<Output, String> {
        let len = self.shape.state_bytes[self.shape.index(stage)?].max(32);
        let mut f = port.alloc(len).map_err(|e| e.to_string())?;
        let p = f.payload_mut();
        p[..32].copy_from_slice(&self.weights);
        p[32..].fill(0);
        Ok(Output::State(f))
    }

    /// The digest a state of `stage` carries, checked for its size.
    fn read_state(&self, stage: Stage, state: &[u8]) -> Result<[u8; 32], String> {
        let want = self.shape.state_bytes[self.shape.index(stage)?].max(32);
        if state.len() != want {
            return Err(format!(
                "a state of {} bytes for stage {stage}, whose state is {want}",
                state.len()
            ));
        }
        Ok(state[..32].try_into().expect("32 bytes"))
    }
}

/// Every [`SAMPLE_STRIDE`]th element of `x`: what an update's digest
/// covers, so that applying it costs no real work (a real trainer's
/// optimizer step runs on the GPU, which the emulation only waits for).
fn sampled(x: &[f32]) -> Vec<f32> {
    x.iter().step_by(SAMPLE_STRIDE).copied().collect()
}

/// See [`sampled`].
const SAMPLE_STRIDE: usize = 4096;

/// Bytes of `x` for hashing, a block at a time.
fn hash_f32s(h: &mut blake3::Hasher, x: &[f32]) {
    let mut buf = [0u8; 4096];
    for block in x.chunks(buf.len() / 4) {
        for (b, v) in buf.chunks_exact_mut(4).zip(block) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        h.update(&buf[..4 * block.len()]);
    }
}

impl Trainer for EmulatedTrainer {
    fn run(&mut self, work: Work, port: &WorkPort) -> Result<Output, String> {
        let recomputes = work.mb.is_some_and(|m| self.discarded.contains(&m));
        let s = self.shape.seconds(&work.kind, work.stage, recomputes)?;
        if s > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(s));
            self.busy_s += s;
        }
        let tensor = || {
            port.alloc(self.shape.activation_bytes.max(1))
                .map_err(|e| e.to_string())
        };
        Ok(match work.kind {
            WorkKind::Embed | WorkKind::Forward => Output::Tensor(tensor()?),
            WorkKind::Backward => {
                if let Some(m) = work.mb {
                    self.discarded.remove(&m);
                }
                Output::Tensor(tensor()?)
            }
            WorkKind::Loss => Output::Loss {
                loss: 1.0,
                grad: tensor()?,
            },
            WorkKind::Discard => {
                if let Some(m) = work.mb {
                    self.discarded.insert(m);
                }
                Output::None
            }
            WorkKind::Forget { before } => {
                self.discarded.retain(|m| m.iter >= before);
                Output::None
            }
            WorkKind::EmbedBackward => Output::None,
            // Zeros of the real length: the allocator hands out untouched
            // pages, so the gradient costs what the all-reduce does with it.
            WorkKind::Gradient { .. } => Output::Gradient {
                sum: vec![0.0; self.shape.params[self.shape.index(work.stage)?]],
                weights: self.weights,
            },
            WorkKind::Apply {
                iteration,
                mean,
                microbatches,
            } => {
                let mut h = blake3::Hasher::new();
                hash_f32s(&mut h, &sampled(&mean));
                h.update(&(mean.len() as u64).to_le_bytes());
                let m = *h.finalize().as_bytes();
                Output::Weights(self.digest(&[
                    &iteration.to_le_bytes(),
                    &microbatches.to_le_bytes(),
                    &m,
                ]))
            }
            WorkKind::ExportState => self.state_frame(work.stage, port)?,
            WorkKind::ImportState { .. } => {
                let input = work.input.ok_or("no state")?;
                self.weights = self.read_state(work.stage, input.payload())?;
                Output::Weights(self.weights)
            }
            WorkKind::InitState { .. } => {
                self.weights = [0; 32];
                Output::Weights(self.weights)
            }
            WorkKind::AverageStates { states, .. } => {
                self.weights = [0; 32];
                for (stage, st) in states.iter() {
                    let d = st.get(..32).unwrap_or(st);
                    self.digest(&[&stage.to_le_bytes(), d]);
                }
                Output::Rebuilt {
                    weights: self.weights,
                    averaged: states.len() as u32,
                }
            }
            // Its state is opaque to the runtime (no `weights_first`).
            WorkKind::ImportWeights { .. } | WorkKind::ImportRest { .. } => {
                return Err(format!("{} of an opaque state", work.kind.name()))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_is_the_simulators_times_and_sizes() {
        let m = ModelPreset::by_name("llama-124m").unwrap();
        let flops = 10e12;
        let s = EmulatedShape::of(&m, flops).unwrap();
        assert_eq!(s.relay_stages(), m.relay_stages);
        for st in 1..=m.relay_stages {
            let f = m.stage_fwd_flops(st) / flops;
            assert_eq!(s.seconds(&WorkKind::Forward, st, false).unwrap(), f);
            assert_eq!(s.seconds(&WorkKind::Backward, st, false).unwrap(), 2.0 * f);
            assert_eq!(s.seconds(&WorkKind::Backward, st, true).unwrap(), 3.0 * f);
            assert_eq!(s.params[st as usize] as u64, m.stage_params(st));
            assert_eq!(s.state_bytes[st as usize] as u64, m.stage_state_bytes(st));
        }
        assert_eq!(
            s.seconds(&WorkKind::Loss, 0, false).unwrap(),
            m.loss_flops() / flops
        );
        assert_eq!(s.activation_bytes as u64, m.activation_bytes());
        assert!(s.seconds(&WorkKind::Forward, 0, false).is_err());
        assert!(s
            .seconds(&WorkKind::Forward, m.relay_stages + 1, false)
            .is_err());
        assert!(EmulatedShape::of(&m, 0.0).is_err());
        assert!(EmulatedShape::of(&m, f64::NAN).is_err());
    }

    #[test]
    fn a_state_of_the_wrong_size_is_refused() {
        let m = ModelPreset::by_name("llama-124m").unwrap();
        let t = EmulatedTrainer::new(EmulatedShape::of(&m, 1e12).unwrap());
        let want = m.stage_state_bytes(1) as usize;
        let mut st = vec![0u8; want];
        st[..32].copy_from_slice(&[7; 32]);
        assert_eq!(t.read_state(1, &st).unwrap(), [7; 32]);
        assert!(t.read_state(1, &st[..want - 1]).is_err());
        assert!(t.read_state(99, &st).is_err());
    }
}
