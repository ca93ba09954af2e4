//! The built-in trainer of `gwtf node`: libgwtf's own model (`model`)
//! behind the same work interface a C or Go trainer pulls from.
//!
//! The model is cut into `S` stages ([`StagePlan`] with `S >= 3`): data
//! holders run the first (embedding) and the last (final norm, head, loss),
//! relays of protocol stage `k` run model stage `k` (`1..=S-2`).
//!
//! Exactly once: a backward's parameter gradient is kept apart, per
//! microbatch, until the stage aggregates; the gradient handed to the
//! all-reduce sums exactly the granted microbatches, in microbatch order,
//! so a microbatch computed twice after a recovery is never counted twice,
//! and every replica sums the same way.
//!
//! Data: the microbatch `(holder, iteration, index)` is drawn from the
//! holder's documents by a generator seeded from the run's seed and those
//! three numbers ([`microbatch`]), so a restarted microbatch is the same
//! one, and the single-process reference ([`reference_losses`]) trains on
//! exactly the swarm's microbatches.
use super::model_pieces::{OnCpu, Piece, Placement};
use super::runtime::Trainer;
use super::work::{Output, Work, WorkKind, WorkPort};
use crate::engine::Frame;
use crate::model::data::sample_windows;
use crate::model::rng::Rng;
use crate::model::stage::{bytes_to_f32s, f32s_bytes_into, Layout};
use crate::model::{
    checkpoint, AdamW, ModelConfig, ModelError, Pipeline, Stage, StageInput, StageOutput,
    StagePlan, StageState, StateParts, TrainOptions,
};
use crate::protocol::{MbId, NodeId};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// What every node of one swarm agrees on about the model.
#[derive(Clone, Debug)]
pub struct ModelRun {
    pub cfg: ModelConfig,
    /// Stages of the model cut (>= 3; relays serve `1..=stages-2`).
    pub stages: usize,
    /// Seed of the initial weights and of the microbatches.
    pub seed: u64,
    /// Learning-rate schedule and AdamW settings (`steps`: the iterations).
    pub opts: TrainOptions,
}

impl ModelRun {
    /// `cfg` cut into `stages`, trained for `iterations` with the defaults
    /// of `gwtf train`.
    pub fn new(
        cfg: ModelConfig,
        stages: usize,
        seed: u64,
        iterations: usize,
    ) -> Result<ModelRun, ModelError> {
        if stages < 3 {
            return Err(ModelError::InvalidConfig(format!(
                "{stages} stages: a swarm needs at least 3 (embedding, blocks, head)"
            )));
        }
        StagePlan::new(&cfg, stages)?;
        let mut opts = TrainOptions::for_run(&cfg, iterations.max(1));
        opts.seed = seed;
        opts.stages = stages;
        Ok(ModelRun {
            cfg,
            stages,
            seed,
            opts,
        })
    }

    /// Bytes of an activation between two stages (and of its gradient).
    pub fn activation_bytes(&self) -> usize {
        4 * self.opts.batch * self.opts.seq * self.cfg.d_model
    }

    /// The pieces protocol stage `stage` runs (0: a data holder's two).
    pub fn pieces(&self, stage: u16) -> Result<Vec<Stage>, ModelError> {
        let (plan, idx) = self.piece_plan(stage)?;
        idx.into_iter()
            .map(|i| Stage::new(&self.cfg, &plan, i, self.seed))
            .collect()
    }

    /// The pieces protocol stage `stage` runs, built where `on` runs them.
    pub fn pieces_on(
        &self,
        on: &dyn Placement,
        stage: u16,
    ) -> Result<Vec<Box<dyn Piece>>, ModelError> {
        let (plan, idx) = self.piece_plan(stage)?;
        idx.into_iter()
            .map(|i| on.build(&self.cfg, &plan, i, self.seed))
            .collect()
    }

    /// The plan of the model's stages and the indices of those protocol
    /// stage `stage` serves (without building them).
    pub fn piece_plan(&self, stage: u16) -> Result<(StagePlan, Vec<usize>), ModelError> {
        let plan = StagePlan::new(&self.cfg, self.stages)?;
        let idx: Vec<usize> = if stage == 0 {
            vec![0, self.stages - 1]
        } else if (stage as usize) < self.stages - 1 {
            vec![stage as usize]
        } else {
            return Err(ModelError::InvalidConfig(format!(
                "stage {stage} of a swarm with {} relay stages",
                self.stages - 2
            )));
        };
        Ok((plan, idx))
    }

    /// The optimizer settings of iteration `iter`'s update.
    pub fn adamw(&self, iter: u32) -> AdamW {
        adamw(&self.opts, iter)
    }

    /// Bytes of the state protocol stage `stage` transfers to a joiner, at
    /// most (with the parameters from before the last update: see
    /// [`ModelTrainer`]'s state format).
    pub fn state_bytes(&self, stage: u16) -> Result<u64, ModelError> {
        let sizes = self.piece_sizes(stage)?;
        let params: usize = sizes.iter().map(|&(n, _)| n).sum();
        // Per piece its length and `Stage::export_state`'s 28 + 12 n bytes.
        let states: u64 = sizes.iter().map(|&(n, _)| 36 + 12 * n as u64).sum();
        Ok(states + 8 + 4 * params as u64)
    }

    /// Parameters and blocks of each piece protocol stage `stage` runs,
    /// from the plan alone: nothing is built (building a gpt2-small's
    /// pieces draws 163M initial weights).
    fn piece_sizes(&self, stage: u16) -> Result<Vec<(usize, usize)>, ModelError> {
        let (plan, idx) = self.piece_plan(stage)?;
        idx.into_iter()
            .map(|i| {
                let layout = Layout::new(&self.cfg, &plan, i)?;
                Ok((layout.num_params(), plan.stages[i].blocks.len()))
            })
            .collect()
    }

    /// Memory one microbatch in flight takes at protocol stage `stage`:
    /// the activations its backward keeps, its gradient kept apart, and
    /// the tensors kept for recovery (a rough upper bound).
    pub fn bytes_per_microbatch(&self, stage: u16) -> Result<u64, ModelError> {
        let sizes = self.piece_sizes(stage)?;
        let params: usize = sizes.iter().map(|&(n, _)| n).sum();
        let blocks: usize = sizes.iter().map(|&(_, b)| b).sum();
        let act = self.activation_bytes();
        // A block keeps about 12 activations of its width, and the FFN's.
        let per_block = act * (12 + 2 * self.cfg.ffn_hidden / self.cfg.d_model.max(1));
        let head = if stage == 0 {
            4 * self.opts.batch * self.opts.seq * self.cfg.vocab_size + 3 * act
        } else {
            0
        };
        Ok((4 * params + blocks * per_block + head + 4 * act) as u64)
    }
}

/// The tokens and targets of microbatch `mb` drawn from `docs`.
pub fn microbatch(
    docs: &[Vec<u32>],
    seed: u64,
    mb: MbId,
    batch: usize,
    seq: usize,
) -> (Vec<u32>, Vec<u32>) {
    let ids = [0x5357_524d, mb.holder as u64, mb.iter as u64, mb.idx as u64];
    let mut rng = Rng::derived(seed, &ids);
    sample_windows(docs, &mut rng, batch, seq)
}

/// The single-process reference: the same model trained in one process on
/// exactly the swarm's microbatches (every holder's `mb_per_iter` per
/// iteration, one optimizer step per iteration). Returns the mean loss of
/// each iteration.
pub fn reference_losses(
    run: &ModelRun,
    holders: &[(NodeId, &[Vec<u32>])],
    mb_per_iter: u32,
    iterations: u32,
    on_iteration: impl FnMut(u32, f32),
) -> Result<Vec<f32>, ModelError> {
    reference_run(run, holders, mb_per_iter, iterations, on_iteration).map(|r| r.0)
}

/// [`reference_losses`], and the model trained (its weights after the
/// update of the last iteration).
pub fn reference_run(
    run: &ModelRun,
    holders: &[(NodeId, &[Vec<u32>])],
    mb_per_iter: u32,
    iterations: u32,
    mut on_iteration: impl FnMut(u32, f32),
) -> Result<(Vec<f32>, Pipeline), ModelError> {
    let mut p = Pipeline::new(&run.cfg, run.stages, run.seed)?;
    let (b, t) = (run.opts.batch, run.opts.seq);
    let mut out = Vec::with_capacity(iterations as usize);
    for iter in 0..iterations {
        let mut sum = 0.0f64;
        let mut n = 0;
        for &(holder, docs) in holders {
            for idx in 0..mb_per_iter {
                let mb = MbId { holder, iter, idx };
                let (x, y) = microbatch(docs, run.seed, mb, b, t);
                let id = ((iter as u64) << 32) | n as u64;
                sum += p.forward_backward(id, b, t, &x, &y)? as f64;
                n += 1;
            }
        }
        p.step(&adamw(&run.opts, iter))?;
        let loss = (sum / n.max(1) as f64) as f32;
        on_iteration(iter, loss);
        out.push(loss);
    }
    Ok((out, p))
}

/// The optimizer settings of iteration `iter`.
fn adamw(o: &TrainOptions, iter: u32) -> AdamW {
    AdamW {
        lr: o.lr_at(iter as usize),
        weight_decay: o.weight_decay,
        ..AdamW::default()
    }
}

/// The built-in trainer.
///
/// Its state for a joiner (`gwtf_stage`-based trainers share it): per
/// piece, the length of its state (u64, little-endian) and the state
/// (`Stage::export_state`); then, when the exporter has them, the
/// parameters from before its last update: their length in bytes (u64) and
/// the pieces' parameters in order (f32, little-endian). A joiner may be
/// asked to run a microbatch of the iteration of that update (its
/// contribution was lost at another stage and its holder restarted it)
/// after every member that applied the update itself is gone.
pub struct ModelTrainer {
    run: ModelRun,
    /// Holder: `[embedding, head]`; relay: `[its stage]`.
    pieces: Vec<Box<dyn Piece>>,
    /// Where the pieces run.
    placement: Arc<dyn Placement>,
    /// The protocol stage the pieces are for (None: a joiner before the
    /// swarm chose its stage).
    stage: Option<u16>,
    /// Holder: its documents.
    docs: Vec<Vec<u32>>,
    /// Holder: the targets of each microbatch embedded.
    targets: HashMap<MbId, Vec<u32>>,
    /// The model's id of each microbatch whose activations are kept.
    ids: HashMap<MbId, u64>,
    next_id: u64,
    /// Each microbatch's parameter gradient, per piece, until aggregated.
    grads: BTreeMap<MbId, Vec<Option<Vec<f32>>>>,
    /// The last update applied (or imported), and the parameters from
    /// before it: a microbatch of that iteration recomputed after the update
    /// (a holder restarted it) must see the weights its iteration saw.
    applied: Option<u32>,
    before: Option<Vec<Vec<f32>>>,
}

impl ModelTrainer {
    /// A relay of protocol stage `stage`, or (stage 0) a data holder
    /// training on `docs`.
    pub fn new(run: ModelRun, stage: u16, docs: Vec<Vec<u32>>) -> Result<Self, ModelError> {
        let holder = stage == 0;
        if holder && (docs.is_empty() || docs.iter().any(|d| d.len() <= run.opts.seq)) {
            return Err(ModelError::Data(format!(
                "a data holder needs documents longer than {} tokens",
                run.opts.seq
            )));
        }
        Ok(ModelTrainer {
            pieces: run.pieces_on(&OnCpu, stage)?,
            placement: Arc::new(OnCpu),
            stage: Some(stage),
            run,
            docs,
            targets: HashMap::new(),
            ids: HashMap::new(),
            next_id: 0,
            grads: BTreeMap::new(),
            applied: None,
            before: None,
        })
    }

    /// A relay joining a running swarm: its stage (and so its pieces) comes
    /// with its first work, the state download.
    pub fn joiner(run: ModelRun) -> ModelTrainer {
        ModelTrainer {
            pieces: Vec::new(),
            placement: Arc::new(OnCpu),
            stage: None,
            run,
            docs: Vec::new(),
            targets: HashMap::new(),
            ids: HashMap::new(),
            next_id: 0,
            grads: BTreeMap::new(),
            applied: None,
            before: None,
        }
    }

    /// A founding member of protocol stage `stage` resuming from a
    /// checkpoint: its pieces take `states` (the model stages' of the
    /// checkpoint, in order), standing for the weights after the update of
    /// iteration `applied`.
    pub fn resumed(
        run: ModelRun,
        stage: u16,
        docs: Vec<Vec<u32>>,
        states: &[StageState],
        applied: u32,
    ) -> Result<ModelTrainer, ModelError> {
        let mut t = ModelTrainer::new(run, stage, docs)?;
        for p in &mut t.pieces {
            let i = p.spec().index;
            let st = states.get(i).ok_or_else(|| {
                ModelError::InvalidConfig(format!("the checkpoint has no model stage {i}"))
            })?;
            p.set_state(st)?;
        }
        t.applied = Some(applied);
        Ok(t)
    }

    /// The same trainer with its pieces (and every piece it builds later)
    /// where `placement` runs them: their state moves over.
    pub fn placed(mut self, placement: Arc<dyn Placement>) -> Result<Self, ModelError> {
        let (plan, _) = match self.stage {
            Some(stage) => self.run.piece_plan(stage)?,
            None => (StagePlan::new(&self.run.cfg, self.run.stages)?, Vec::new()),
        };
        let mut moved = Vec::with_capacity(self.pieces.len());
        for p in &self.pieces {
            let index = p.spec().index;
            let mut q = placement.build(&self.run.cfg, &plan, index, self.run.seed)?;
            q.set_state(&p.state()?)?;
            moved.push(q);
        }
        self.pieces = moved;
        self.placement = placement;
        Ok(self)
    }

    /// Where the pieces run, in words.
    pub fn placement(&self) -> String {
        self.placement.describe()
    }

    /// Builds the pieces of `stage` if they are not those held.
    fn serve(&mut self, stage: u16) -> Result<(), String> {
        if self.stage != Some(stage) {
            if stage == 0 {
                return Err("a joiner cannot become a data holder".into());
            }
            self.pieces = self.build_pieces(stage)?;
            self.stage = Some(stage);
            self.ids.clear();
            self.grads.clear();
        }
        Ok(())
    }

    fn build_pieces(&self, stage: u16) -> Result<Vec<Box<dyn Piece>>, String> {
        (self.run)
            .pieces_on(&*self.placement, stage)
            .map_err(|e| e.to_string())
    }

    /// The pieces (for tests: their parameters).
    pub fn pieces(&self) -> &[Box<dyn Piece>] {
        &self.pieces
    }

    /// The model id for a new forward of `mb` (an older attempt's kept
    /// activations are dropped).
    fn fresh_id(&mut self, piece: usize, mb: MbId) -> u64 {
        if let Some(old) = self.ids.remove(&mb) {
            self.pieces[piece].discard(old);
        }
        self.next_id += 1;
        self.ids.insert(mb, self.next_id);
        self.next_id
    }

    fn keep_grad(&mut self, mb: MbId, piece: usize) -> Result<(), String> {
        let n = self.pieces.len();
        let g = self.pieces[piece].take_grads().map_err(|e| e.to_string())?;
        self.grads.entry(mb).or_insert_with(|| vec![None; n])[piece] = Some(g);
        Ok(())
    }

    /// The weights digest: SHA-256 over every piece's parameters, AdamW
    /// moments and step count.
    pub fn digest(&self) -> Result<[u8; 32], String> {
        let mut h = Sha256::new();
        for p in &self.pieces {
            p.state_bytes_into(&mut |b| h.update(b))
                .map_err(|e| e.to_string())?;
        }
        Ok(h.finalize().into())
    }

    /// Runs a microbatch's work on the weights of its iteration: the
    /// current ones, or those from before the last update when the
    /// microbatch belongs to the iteration of that update.
    fn compute_at_its_weights(&mut self, w: &Work, port: &WorkPort) -> Result<Output, String> {
        let iter = w.mb.map_or(0, |m| m.iter);
        let Some(applied) = self.applied.filter(|&a| iter <= a) else {
            return self.compute(w, port);
        };
        if iter < applied || self.before.is_none() {
            return Err(format!(
                "a microbatch of iteration {iter} after the update of iteration {applied}: \
                 its weights are gone"
            ));
        }
        let mut before = self.before.take().expect("checked");
        self.swap_all(&mut before)?;
        let r = self.compute(w, port);
        self.swap_all(&mut before)?;
        self.before = Some(before);
        r
    }

    fn swap_all(&mut self, other: &mut [Vec<f32>]) -> Result<(), String> {
        for (p, o) in self.pieces.iter_mut().zip(other) {
            p.swap_params(o).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn compute(&mut self, w: &Work, port: &WorkPort) -> Result<Output, String> {
        let (b, t) = (self.run.opts.batch, self.run.opts.seq);
        let mb = w.mb.ok_or("compute work without a microbatch")?;
        let input = w.input.as_ref().map(f32s_of);
        let err = |e: ModelError| e.to_string();
        match w.kind {
            WorkKind::Embed => {
                let (x, y) = microbatch(&self.docs, self.run.seed, mb, b, t);
                self.targets.insert(mb, y);
                let id = self.fresh_id(0, mb);
                let out = self.pieces[0]
                    .forward(id, b, t, StageInput::Tokens(&x), None)
                    .map_err(err)?;
                tensor_out(port, out)
            }
            WorkKind::Forward => {
                let h = input.ok_or("forward without its input")?;
                let id = self.fresh_id(0, mb);
                let out = self.pieces[0]
                    .forward(id, b, t, StageInput::Hidden(&h), None)
                    .map_err(err)?;
                tensor_out(port, out)
            }
            WorkKind::Loss => {
                let h = input.ok_or("loss without its input")?;
                let y = self
                    .targets
                    .get(&mb)
                    .ok_or("loss of a microbatch this holder did not embed")?
                    .clone();
                let id = ((mb.iter as u64) << 32 | mb.idx as u64) | 1 << 63;
                self.pieces[1].discard(id);
                let out = self.pieces[1]
                    .forward(id, b, t, StageInput::Hidden(&h), Some(&y))
                    .map_err(err)?;
                let StageOutput::Loss(loss) = out else {
                    return Err("the head gave no loss".into());
                };
                let g = self.pieces[1].backward(id, None).map_err(err)?;
                self.keep_grad(mb, 1)?;
                let g = g.ok_or("the head gave no input gradient")?;
                Ok(Output::Loss {
                    loss,
                    grad: frame_of(port, &g)?,
                })
            }
            WorkKind::Backward | WorkKind::EmbedBackward => {
                let g = input.ok_or("backward without its gradient")?;
                let id = *self
                    .ids
                    .get(&mb)
                    .ok_or("backward of a microbatch whose forward is not kept")?;
                let dx = self.pieces[0].backward(id, Some(&g)).map_err(err)?;
                self.ids.remove(&mb);
                self.keep_grad(mb, 0)?;
                match dx {
                    Some(dx) => Ok(Output::Tensor(frame_of(port, &dx)?)),
                    None => Ok(Output::None),
                }
            }
            _ => Err("not a compute work".into()),
        }
    }

    /// The sum of exactly the granted microbatches' gradients, in order.
    fn gradient(&self, granted: &[MbId]) -> Result<Vec<f32>, String> {
        let sizes: Vec<usize> = self.pieces.iter().map(|p| p.num_params()).collect();
        let mut sum = vec![0.0f32; sizes.iter().sum()];
        let mut sorted = granted.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        for mb in sorted {
            let g = self
                .grads
                .get(&mb)
                .ok_or_else(|| format!("no gradient kept for granted {mb:?}"))?;
            let mut off = 0;
            for (piece, n) in sizes.iter().enumerate() {
                let gp = g[piece]
                    .as_ref()
                    .ok_or_else(|| format!("granted {mb:?} misses piece {piece}'s gradient"))?;
                for (s, x) in sum[off..off + n].iter_mut().zip(gp) {
                    *s += x;
                }
                off += n;
            }
        }
        Ok(sum)
    }

    /// The stage's weights start afresh, standing for those after the
    /// update of `applied`: a microbatch of that iteration runs on them too
    /// (what that iteration saw is gone with the stage's last node).
    fn init_state(&mut self, stage: u16, applied: Option<u32>) -> Result<(), String> {
        self.pieces = self.build_pieces(stage)?;
        self.stage = Some(stage);
        self.ids.clear();
        self.grads.clear();
        self.targets.clear();
        self.applied = applied;
        self.before = match applied {
            Some(_) => Some(self.all_params()?),
            None => None,
        };
        Ok(())
    }

    /// Every piece's parameters, on the host.
    fn all_params(&self) -> Result<Vec<Vec<f32>>, String> {
        (self.pieces.iter())
            .map(|p| p.params().map_err(|e| e.to_string()))
            .collect()
    }

    /// CheckFree: serves `stage` with the average of the neighbours'
    /// `states` (stage, state) whose shapes fit it, or with the initial
    /// weights when none does. Returns how many were averaged.
    pub fn average_states(
        &mut self,
        stage: u16,
        states: &[(u16, Vec<u8>)],
        applied: Option<u32>,
    ) -> Result<u32, String> {
        self.init_state(stage, applied)?;
        let mut fit: Vec<StateParts> = Vec::new();
        for (from, state) in states {
            let from = *from;
            let (parts, _) = stage_parts(&self.run, from, state)
                .map_err(|e| format!("the state of stage {from}: {e}"))?;
            // Only a relay stage's single piece of the same size (as many
            // blocks) fits.
            if let ([p], [own]) = (&parts[..], &self.pieces[..]) {
                if p.params.len() == 4 * own.num_params() {
                    fit.push(*p);
                }
            }
        }
        let Some(step) = fit.iter().map(|p| p.step).max() else {
            return Ok(0);
        };
        let mean = |which: usize| -> Vec<f32> {
            let k = fit.len() as f32;
            let mut acc = vec![0f32; fit[0].params.len() / 4];
            for p in &fit {
                let part = [p.params, p.m, p.v][which];
                for (a, b) in acc.iter_mut().zip(part.chunks_exact(4)) {
                    *a += f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
            }
            acc.iter_mut().for_each(|a| *a /= k);
            acc
        };
        let st = StageState {
            index: self.pieces[0].spec().index,
            step,
            params: mean(0),
            m: mean(1),
            v: mean(2),
        };
        self.pieces[0].set_state(&st).map_err(|e| e.to_string())?;
        self.before = applied.map(|_| vec![st.params]);
        Ok(fit.len() as u32)
    }

    fn apply(&mut self, iteration: u32, mean: &[f32]) -> Result<(), String> {
        let total: usize = self.pieces.iter().map(|p| p.num_params()).sum();
        if mean.len() != total {
            return Err(format!("a mean of {} for {total} parameters", mean.len()));
        }
        let opt = adamw(&self.run.opts, iteration);
        self.before = Some(self.all_params()?);
        self.applied = Some(iteration);
        let mut off = 0;
        for p in &mut self.pieces {
            let n = p.num_params();
            p.set_mean_grads(&mean[off..off + n])
                .map_err(|e| e.to_string())?;
            p.step(&opt).map_err(|e| e.to_string())?;
            off += n;
        }
        self.grads.retain(|mb, _| mb.iter > iteration);
        Ok(())
    }

    /// The state written straight into a frame of the pool. Before, it
    /// was built in a growing vector and copied over: for an 85 MB state
    /// several fresh allocations, whose pages the kernel zeroed on the
    /// trainer's time (the largest part of what the holders' copies cost
    /// a llama-small swarm on 2 cores).
    fn export(&self, port: &WorkPort) -> Result<Frame, String> {
        let mut f = port.alloc(self.export_len()).map_err(|e| e.to_string())?;
        self.export_into(f.payload_mut())?;
        Ok(f)
    }

    /// The state in the format the type's doc describes.
    pub fn export_bytes(&self) -> Result<Vec<u8>, String> {
        let mut b = vec![0; self.export_len()];
        self.export_into(&mut b)?;
        Ok(b)
    }

    /// The exported state's bytes: per piece its length and its state,
    /// then (after an update) the parameters from before it.
    fn export_len(&self) -> usize {
        let pieces: usize = (self.pieces.iter())
            .map(|p| 8 + 28 + 12 * p.num_params())
            .sum();
        pieces + self.before_len().map_or(0, |n| 8 + n)
    }

    /// Bytes of the parameters from before the last update, when kept.
    fn before_len(&self) -> Option<usize> {
        let (Some(_), Some(before)) = (self.applied, &self.before) else {
            return None;
        };
        Some(before.iter().map(|p| 4 * p.len()).sum())
    }

    /// Writes the exported state into `out` (exactly
    /// [`ModelTrainer::export_len`] bytes).
    fn export_into(&self, out: &mut [u8]) -> Result<(), String> {
        let mut off = 0;
        let mut put = |b: &[u8]| {
            out[off..off + b.len()].copy_from_slice(b);
            off += b.len();
        };
        for p in &self.pieces {
            put(&((28 + 12 * p.num_params()) as u64).to_le_bytes());
            p.state_bytes_into(&mut put).map_err(|e| e.to_string())?;
        }
        if let (Some(n), Some(before)) = (self.before_len(), &self.before) {
            put(&(n as u64).to_le_bytes());
            for p in before {
                f32s_bytes_into(p, &mut put);
            }
        }
        Ok(())
    }

    /// Replaces the state with `b` (as [`ModelTrainer::export_bytes`]
    /// wrote it) standing for the weights after the update of `applied`;
    /// checked whole before anything changes.
    pub fn import_bytes(&mut self, b: &[u8], applied: Option<u32>) -> Result<(), String> {
        self.import_whole(b, applied)?;
        self.ids.clear();
        self.grads.clear();
        Ok(())
    }

    /// Replaces the weights only, with the leading bytes of a state
    /// ([`weights_prefix`] long) standing for the update of `applied`: a
    /// relay's one piece, checked before anything changes. Microbatches
    /// run on them at once; the rest of the state comes as
    /// [`ModelTrainer::import_rest`] before any update or export.
    pub fn import_weights(&mut self, b: &[u8], applied: Option<u32>) -> Result<(), String> {
        let [piece] = &mut self.pieces[..] else {
            return Err(format!(
                "weights first for a node of {} model stages (only a relay's one)",
                self.pieces.len()
            ));
        };
        let n = piece.num_params();
        let want = WEIGHTS_AT + 4 * n;
        if b.len() != want || weights_prefix(b, b.len() + 8 * n) != Some(want) {
            return Err(format!(
                "the weights of a state: {} bytes, {want} expected with the state's header",
                b.len()
            ));
        }
        let index = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")) as usize;
        if index != piece.spec().index {
            return Err(format!(
                "the weights of model stage {index}, this node serves {}",
                piece.spec().index
            ));
        }
        let mut params = bytes_to_f32s(&b[WEIGHTS_AT..]).map_err(|e| e.to_string())?;
        piece.swap_params(&mut params).map_err(|e| e.to_string())?;
        self.ids.clear();
        self.grads.clear();
        self.applied = applied;
        self.before = None;
        Ok(())
    }

    /// The whole state whose weights [`ModelTrainer::import_weights`] took:
    /// its optimizer moments, step count and the weights from before the
    /// last update, keeping the activations and gradients of the
    /// microbatches run since. Its weights must be those imported.
    pub fn import_rest(&mut self, b: &[u8], applied: Option<u32>) -> Result<(), String> {
        let (parts, before) = split_state(b, self.pieces.len())?;
        let [piece] = &mut self.pieces[..] else {
            return Err("the rest of a state for a node of more than one model stage".into());
        };
        let [part] = &parts[..] else {
            return Err(format!("the rest of a state of {} pieces", parts.len()));
        };
        let st = StateParts::parse(part, piece.spec().index, piece.num_params())
            .map_err(|e| e.to_string())?;
        let mut held = piece.state().map_err(|e| e.to_string())?;
        let same = (held.params.iter())
            .zip(st.params.chunks_exact(4))
            .all(|(a, b)| a.to_le_bytes() == b);
        if !same {
            return Err("the rest of a state whose weights are not those imported first".into());
        }
        let before = match before {
            Some(raw) if raw.len() == st.params.len() && applied.is_some() => {
                Some(vec![bytes_to_f32s(raw).map_err(|e| e.to_string())?])
            }
            Some(raw) => {
                return Err(format!(
                    "{} bytes of parameters from before the last update, {} expected",
                    raw.len(),
                    st.params.len()
                ))
            }
            None => None,
        };
        held.m = bytes_to_f32s(st.m).map_err(|e| e.to_string())?;
        held.v = bytes_to_f32s(st.v).map_err(|e| e.to_string())?;
        piece
            .set_moments(st.step, &held.m, &held.v)
            .map_err(|e| e.to_string())?;
        self.applied = applied;
        self.before = before;
        Ok(())
    }

    /// [`ModelTrainer::import_bytes`] without dropping the microbatches'
    /// activations and gradients.
    fn import_whole(&mut self, b: &[u8], applied: Option<u32>) -> Result<(), String> {
        let (parts, before) = split_state(b, self.pieces.len())?;
        let before = match before {
            None => None,
            Some(raw) => {
                let want: usize = self.pieces.iter().map(|p| 4 * p.num_params()).sum();
                if raw.len() != want {
                    return Err(format!(
                        "{} bytes of parameters from before the last update, {want} expected",
                        raw.len()
                    ));
                }
                if applied.is_none() {
                    return Err("parameters from before an update, but no update applied".into());
                }
                let mut at = raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")));
                let split: Vec<Vec<f32>> = self
                    .pieces
                    .iter()
                    .map(|p| at.by_ref().take(p.num_params()).collect())
                    .collect();
                Some(split)
            }
        };
        let backup = (self.pieces.iter())
            .map(|p| p.state())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        for (i, part) in parts.iter().enumerate() {
            if let Err(e) = self.pieces[i].import_state(part) {
                for (p, st) in self.pieces.iter_mut().zip(&backup) {
                    let _ = p.set_state(st);
                }
                return Err(e.to_string());
            }
        }
        self.applied = applied;
        self.before = before;
        Ok(())
    }
}

/// Where a relay's weights start in its exported state: the piece's
/// length (8 bytes), then its header (magic, index, step, count: 28).
const WEIGHTS_AT: usize = 8 + 28;

/// How many leading bytes of a state `total` bytes long hold its weights,
/// read from its first bytes `head` (at least 36 of them): a relay's state
/// (one model stage) lays its parameters out right after its header, before
/// the optimizer moments and the weights from before the last update, so
/// a joiner can compute on them while the rest comes. None for a state of
/// several model stages (a holder's) or one that does not read as ours:
/// it is imported whole. What [`crate::swarm::RuntimeOptions::weights_first`]
/// takes for the built-in trainer.
pub fn weights_prefix(head: &[u8], total: usize) -> Option<usize> {
    let u64_at = |at: usize| -> Option<u64> {
        Some(u64::from_le_bytes(head.get(at..at + 8)?.try_into().ok()?))
    };
    let len = u64_at(0)?;
    if head.get(8..16)? != b"GWTFSTG1" {
        return None;
    }
    let n = u64_at(28)?;
    let weights = n.checked_mul(4)?;
    if len != weights.checked_mul(3)?.checked_add(28)? {
        return None;
    }
    let one = len.checked_add(8)?;
    let with_before = one.checked_add(8)?.checked_add(weights)?;
    let total = total as u64;
    (total == one || total == with_before)
        .then(|| usize::try_from(WEIGHTS_AT as u64 + weights).ok())
        .flatten()
}

impl Trainer for ModelTrainer {
    fn run(&mut self, w: Work, port: &WorkPort) -> Result<Output, String> {
        self.serve(w.stage)?;
        match &w.kind {
            k if k.is_microbatch_compute() => self.compute_at_its_weights(&w, port),
            WorkKind::Gradient { granted, .. } => Ok(Output::Gradient {
                sum: self.gradient(granted)?,
                weights: self.digest()?,
            }),
            WorkKind::Apply {
                iteration, mean, ..
            } => {
                self.apply(*iteration, mean)?;
                Ok(Output::Weights(self.digest()?))
            }
            WorkKind::ExportState => Ok(Output::State(self.export(port)?)),
            WorkKind::ImportState { applied } => {
                let f = w.input.as_ref().ok_or("import without a state")?;
                self.import_bytes(f.payload(), *applied)?;
                Ok(Output::Weights(self.digest()?))
            }
            WorkKind::ImportWeights { applied } => {
                let f = w.input.as_ref().ok_or("import without weights")?;
                self.import_weights(f.payload(), *applied)?;
                Ok(Output::None)
            }
            WorkKind::ImportRest { applied } => {
                let f = w.input.as_ref().ok_or("import without a state")?;
                self.import_rest(f.payload(), *applied)?;
                Ok(Output::Weights(self.digest()?))
            }
            WorkKind::InitState { applied } => {
                self.init_state(w.stage, *applied)?;
                Ok(Output::Weights(self.digest()?))
            }
            WorkKind::AverageStates { applied, states } => {
                let averaged = self.average_states(w.stage, states, *applied)?;
                Ok(Output::Rebuilt {
                    weights: self.digest()?,
                    averaged,
                })
            }
            // A forward's activations dropped: it runs again before the
            // backward (the protocol's recompute).
            WorkKind::Discard => {
                let mb = w.mb.ok_or("discard without a microbatch")?;
                if let Some(id) = self.ids.remove(&mb) {
                    for p in &mut self.pieces {
                        p.discard(id);
                    }
                }
                Ok(Output::None)
            }
            WorkKind::Forget { before } => {
                let before = *before;
                let old: Vec<MbId> = self
                    .ids
                    .keys()
                    .copied()
                    .filter(|mb| mb.iter < before)
                    .collect();
                for mb in old {
                    if let Some(id) = self.ids.remove(&mb) {
                        for p in &mut self.pieces {
                            p.discard(id);
                        }
                    }
                }
                self.targets.retain(|mb, _| mb.iter >= before);
                self.grads.retain(|mb, _| mb.iter >= before);
                Ok(Output::None)
            }
            _ => Err(format!("unexpected work {}", w.kind.name())),
        }
    }
}

/// The model stages' states in `state` (protocol stage `stage`'s, as
/// [`ModelTrainer::export_bytes`] wrote it), borrowed and checked against
/// the plan, and its weights digest, the one the stage's replicas print:
/// what a checkpoint of the swarm stores. Nothing is decoded or copied.
pub fn stage_parts<'a>(
    run: &ModelRun,
    stage: u16,
    state: &'a [u8],
) -> Result<(Vec<StateParts<'a>>, [u8; 32]), String> {
    let (plan, idx) = run.piece_plan(stage).map_err(|e| e.to_string())?;
    let (sections, _) = split_state(state, idx.len())?;
    let mut h = Sha256::new();
    let mut parts = Vec::new();
    for (&i, b) in idx.iter().zip(&sections) {
        let spec = plan.stages.get(i).ok_or("a model stage out of the plan")?;
        let n: usize = checkpoint::stage_tensors(&run.cfg, spec)
            .iter()
            .map(|t| t.spec.len)
            .sum();
        parts.push(StateParts::parse(b, i, n).map_err(|e| e.to_string())?);
        // As `ModelTrainer::digest`: over each piece's exported state.
        h.update(b);
    }
    Ok((parts, h.finalize().into()))
}

/// A state's pieces' states and the parameters from before the last
/// update (when there are).
type StateSections<'a> = (Vec<&'a [u8]>, Option<&'a [u8]>);

/// Splits a state as [`ModelTrainer::export_bytes`] wrote it into its
/// `pieces` pieces' states and the parameters from before the last update
/// (when there are); nothing may follow.
fn split_state(mut b: &[u8], pieces: usize) -> Result<StateSections<'_>, String> {
    fn section<'a>(b: &mut &'a [u8], what: &str) -> Result<&'a [u8], String> {
        if b.len() < 8 {
            return Err(format!("state cut short in {what}"));
        }
        let n = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let rest = &b[8..];
        if (rest.len() as u64) < n {
            return Err(format!(
                "state cut short: {what} of {n} bytes, {} left",
                rest.len()
            ));
        }
        let (part, tail) = rest.split_at(n as usize);
        *b = tail;
        Ok(part)
    }
    let mut parts = Vec::with_capacity(pieces);
    for i in 0..pieces {
        parts.push(section(&mut b, &format!("piece {i}"))?);
    }
    let before = if b.is_empty() {
        None
    } else {
        Some(section(
            &mut b,
            "the parameters from before the last update",
        )?)
    };
    if !b.is_empty() {
        return Err(format!("{} bytes after the state", b.len()));
    }
    Ok((parts, before))
}

/// A frame's f32 values, without a copy when the payload is aligned.
fn f32s_of(f: &Frame) -> Cow<'_, [f32]> {
    let p = f.payload();
    // SAFETY: any bit pattern is a valid f32; align_to only splits.
    let (pre, mid, post) = unsafe { p.align_to::<f32>() };
    if cfg!(target_endian = "little") && pre.is_empty() && post.is_empty() {
        Cow::Borrowed(mid)
    } else {
        Cow::Owned(
            p.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect(),
        )
    }
}

fn frame_of(port: &WorkPort, v: &[f32]) -> Result<Frame, String> {
    let mut f = port.alloc(4 * v.len()).map_err(|e| e.to_string())?;
    for (dst, x) in f.payload_mut().chunks_exact_mut(4).zip(v) {
        dst.copy_from_slice(&x.to_le_bytes());
    }
    Ok(f)
}

fn tensor_out(port: &WorkPort, out: StageOutput) -> Result<Output, String> {
    match out {
        StageOutput::Hidden(h) => Ok(Output::Tensor(frame_of(port, &h)?)),
        StageOutput::Loss(_) => Err("a middle stage gave a loss".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::preset;

    fn relay() -> ModelTrainer {
        let run = ModelRun::new(preset("llama-tiny").unwrap(), 4, 7, 6).unwrap();
        ModelTrainer::new(run, 1, Vec::new()).unwrap()
    }

    fn joiner_of(stage: u16) -> ModelTrainer {
        let mut j = ModelTrainer::joiner(relay().run);
        j.serve(stage).unwrap();
        j
    }

    fn updated() -> ModelTrainer {
        updated_by(1.0)
    }

    fn updated_by(scale: f32) -> ModelTrainer {
        let mut t = relay();
        let n: usize = t.pieces.iter().map(|p| p.num_params()).sum();
        let mean: Vec<f32> = (0..n)
            .map(|i| ((i % 7) as f32 - 3.0) * 1e-3 * scale)
            .collect();
        t.apply(4, &mean).unwrap();
        t
    }

    /// The weights digest is the SHA-256 of every piece's exported state
    /// (what the checkpoint manifest and a joiner's check recompute from
    /// the bytes), though it is hashed without an export.
    #[test]
    fn the_digest_is_the_sha256_of_the_exported_state() {
        let t = updated();
        let mut h = Sha256::new();
        for p in &t.pieces {
            // The state format, written out by hand.
            let st = p.state().unwrap();
            let mut b = b"GWTFSTG1".to_vec();
            b.extend_from_slice(&(st.index as u32).to_le_bytes());
            b.extend_from_slice(&st.step.to_le_bytes());
            b.extend_from_slice(&(st.params.len() as u64).to_le_bytes());
            for x in st.params.iter().chain(&st.m).chain(&st.v) {
                b.extend_from_slice(&x.to_le_bytes());
            }
            let mut exported = Vec::new();
            p.state_bytes_into(&mut |x| exported.extend_from_slice(x))
                .unwrap();
            assert_eq!(exported, b);
            h.update(&b);
        }
        let want: [u8; 32] = h.finalize().into();
        assert_eq!(t.digest().unwrap(), want);
    }

    /// A joiner can run a microbatch of the iteration the stage applied
    /// last on the weights that iteration saw, though it never held them.
    #[test]
    fn a_joiner_gets_the_weights_from_before_the_last_update() {
        let t = updated();
        let bytes = t.export_bytes().unwrap();
        assert_eq!(bytes.len() as u64, t.run.state_bytes(1).unwrap());
        let mut j = joiner_of(1);
        j.import_bytes(&bytes, Some(4)).unwrap();
        assert_eq!(j.digest().unwrap(), t.digest().unwrap());
        assert_eq!(j.applied, Some(4));
        assert_eq!(j.before, t.before);
        assert_ne!(j.before.as_ref().unwrap()[0], j.pieces[0].params().unwrap());
    }

    /// The sizes come from the plan, and are those of the pieces built.
    #[test]
    fn the_sizes_from_the_plan_are_those_of_the_pieces() {
        let run = relay().run;
        for stage in 0..=2u16 {
            let pieces = run.pieces(stage).unwrap();
            let want: Vec<(usize, usize)> = (pieces.iter())
                .map(|p| (p.num_params(), p.spec().blocks.len()))
                .collect();
            assert_eq!(run.piece_sizes(stage).unwrap(), want);
            // Each piece's length and state, then the earlier weights'
            // length and values.
            let states: u64 = (pieces.iter())
                .map(|p| 8 + p.export_state().len() as u64 + 4 * p.num_params() as u64)
                .sum();
            assert_eq!(run.state_bytes(stage).unwrap(), states + 8);
        }
    }

    /// A state without them (an exporter that had none) is still a state:
    /// the joiner just has none either.
    #[test]
    fn a_state_without_the_earlier_weights_imports_without_them() {
        let fresh = relay();
        let bytes = fresh.export_bytes().unwrap();
        let params = fresh.pieces[0].num_params() as u64;
        assert_eq!(
            bytes.len() as u64 + 8 + 4 * params,
            fresh.run.state_bytes(1).unwrap()
        );
        let mut j = joiner_of(1);
        j.import_bytes(&bytes, None).unwrap();
        assert_eq!(
            (j.digest().unwrap(), j.applied, j.before.is_none()),
            (fresh.digest().unwrap(), None, true)
        );
    }

    /// A relay's weights lead its state: imported alone, the joiner's
    /// parameters are the exporter's (not yet its digest, which covers the
    /// moments); the rest then makes the state the exporter's, the weights
    /// from before the update included. A rest whose weights differ, or
    /// weights cut short, are refused; a holder's state (two model stages)
    /// does not split.
    #[test]
    fn a_relay_state_imports_its_weights_first_then_the_rest() {
        let t = updated();
        let bytes = t.export_bytes().unwrap();
        let n = t.pieces[0].num_params();
        let len = weights_prefix(&bytes[..64], bytes.len()).unwrap();
        assert_eq!(len, 8 + 28 + 4 * n);
        assert_eq!(weights_prefix(&bytes[..64], bytes.len() - 1), None);
        assert_eq!(weights_prefix(&bytes[..20], bytes.len()), None);
        let mut j = joiner_of(1);
        assert!(j.import_weights(&bytes[..len - 4], Some(4)).is_err());
        j.import_weights(&bytes[..len], Some(4)).unwrap();
        let params = |t: &ModelTrainer| t.pieces[0].params().unwrap();
        assert_eq!(params(&j), params(&t));
        assert_ne!(j.digest().unwrap(), t.digest().unwrap());
        assert_eq!((j.applied, j.before.is_none()), (Some(4), true));
        j.import_rest(&bytes, Some(4)).unwrap();
        assert_eq!(j.digest().unwrap(), t.digest().unwrap());
        assert_eq!(j.before, t.before);

        let other = updated_by(2.0).export_bytes().unwrap();
        let mut k = joiner_of(1);
        k.import_weights(&bytes[..len], Some(4)).unwrap();
        let e = k.import_rest(&other, Some(4)).unwrap_err();
        assert!(e.contains("not those imported first"), "{e}");

        // Two pieces' states one after the other, as a holder's.
        let piece = relay().export_bytes().unwrap();
        let two = [&piece[..], &piece[..]].concat();
        assert!(weights_prefix(&piece[..64], piece.len()).is_some());
        assert_eq!(weights_prefix(&two[..64], two.len()), None);
    }

    /// A cut, padded or inconsistent state is refused and changes nothing.
    #[test]
    fn a_bad_state_changes_nothing() {
        let t = updated();
        let good = t.export_bytes().unwrap();
        let mut j = joiner_of(1);
        let digest = j.digest().unwrap();
        let params = 4 * t.pieces[0].num_params();
        let cases: Vec<(Vec<u8>, Option<u32>, &str)> = vec![
            (good[..good.len() - 1].to_vec(), Some(4), "cut short"),
            ([&good[..], &[0u8]].concat(), Some(4), "bytes after"),
            (good.clone(), None, "no update applied"),
            (
                {
                    // The earlier weights one float short.
                    let mut b = good[..good.len() - params - 8].to_vec();
                    b.extend_from_slice(&((params - 4) as u64).to_le_bytes());
                    b.extend_from_slice(&good[good.len() - params + 4..]);
                    b
                },
                Some(4),
                "expected",
            ),
        ];
        for (bytes, applied, why) in cases {
            let e = j.import_bytes(&bytes, applied).unwrap_err();
            assert!(e.contains(why), "{why}: {e}");
            assert_eq!(
                (j.digest().unwrap(), j.applied, j.before.is_none()),
                (digest, None, true)
            );
        }
    }

    /// A stage started afresh runs a microbatch of the iteration it stands
    /// for on its fresh weights (there are no others).
    #[test]
    fn a_stage_started_afresh_runs_its_iteration_on_the_fresh_weights() {
        let mut t = updated();
        t.init_state(1, Some(9)).unwrap();
        assert_eq!(t.applied, Some(9));
        assert_eq!(
            t.before.as_ref().unwrap()[0],
            relay().pieces[0].params().unwrap()
        );
        t.init_state(1, None).unwrap();
        assert!(t.before.is_none());
    }

    /// CheckFree: a stage rebuilt from its neighbours' states is their
    /// element-wise mean (parameters and both moments, the larger step);
    /// a state whose shapes do not fit (the holders') is left out, and with
    /// none fitting the stage starts from the initial weights.
    #[test]
    fn a_stage_is_rebuilt_as_the_mean_of_the_neighbours_that_fit() {
        let a = updated();
        let mut b = joiner_of(2);
        let n = b.pieces[0].num_params();
        let mean: Vec<f32> = (0..n).map(|i| ((i % 5) as f32 - 2.0) * 1e-3).collect();
        b.apply(4, &mean).unwrap();
        b.apply(5, &mean).unwrap();
        let run = a.run.clone();
        let docs =
            crate::model::dataset::Dataset::synthetic(1, run.opts.corpus_bytes, run.opts.seq);
        let holder = ModelTrainer::new(run.clone(), 0, docs.train).unwrap();
        let states = vec![
            (0u16, holder.export_bytes().unwrap()),
            (1u16, a.export_bytes().unwrap()),
            (2u16, b.export_bytes().unwrap()),
        ];
        let mut j = ModelTrainer::joiner(run.clone());
        assert_eq!(j.average_states(1, &states, Some(5)).unwrap(), 2);
        let (pa, pb) = (a.pieces[0].state().unwrap(), b.pieces[0].state().unwrap());
        let got = j.pieces[0].state().unwrap();
        assert_eq!(got.index, 1);
        assert_eq!(got.step, pa.step.max(pb.step));
        for (x, (y, z)) in [
            (&got.params, (&pa.params, &pb.params)),
            (&got.m, (&pa.m, &pb.m)),
            (&got.v, (&pa.v, &pb.v)),
        ] {
            assert_eq!(x.len(), y.len());
            for i in 0..x.len() {
                assert_eq!(x[i], (y[i] + z[i]) / 2.0, "element {i}");
            }
        }
        assert_eq!(
            (j.applied, j.before.as_ref().map(|b| b[0].clone())),
            (Some(5), Some(got.params))
        );
        // Only the holders' state: nothing fits, the initial weights.
        let mut k = ModelTrainer::joiner(run);
        assert_eq!(k.average_states(1, &states[..1], None).unwrap(), 0);
        assert_eq!(k.digest().unwrap(), relay().digest().unwrap());
        // A state cut short is an error, not a guess.
        let cut = vec![(2u16, b.export_bytes().unwrap()[..100].to_vec())];
        assert!(k.average_states(1, &cut, None).is_err());
    }
}
