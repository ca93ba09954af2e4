//! The trainer's side of a node: the work the runtime asks of it, pulled in
//! order, and what the trainer hands back.
//!
//! One runtime, any trainer: the built-in model trainer and a C or Go
//! trainer behind the C API pull the same [`Work`] through the same
//! [`WorkPort`]. Inputs are frame leases straight from the socket (no
//! copy); outputs are frames the trainer allocates from the node's pool
//! ([`WorkPort::alloc`]) and fills in place.
//!
//! Order: works come out in the order the protocol asked for them. A
//! *barrier* work (summing the gradients, applying the update, exporting or
//! importing the state) is handed out only when no other work is
//! outstanding, and nothing is handed out while it is, so a trainer with
//! several threads still applies updates between the microbatches they
//! belong between. A trainer with one thread just runs works as they come.
use crate::engine::{EngineError, Frame, Transport};
use crate::protocol::{MbId, Msg, Stage};
use crossbeam_channel::{bounded, Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Identifies one work until it is completed.
pub type WorkId = u64;

/// What the trainer must do.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkKind {
    /// Data holder: embed microbatch `mb` (the trainer picks its tokens from
    /// its data: the microbatch is named by holder, iteration and index).
    /// Output: [`Output::Tensor`], the activation for stage 1.
    Embed,
    /// Relay: the stage's forward on `input`. Output: the activation.
    Forward,
    /// Data holder: head forward, loss and head backward on `input` (the
    /// last stage's activation). Output: [`Output::Loss`].
    Loss,
    /// Relay: the stage's backward with `input`, the gradient of its output.
    /// Output: the gradient of its input.
    Backward,
    /// Data holder: the embedding's backward with `input`. Output: none.
    EmbedBackward,
    /// Barrier. The sum of the parameter gradients of exactly the
    /// microbatches `granted` (each once, whatever was computed twice).
    /// Output: [`Output::Gradient`].
    Gradient { iteration: u32, granted: Vec<MbId> },
    /// Barrier. Apply `mean` (the stage's all-reduced, microbatch-weighted
    /// mean gradient of iteration `iteration`) with the optimizer.
    /// Output: [`Output::Weights`].
    Apply {
        iteration: u32,
        mean: Arc<Vec<f32>>,
        microbatches: u64,
    },
    /// Barrier. The stage's state (parameters, optimizer) as bytes, for a
    /// joiner. Output: [`Output::State`].
    ExportState,
    /// Barrier. Replace the stage's state with `input` (as exported by a
    /// member): the weights after the update of iteration `applied` (None:
    /// before any update). Output: [`Output::Weights`].
    ImportState { applied: Option<u32> },
    /// Barrier. Only for a trainer that declared its state's weights come
    /// first ([`crate::swarm::RuntimeOptions::weights_first`]): `input` is
    /// the leading bytes of a state that hold the weights, all a
    /// microbatch's compute needs. Replace the weights with them, standing
    /// for the update of `applied`; the rest (optimizer moments) follows as
    /// [`WorkKind::ImportRest`] before any update, export or microbatch of
    /// an iteration up to `applied`. Output: none.
    ImportWeights { applied: Option<u32> },
    /// Barrier. The whole state whose weights [`WorkKind::ImportWeights`]
    /// imported: take the rest of it (optimizer moments, the weights from
    /// before the last update), keeping what microbatches computed since.
    /// Output: [`Output::Weights`].
    ImportRest { applied: Option<u32> },
    /// Barrier. No live node holds the stage's state (its last node died):
    /// start it afresh from the model's initial weights, standing for the
    /// weights after the update of iteration `applied` (None: before any).
    /// Output: [`Output::Weights`].
    InitState { applied: Option<u32> },
    /// Barrier. No live node holds the stage's state and no copy of it was
    /// kept: rebuild it from `states`, its neighbouring stages' members'
    /// (stage, state as that stage's `ExportState` gave it), CheckFree's
    /// way: the average of those whose shapes fit this stage's (parameters
    /// and optimizer moments; the largest step count), or, when none fits,
    /// the initial weights as `InitState`; standing for the weights after
    /// the update of iteration `applied`. Given only where
    /// `Config::rebuild_from_neighbours` is on. Output: [`Output::Rebuilt`].
    AverageStates {
        applied: Option<u32>,
        states: Arc<Vec<(Stage, Vec<u8>)>>,
    },
    /// Forget what is kept for microbatches of iterations before `before`
    /// (activations whose backward never came, per-microbatch gradients).
    /// Output: none.
    Forget { before: u32 },
    /// Relay: drop what the forward of microbatch `mb` kept for its
    /// backward (its memory was full: before the backward the forward runs
    /// again from the input). Given only with the protocol's `recompute`
    /// on. Output: none.
    Discard,
}

impl WorkKind {
    /// Runs alone, between the works before and after it.
    pub fn is_barrier(&self) -> bool {
        matches!(
            self,
            WorkKind::Gradient { .. }
                | WorkKind::Apply { .. }
                | WorkKind::ExportState
                | WorkKind::ImportState { .. }
                | WorkKind::ImportWeights { .. }
                | WorkKind::ImportRest { .. }
                | WorkKind::InitState { .. }
                | WorkKind::AverageStates { .. }
        )
    }

    pub fn name(&self) -> &'static str {
        match self {
            WorkKind::Embed => "embed",
            WorkKind::Forward => "forward",
            WorkKind::Loss => "loss",
            WorkKind::Backward => "backward",
            WorkKind::EmbedBackward => "embed_backward",
            WorkKind::Gradient { .. } => "gradient",
            WorkKind::Apply { .. } => "apply",
            WorkKind::ExportState => "export_state",
            WorkKind::ImportState { .. } => "import_state",
            WorkKind::ImportWeights { .. } => "import_weights",
            WorkKind::ImportRest { .. } => "import_rest",
            WorkKind::InitState { .. } => "init_state",
            WorkKind::AverageStates { .. } => "average_states",
            WorkKind::Forget { .. } => "forget",
            WorkKind::Discard => "discard",
        }
    }

    /// Compute on a microbatch (what the wasted-compute figures count).
    pub fn is_microbatch_compute(&self) -> bool {
        matches!(
            self,
            WorkKind::Embed
                | WorkKind::Forward
                | WorkKind::Loss
                | WorkKind::Backward
                | WorkKind::EmbedBackward
        )
    }
}

/// One piece of work.
#[derive(Debug)]
pub struct Work {
    pub id: WorkId,
    pub kind: WorkKind,
    /// The node's stage (0: data holder).
    pub stage: Stage,
    /// The microbatch of a compute work.
    pub mb: Option<MbId>,
    /// The input tensor (or state), a lease on the frame it arrived in.
    pub input: Option<Frame>,
}

/// What the trainer hands back.
#[derive(Debug)]
pub enum Output {
    None,
    /// An activation or a gradient, `activation_bytes` long.
    Tensor(Frame),
    /// The microbatch's mean loss and the gradient for the last stage.
    Loss {
        loss: f32,
        grad: Frame,
    },
    /// The summed gradient and the digest of the weights it was computed on.
    Gradient {
        sum: Vec<f32>,
        weights: [u8; 32],
    },
    /// The digest of the weights after an apply or an import.
    Weights([u8; 32]),
    /// The exported state.
    State(Frame),
    /// The digest of the weights rebuilt by `AverageStates`, and how many
    /// neighbours' states they average (0: none fitted; the initial
    /// weights).
    Rebuilt {
        weights: [u8; 32],
        averaged: u32,
    },
}

/// Why a completion was refused (nothing changed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompleteError {
    /// No such work is outstanding (never given, or completed already).
    UnknownWork(WorkId),
    /// The output does not fit the work (kind or size).
    BadOutput { work: WorkId, reason: String },
    /// The node has stopped.
    Stopped,
}

impl std::fmt::Display for CompleteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompleteError::UnknownWork(id) => {
                write!(f, "work {id} is not outstanding (never given or done)")
            }
            CompleteError::BadOutput { work, reason } => write!(f, "work {work}: {reason}"),
            CompleteError::Stopped => write!(f, "the node has stopped"),
        }
    }
}

impl std::error::Error for CompleteError {}

/// What a trainer returned for one work, for the driver.
pub struct Completion {
    pub id: WorkId,
    pub kind: WorkKind,
    pub mb: Option<MbId>,
    pub result: Result<Output, String>,
    /// Time the trainer spent on it.
    pub took: Duration,
}

/// Bytes of the tensors at each stage boundary. Boundary `b` is the output
/// of stage `b` (0: a data holder's embedding) going to stage `b + 1`; the
/// last one, `relay_stages`, is the last relay's output going to the data
/// holder's loss. The gradient at a boundary flows the other way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSizes {
    /// Activation bytes per boundary (`relay_stages + 1` entries).
    pub activation: Vec<usize>,
    /// Gradient bytes per boundary (same length).
    pub gradient: Vec<usize>,
}

impl TensorSizes {
    /// The same size at every boundary, both ways.
    pub fn uniform(relay_stages: Stage, bytes: usize) -> TensorSizes {
        let n = relay_stages as usize + 1;
        TensorSizes {
            activation: vec![bytes; n],
            gradient: vec![bytes; n],
        }
    }

    /// Checks the table: one entry per boundary, none empty.
    pub fn check(&self, relay_stages: Stage) -> Result<(), String> {
        let n = relay_stages as usize + 1;
        if self.activation.len() != n || self.gradient.len() != n {
            return Err(format!(
                "{} activation and {} gradient sizes for {n} boundaries ({relay_stages} relay stages)",
                self.activation.len(),
                self.gradient.len()
            ));
        }
        if let Some(b) = self
            .activation
            .iter()
            .chain(&self.gradient)
            .position(|&x| x == 0)
        {
            return Err(format!("boundary {}: a tensor of 0 bytes", b % n));
        }
        Ok(())
    }

    /// The last boundary (the last relay's output).
    fn last(&self) -> usize {
        self.activation.len().saturating_sub(1)
    }

    /// Bytes of the output of `kind` at `stage` (None: it has no tensor).
    pub fn output(&self, kind: &WorkKind, stage: Stage) -> Option<usize> {
        let s = stage as usize;
        match kind {
            WorkKind::Embed => self.activation.first().copied(),
            WorkKind::Forward => self.activation.get(s).copied(),
            WorkKind::Backward => self.gradient.get(s.checked_sub(1)?).copied(),
            WorkKind::Loss => self.gradient.get(self.last()).copied(),
            _ => None,
        }
    }

    /// Bytes of the input of `kind` at `stage` (None: it has no tensor).
    pub fn input(&self, kind: &WorkKind, stage: Stage) -> Option<usize> {
        let s = stage as usize;
        match kind {
            WorkKind::Forward => self.activation.get(s.checked_sub(1)?).copied(),
            WorkKind::Loss => self.activation.get(self.last()).copied(),
            WorkKind::Backward => self.gradient.get(s).copied(),
            WorkKind::EmbedBackward => self.gradient.first().copied(),
            _ => None,
        }
    }

    /// Bytes a node of `stage` expects in the data frame of `msg` (a
    /// forward or backward that arrived); `usize::MAX` when it expects none.
    pub fn incoming(&self, msg: &Msg, stage: Stage) -> usize {
        match msg {
            Msg::Forward { .. } => self.incoming_tensor(true, stage),
            Msg::Backward { .. } => self.incoming_tensor(false, stage),
            _ => usize::MAX,
        }
    }

    /// Bytes a node of `stage` expects with a forward (`forward`) or with
    /// a backward; `usize::MAX` when it expects none.
    pub fn incoming_tensor(&self, forward: bool, stage: Stage) -> usize {
        let kind = match (forward, stage) {
            (true, 0) => WorkKind::Loss,
            (true, _) => WorkKind::Forward,
            (false, 0) => WorkKind::EmbedBackward,
            (false, _) => WorkKind::Backward,
        };
        self.input(&kind, stage).unwrap_or(usize::MAX)
    }

    /// The largest tensor.
    pub fn max(&self) -> usize {
        self.activation
            .iter()
            .chain(&self.gradient)
            .copied()
            .max()
            .unwrap_or(0)
    }
}

#[derive(Default)]
struct QueueState {
    ready: VecDeque<Work>,
    /// Outstanding works: kind, stage, microbatch, when handed out.
    outstanding: HashMap<WorkId, (WorkKind, Stage, Option<MbId>, Instant)>,
    barrier_out: bool,
    stopped: bool,
    done: Vec<Completion>,
    /// Floats of a stage's gradient sum, once its members' all-reduce
    /// agreed on it.
    gradient_len: HashMap<Stage, usize>,
}

/// The queue between the driver and the trainer(s), and the trainer's
/// handle on its node. Cheap to clone.
#[derive(Clone)]
pub struct WorkPort {
    state: Arc<(Mutex<QueueState>, Condvar)>,
    /// Rings the driver when an answer comes (it waits on the network and
    /// on this at once); one pending ring is enough.
    wake: (Sender<()>, Receiver<()>),
    net: Arc<Transport>,
    /// Bytes of the tensors at each stage boundary.
    sizes: Arc<TensorSizes>,
}

impl WorkPort {
    pub(crate) fn new(net: Arc<Transport>, sizes: TensorSizes) -> WorkPort {
        WorkPort {
            state: Arc::new((Mutex::new(QueueState::default()), Condvar::new())),
            wake: bounded(1),
            net,
            sizes: Arc::new(sizes),
        }
    }

    /// Bytes of the activations (and gradients) this node exchanges: the
    /// largest at any boundary ([`WorkPort::sizes`] has each).
    pub fn activation_bytes(&self) -> usize {
        self.sizes.max()
    }

    /// Bytes of the tensors at each stage boundary.
    pub fn sizes(&self) -> &TensorSizes {
        &self.sizes
    }

    /// A frame of `len` bytes from the node's pool, for an output.
    pub fn alloc(&self, len: usize) -> Result<Frame, EngineError> {
        self.net.alloc(len, Duration::from_secs(30))
    }

    /// A frame of `len` bytes from the node's pool, waiting up to
    /// `timeout` when the pool is full.
    pub fn alloc_within(&self, len: usize, timeout: Duration) -> Result<Frame, EngineError> {
        self.net.alloc(len, timeout)
    }

    /// The next work, in order, waiting up to `timeout`. None: nothing yet,
    /// or the node stopped ([`WorkPort::is_stopped`]).
    pub fn next_work(&self, timeout: Duration) -> Option<Work> {
        let (lock, cv) = &*self.state;
        let deadline = Instant::now() + timeout;
        let mut q = lock.lock();
        loop {
            if q.stopped {
                return None;
            }
            let can = match q.ready.front() {
                None => false,
                Some(_) if q.barrier_out => false,
                Some(w) if w.kind.is_barrier() => q.outstanding.is_empty(),
                Some(_) => true,
            };
            if can {
                let w = q.ready.pop_front().expect("front exists");
                q.barrier_out = w.kind.is_barrier();
                q.outstanding
                    .insert(w.id, (w.kind.clone(), w.stage, w.mb, Instant::now()));
                return Some(w);
            }
            if cv.wait_until(&mut q, deadline).timed_out() {
                return None;
            }
        }
    }

    /// Hands back work `id`'s result (or why it failed). A second answer,
    /// an answer to a work never given, or an output that does not fit is
    /// refused with the reason and changes nothing (the work stays
    /// outstanding when the output did not fit, so a corrected answer can
    /// follow).
    pub fn complete(
        &self,
        id: WorkId,
        result: Result<Output, String>,
    ) -> Result<(), CompleteError> {
        self.try_complete(id, result).map_err(|(e, _)| e)
    }

    /// [`WorkPort::complete`], giving a refused result back to the caller
    /// (its frames are not lost).
    #[allow(clippy::result_large_err)]
    pub fn try_complete(
        &self,
        id: WorkId,
        result: Result<Output, String>,
    ) -> Result<(), (CompleteError, Result<Output, String>)> {
        let (lock, cv) = &*self.state;
        let mut q = lock.lock();
        if q.stopped {
            return Err((CompleteError::Stopped, result));
        }
        let Some((kind, stage, mb, since)) = q.outstanding.get(&id).cloned() else {
            return Err((CompleteError::UnknownWork(id), result));
        };
        if let Ok(out) = &result {
            let agreed = q.gradient_len.get(&stage).copied();
            if let Err(reason) = check_output(&kind, stage, out, &self.sizes, agreed) {
                return Err((CompleteError::BadOutput { work: id, reason }, result));
            }
        }
        q.outstanding.remove(&id);
        if kind.is_barrier() {
            q.barrier_out = false;
        }
        q.done.push(Completion {
            id,
            kind,
            mb,
            result,
            took: since.elapsed(),
        });
        cv.notify_all();
        drop(q);
        // Full: the driver has a ring pending already.
        let _ = self.wake.0.try_send(());
        Ok(())
    }

    /// Whether the node stopped (no more work will come).
    pub fn is_stopped(&self) -> bool {
        self.state.0.lock().stopped
    }

    // ---- the driver's side

    pub(crate) fn push(&self, w: Work) {
        let (lock, cv) = &*self.state;
        lock.lock().ready.push_back(w);
        cv.notify_all();
    }

    /// The members of `stage` all-reduced gradients of `len` floats.
    pub(crate) fn agree_gradient_len(&self, stage: Stage, len: usize) {
        self.state.0.lock().gradient_len.insert(stage, len);
    }

    /// What rings when an answer comes.
    pub(crate) fn answers(&self) -> &Receiver<()> {
        &self.wake.1
    }

    pub(crate) fn take_done(&self) -> Vec<Completion> {
        std::mem::take(&mut self.state.0.lock().done)
    }

    pub(crate) fn stop(&self) {
        let (lock, cv) = &*self.state;
        let mut q = lock.lock();
        q.stopped = true;
        q.ready.clear();
        cv.notify_all();
    }
}

/// Whether `out` is an answer to `kind` at `stage`.
fn check_output(
    kind: &WorkKind,
    stage: Stage,
    out: &Output,
    sizes: &TensorSizes,
    gradient_len: Option<usize>,
) -> Result<(), String> {
    let tensor = |f: &Frame, what: &str| match sizes.output(kind, stage) {
        Some(want) if f.len() == want => Ok(()),
        Some(want) => Err(format!(
            "{what} of {} bytes, expected {want} at stage {stage}",
            f.len()
        )),
        None => Err(format!(
            "{} at stage {stage} has no tensor output",
            kind.name()
        )),
    };
    match (kind, out) {
        (WorkKind::Embed | WorkKind::Forward, Output::Tensor(f)) => tensor(f, "activation"),
        (WorkKind::Backward, Output::Tensor(f)) => tensor(f, "gradient"),
        (WorkKind::Loss, Output::Loss { loss, grad }) => {
            if !loss.is_finite() {
                return Err(format!("loss {loss} is not finite"));
            }
            tensor(grad, "gradient")
        }
        (WorkKind::EmbedBackward | WorkKind::Forget { .. } | WorkKind::Discard, Output::None) => {
            Ok(())
        }
        (WorkKind::Gradient { .. }, Output::Gradient { sum, .. }) => {
            if let Some(n) = gradient_len.filter(|&n| n != sum.len()) {
                return Err(format!(
                    "a gradient of {} floats; the stage's all-reduce sums {n} (with no \
                     granted microbatch the sum is {n} zeros)",
                    sum.len()
                ));
            }
            match sum.iter().position(|x| !x.is_finite()) {
                Some(i) => Err(format!("gradient element {i} is not finite")),
                None => Ok(()),
            }
        }
        (
            WorkKind::Apply { .. }
            | WorkKind::ImportState { .. }
            | WorkKind::ImportRest { .. }
            | WorkKind::InitState { .. },
            Output::Weights(_),
        ) => Ok(()),
        (WorkKind::ImportWeights { .. }, Output::None) => Ok(()),
        (WorkKind::ExportState, Output::State(f)) if !f.is_empty() => Ok(()),
        (WorkKind::AverageStates { .. }, Output::Rebuilt { .. }) => Ok(()),
        (k, o) => Err(format!(
            "{} cannot be answered with {}",
            k.name(),
            output_name(o)
        )),
    }
}

fn output_name(o: &Output) -> &'static str {
    match o {
        Output::None => "nothing",
        Output::Tensor(_) => "a tensor",
        Output::Loss { .. } => "a loss",
        Output::Gradient { .. } => "a gradient",
        Output::Weights(_) => "a weights digest",
        Output::State(_) => "a state",
        Output::Rebuilt { .. } => "rebuilt weights",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two relay stages: boundaries of 10, 20 and 30 bytes; gradients of
    /// 11, 21 and 31.
    fn sizes() -> TensorSizes {
        TensorSizes {
            activation: vec![10, 20, 30],
            gradient: vec![11, 21, 31],
        }
    }

    #[test]
    fn each_work_has_the_size_of_its_boundary() {
        let s = sizes();
        assert_eq!(s.check(2), Ok(()));
        assert!(s.check(3).is_err());
        let zero = TensorSizes {
            activation: vec![10, 0, 30],
            gradient: vec![11, 21, 31],
        };
        assert!(zero.check(2).unwrap_err().contains("boundary 1"));
        // Holder: embeds into boundary 0, takes the last boundary's
        // activation for the loss and gives its gradient back.
        assert_eq!(s.output(&WorkKind::Embed, 0), Some(10));
        assert_eq!(s.input(&WorkKind::Loss, 0), Some(30));
        assert_eq!(s.output(&WorkKind::Loss, 0), Some(31));
        assert_eq!(s.input(&WorkKind::EmbedBackward, 0), Some(11));
        // Relay k: from boundary k-1 to boundary k, and back.
        assert_eq!(s.input(&WorkKind::Forward, 1), Some(10));
        assert_eq!(s.output(&WorkKind::Forward, 1), Some(20));
        assert_eq!(s.input(&WorkKind::Backward, 2), Some(31));
        assert_eq!(s.output(&WorkKind::Backward, 2), Some(21));
        // No tensor.
        assert_eq!(s.output(&WorkKind::EmbedBackward, 0), None);
        assert_eq!(s.output(&WorkKind::ExportState, 1), None);
        assert_eq!(s.incoming(&Msg::StateRequest, 1), usize::MAX);
        assert_eq!(s.max(), 31);
        assert_eq!(TensorSizes::uniform(2, 8).activation, vec![8; 3]);
    }

    /// A gradient answer is held to the length the stage's members agreed
    /// on in an all-reduce (any length before one succeeded), and to
    /// finite values.
    #[test]
    fn a_gradient_has_the_length_its_stage_agreed_on() {
        let kind = WorkKind::Gradient {
            iteration: 3,
            granted: Vec::new(),
        };
        let answer = |sum: Vec<f32>| Output::Gradient {
            sum,
            weights: [0; 32],
        };
        let s = sizes();
        assert_eq!(check_output(&kind, 1, &answer(vec![]), &s, None), Ok(()));
        assert_eq!(
            check_output(&kind, 1, &answer(vec![0.0; 4]), &s, Some(4)),
            Ok(())
        );
        let short = check_output(&kind, 1, &answer(vec![]), &s, Some(4)).unwrap_err();
        assert!(
            short.contains("a gradient of 0 floats; the stage's all-reduce sums 4"),
            "{short}"
        );
        let nan = check_output(&kind, 1, &answer(vec![0.0, f32::NAN]), &s, None).unwrap_err();
        assert!(nan.contains("element 1 is not finite"), "{nan}");
    }
}
