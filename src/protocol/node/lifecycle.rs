//! The microbatch lifecycle at one node: forward and backward hops in,
//! trainer tasks done, outputs sent on, with a snapshot of each microbatch
//! kept until its iteration is final.
use super::*;

/// The microbatches this node holds.
#[derive(Debug, Default)]
pub(super) struct Microbatches {
    pub(super) snaps: BTreeMap<MbId, Snap>,
    /// When the input of a hop arrived (for the busy time reported in acks).
    arrivals: BTreeMap<(MbId, bool), Time>,
    /// A snapshot was marked stuck since the tick last looked for them.
    maybe_stuck: bool,
    /// Forwards that arrived while this relay's memory was full: they
    /// start as backwards free it, those on a reserved flow first, each
    /// kind in arrival order.
    waiting: VecDeque<MbId>,
    /// How long a microbatch's activations stay here, forward start to
    /// backward done (an average): what a waiting forward is told.
    hold_s: Option<f64>,
    /// How long a microbatch's compute task waits for this node's GPU (an
    /// average, from the compute queued ahead of each): the queue its
    /// flows meet here, which the load model alone underestimates when
    /// the GPUs are busy.
    gpu_wait_s: Option<f64>,
    /// How busy this node's GPU is with microbatches' compute (a fraction,
    /// an average over windows of [`BUSY_WINDOW`]), and the compute done
    /// since `busy_from`, by this node's own estimate of its speed.
    gpu_busy: Option<f64>,
    busy_acc: f64,
    busy_from: Time,
}

/// The window over which a node samples how busy its GPU is.
impl Microbatches {
    /// How long a microbatch stays at this node (EMA, seconds).
    pub(super) fn hold_s(&self) -> Option<f64> {
        self.hold_s
    }
    /// How long a task waits for the GPU here (EMA, seconds).
    pub(super) fn gpu_wait_s(&self) -> Option<f64> {
        self.gpu_wait_s
    }
    /// The share of the recent window the GPU was busy.
    pub(super) fn gpu_busy(&self) -> Option<f64> {
        self.gpu_busy
    }
    /// Where `mb` stands among the forwards waiting for memory.
    pub(super) fn waiting_position(&self, mb: MbId) -> Option<usize> {
        self.waiting.iter().position(|m| *m == mb)
    }
    /// Whether forwards wait for memory.
    pub(super) fn any_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }
    /// A microbatch may be stuck: the next check looks at them all.
    pub(super) fn mark_maybe_stuck(&mut self) {
        self.maybe_stuck = true;
    }
    /// Whether a check of the stuck microbatches is due (and it is no
    /// longer).
    pub(super) fn take_maybe_stuck(&mut self) -> bool {
        std::mem::take(&mut self.maybe_stuck)
    }
    /// Sets the measured timings (a test's node).
    #[cfg(test)]
    pub(super) fn set_timings(
        &mut self,
        hold_s: Option<f64>,
        gpu_wait_s: Option<f64>,
        gpu_busy: Option<f64>,
    ) {
        (self.hold_s, self.gpu_wait_s, self.gpu_busy) = (hold_s, gpu_wait_s, gpu_busy);
    }
}

pub(super) const BUSY_WINDOW: Time = 10 * SEC;

/// Lightweight snapshot of one microbatch at this node.
#[derive(Clone, Debug)]
pub(super) struct Snap {
    attempt: u32,
    /// Path up to and including this node (index = stage), then the full
    /// path once the backward came through.
    path: Arc<Vec<NodeId>>,
    prev: NodeId,
    next: Option<NodeId>,
    label_in: Option<Label>,
    hint: Option<NodeId>,
    plan: Option<Arc<Vec<NodeId>>>,
    need_grad: bool,
    fwd_task: Option<TaskId>,
    fwd_done: bool,
    bwd_task: Option<TaskId>,
    /// Holder: loss task (head fwd+bwd).
    loss_task: Option<TaskId>,
    /// Its forward kept only the input (memory was full): the backward
    /// recomputes it ([`Config::recompute`]).
    stateless: bool,
    /// Gradient for `prev` is computed and stored (re-sent on recovery).
    grad_ready: bool,
    /// The gradient from `next` arrived.
    grad_in: bool,
    done: bool,
    /// Waiting for a replacement to appear (recovery found no candidate).
    stuck: bool,
    /// When this node took the microbatch (attempt) in.
    started: Time,
    /// Other senders of the same attempt (SWARM: a sender died after its
    /// output left, before the receipt that ends its call came back, and
    /// the hop before it ran that stage again elsewhere): the gradient goes
    /// back to each, so that it also takes the way that is whole.
    also_prev: Vec<NodeId>,
}

impl Snap {
    /// Its `attempt`.
    pub(super) fn attempt(&self) -> u32 {
        self.attempt
    }
    /// Its `path`.
    pub(super) fn path(&self) -> &Arc<Vec<NodeId>> {
        &self.path
    }
    /// Its `next`.
    pub(super) fn next(&self) -> Option<NodeId> {
        self.next
    }
    /// Its `hint`.
    pub(super) fn hint(&self) -> Option<NodeId> {
        self.hint
    }
    /// Its `plan`.
    pub(super) fn plan(&self) -> &Option<Arc<Vec<NodeId>>> {
        &self.plan
    }
    /// Its `fwd_done`.
    pub(super) fn fwd_done(&self) -> bool {
        self.fwd_done
    }
    /// Its `grad_ready`.
    pub(super) fn grad_ready(&self) -> bool {
        self.grad_ready
    }
    /// Its `grad_in`.
    pub(super) fn grad_in(&self) -> bool {
        self.grad_in
    }
    /// Its `done`.
    pub(super) fn done(&self) -> bool {
        self.done
    }
    /// Its `stuck`.
    pub(super) fn stuck(&self) -> bool {
        self.stuck
    }
    /// Its `started`.
    pub(super) fn started(&self) -> Time {
        self.started
    }
}

/// Other senders of one attempt a node sends the gradient to, at most.
const MAX_ALSO_PREV: usize = 2;

/// `newer` (a path up to some stage) followed by what `older` knows beyond it.
pub(super) fn merge_path(newer: &Arc<Vec<NodeId>>, older: &Arc<Vec<NodeId>>) -> Arc<Vec<NodeId>> {
    if older.len() <= newer.len() {
        return newer.clone();
    }
    let mut v = (**newer).clone();
    v.extend_from_slice(&older[newer.len()..]);
    Arc::new(v)
}

impl Snap {
    /// The same, taken in on flow `label_in` with the path `plan` to follow.
    pub(super) fn on_route(
        mut self,
        label_in: Option<Label>,
        plan: Option<Arc<Vec<NodeId>>>,
    ) -> Snap {
        self.label_in = label_in;
        self.plan = plan;
        self
    }

    /// Recovery sends the microbatch (or its re-run) on through `hint`.
    pub(super) fn set_hint(&mut self, hint: Option<NodeId>) {
        self.hint = hint;
    }

    /// Whether it waits for a replacement to appear.
    pub(super) fn set_stuck(&mut self, stuck: bool) {
        self.stuck = stuck;
    }

    /// A test's microbatch, forwarded along `path` (this node last) to
    /// `next`, whose gradient is wanted.
    #[cfg(test)]
    pub(super) fn forwarded(path: &[NodeId], next: NodeId, now: Time) -> Snap {
        let prev = path[path.len() - 2];
        Snap {
            next: Some(next),
            need_grad: true,
            fwd_done: true,
            ..Snap::new(0, Arc::new(path.to_vec()), prev, None, now)
        }
    }

    /// A test sets where the microbatch went on to.
    #[cfg(test)]
    pub(super) fn set_next(&mut self, next: Option<NodeId>) {
        self.next = next;
    }

    /// A test says the gradient from the next hop arrived.
    #[cfg(test)]
    pub(super) fn set_grad_in(&mut self) {
        self.grad_in = true;
    }

    /// A microbatch (attempt) taken in at `started` from `prev`, along
    /// `path`, its forward task `fwd_task` queued; nothing else known yet.
    pub(super) fn new(
        attempt: u32,
        path: Arc<Vec<NodeId>>,
        prev: NodeId,
        fwd_task: Option<TaskId>,
        started: Time,
    ) -> Snap {
        Snap {
            attempt,
            path,
            prev,
            next: None,
            label_in: None,
            hint: None,
            plan: None,
            need_grad: false,
            fwd_task,
            fwd_done: false,
            bwd_task: None,
            stateless: false,
            loss_task: None,
            grad_ready: false,
            grad_in: false,
            done: false,
            stuck: false,
            started,
            also_prev: Vec::new(),
        }
    }
}

impl Node {
    /// How long the hop of `mb` waited and ran here since its input
    /// arrived (reported in its ack); the arrival is forgotten.
    pub(super) fn busy_since_arrival(&mut self, mb: MbId, backward: bool) -> Time {
        let now = self.now;
        self.lifecycle
            .arrivals
            .remove(&(mb, backward))
            .map_or(0, |t| now - t)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_forward(
        &mut self,
        from: NodeId,
        mb: MbId,
        attempt: u32,
        path: Arc<Vec<NodeId>>,
        label: Option<Label>,
        hint: Option<NodeId>,
        need_grad: bool,
        plan: Option<Arc<Vec<NodeId>>>,
    ) {
        if self.phase != Phase::Active || mb.iter < self.iters.min_iter() {
            return;
        }
        if self.stage != 0 && self.iters.last_applied().is_some_and(|a| mb.iter < a) {
            // Its iteration is final (this stage applied a later one): a
            // stale hop (sent before its sender was paused, say). Its
            // weights are gone; nobody waits for it.
            return;
        }
        // The sender put itself at its stage's index (the path may go on:
        // a node that re-sends its output after the backward came through
        // sends the whole path).
        let sender_at = if self.stage == 0 {
            self.s() as usize
        } else {
            self.stage as usize - 1
        };
        if path.get(sender_at) != Some(&from) {
            // A hop for another stage: the sender takes this node for a
            // member of the stage it served before it fenced itself and
            // joined another. Its weights are not that stage's: not run.
            // The sender learns this node's stage and fails the hop over.
            let m = self.intro_msg(None);
            self.send(from, m);
            return;
        }
        if mb.iter > self.iters.min_iter() && self.stage != 0 {
            self.forget_before(mb.iter);
        }
        let ps = self.prev_stage();
        if !self.peers.contains_key(&from) {
            self.learn(from, ps);
        }
        if self.stage == 0 {
            // Sink: the output of the last stage came back.
            if mb.holder != self.id {
                return;
            }
            let Some(s) = self.lifecycle.snaps.get_mut(&mb) else {
                return;
            };
            if s.attempt != attempt {
                return;
            }
            s.prev = from;
            s.path = merge_path(&path, &s.path);
            if s.grad_ready {
                // Recovery: re-send the stored loss gradient.
                let p = s.path.clone();
                self.ack_again(from, mb, attempt, false);
                self.send_backward(from, mb, attempt, p);
                return;
            }
            if s.loss_task.is_none() {
                let t = self.run(TaskKind::Loss, Some(mb), attempt);
                self.lifecycle.snaps.get_mut(&mb).unwrap().loss_task = Some(t);
                self.lifecycle.arrivals.insert((mb, false), self.now);
            }
            self.notify_queued(from, mb, attempt, false);
            return;
        }
        if let Some(label) = label {
            if !self.reservations.knows(label) && self.policy().reserves_flows() {
                // Unknown reservation: tell the sender to drop it.
                self.send(from, Msg::PushBack { label });
            }
        }
        let twice = self.policy().acks_on_delivery();
        if let Some(s) = self.lifecycle.snaps.get_mut(&mb) {
            if s.attempt == attempt {
                if twice
                    && s.prev != from
                    && !s.grad_ready
                    && !s.also_prev.contains(&s.prev)
                    && s.also_prev.len() < MAX_ALSO_PREV
                {
                    s.also_prev.push(s.prev);
                }
                s.prev = from;
                // A hop re-sent for the aggregate alone (need_grad false)
                // does not cancel the gradient a recovery asked for.
                s.need_grad |= need_grad;
                s.path = merge_path(&path, &s.path);
                if s.grad_ready {
                    // We already hold this microbatch's gradient for our
                    // predecessor: re-send it, no recompute.
                    self.ack_again(from, mb, attempt, false);
                    if need_grad {
                        let p = self.lifecycle.snaps[&mb].path.clone();
                        self.send_backward(from, mb, attempt, p);
                    }
                } else if s.fwd_done {
                    self.ack_again(from, mb, attempt, false);
                } else {
                    // A re-sent hop whose work is still queued here.
                    self.notify_queued(from, mb, attempt, false);
                }
                return;
            }
            if s.attempt > attempt {
                return;
            }
        }
        // An older attempt's activations are dropped with its snapshot
        // (the holder started the microbatch again).
        self.lifecycle.snaps.remove(&mb);
        // The forward runs at once unless the activations it would keep
        // do not fit: then it keeps only its input and the backward
        // recomputes it, or (a trainer that cannot) it waits for a
        // backward to free memory. SWARM's backward is always stateless:
        // its forward keeps nothing but the input.
        let fits = self.activations_held() < self.capacity as usize;
        let stateless = !self.cfg.policy.keeps_activations() || (!fits && self.cfg.recompute);
        let t = (fits || stateless)
            .then(|| self.run_recomputing(TaskKind::Forward, Some(mb), attempt, stateless));
        if t.is_none() {
            self.lifecycle.waiting.push_back(mb);
        }
        self.lifecycle.snaps.insert(
            mb,
            Snap {
                label_in: label,
                hint,
                plan,
                need_grad,
                stateless,
                ..Snap::new(attempt, path, from, t, self.now)
            },
        );
        // Queue wait starts now; remember when the input arrived.
        self.lifecycle.arrivals.insert((mb, false), self.now);
        self.notify_queued(from, mb, attempt, false);
    }

    /// Microbatches whose activations this relay keeps for their backward:
    /// forward started, backward not done, not recomputed (none under a
    /// stateless backward, and none at a holder, whose memory its in-flight
    /// bound limits).
    pub(super) fn activations_held(&self) -> usize {
        if self.stage == 0 || !self.cfg.policy.keeps_activations() {
            return 0;
        }
        self.lifecycle
            .snaps
            .values()
            .filter(|s| s.fwd_task.is_some() && !s.done && !s.stateless)
            .count()
    }

    /// Starts the waiting forwards that fit now (a backward freed memory,
    /// an iteration became final, a microbatch started again elsewhere).
    pub(super) fn admit_waiting(&mut self) {
        while !self.lifecycle.waiting.is_empty() && self.activations_held() < self.capacity as usize
        {
            // A microbatch on a reserved flow first: the flow reserved its
            // memory; those routed hop by hop take what is left.
            let snaps = &self.lifecycle.snaps;
            let pick = self
                .lifecycle
                .waiting
                .iter()
                .position(|m| snaps.get(m).is_some_and(|s| s.label_in.is_some()))
                .unwrap_or(0);
            let mb = self.lifecycle.waiting.remove(pick).unwrap();
            let Some(s) = self.lifecycle.snaps.get(&mb) else {
                continue;
            };
            if s.fwd_task.is_some() || s.fwd_done {
                continue;
            }
            let attempt = s.attempt;
            let t = self.run(TaskKind::Forward, Some(mb), attempt);
            self.lifecycle.snaps.get_mut(&mb).unwrap().fwd_task = Some(t);
        }
    }

    /// The senders of the forwards waiting for memory hear that they are
    /// queued (each tick: the wait is a round trip of the pipeline beyond
    /// this relay, longer than any compute queue, and not a crash).
    pub(super) fn notify_waiting(&mut self) {
        let waiting: Vec<(NodeId, MbId, u32)> = self
            .lifecycle
            .waiting
            .iter()
            .filter_map(|mb| {
                self.lifecycle
                    .snaps
                    .get(mb)
                    .map(|s| (s.prev, *mb, s.attempt))
            })
            .collect();
        for (prev, mb, attempt) in waiting {
            self.notify_queued(prev, mb, attempt, false);
        }
    }

    /// Task `id` could not be finished. A failed aggregate is reported to
    /// the coordinator, which commits again (the members are alive: without
    /// this the stage would wait for its apply forever). Other tasks are
    /// forgotten: their microbatch's hop times out and is redone.
    pub(super) fn task_failed(&mut self, id: TaskId) {
        let Some((kind, _, _)) = self.tasks.remove(&id) else {
            return;
        };
        if self.phase != Phase::Active || !matches!(kind, TaskKind::Aggregate { .. }) {
            return;
        }
        let Some((iter, epoch)) = self.member.commit_of(id) else {
            return;
        };
        self.member.aggregate_failed(iter, epoch);
        if let Some(c) = self.group.coord() {
            self.send(c, Msg::AggFailed { iter, epoch });
        }
    }

    /// A microbatch's compute task is handed to the trainer: it waits
    /// (first in, first out) for the compute already queued here, which
    /// goes into the average (`gpu_wait_s`). A holder keeps none.
    pub(super) fn note_gpu_wait(&mut self) {
        if self.stage == 0 {
            return;
        }
        let wait = self.gpu_backlog_s();
        let l = &mut self.lifecycle.gpu_wait_s;
        *l = Self::ema(*l, wait, self.cfg.ema_alpha);
    }

    /// Once per [`BUSY_WINDOW`]: how busy the GPU was over the last one,
    /// into the average (`gpu_busy`).
    pub(super) fn sample_gpu_busy(&mut self) {
        let l = &mut self.lifecycle;
        let window = self.now.saturating_sub(l.busy_from);
        if window < BUSY_WINDOW {
            return;
        }
        let busy = (l.busy_acc / to_secs(window)).min(1.0);
        l.gpu_busy = Self::ema(l.gpu_busy, busy, self.cfg.ema_alpha);
        l.busy_acc = 0.0;
        l.busy_from = self.now;
    }

    pub(super) fn task_done(&mut self, id: TaskId) {
        let Some((kind, mb, attempt)) = self.tasks.remove(&id) else {
            return;
        };
        if kind.is_compute() && mb.is_some() && self.stage != 0 {
            self.lifecycle.busy_acc += self.expected_task_s(kind);
        }
        if self.phase != Phase::Active {
            return;
        }
        match kind {
            TaskKind::Aggregate { .. } => {
                if let Some((iter, epoch)) = self.member.commit_of(id) {
                    self.member.aggregate_finished(iter, epoch);
                    if let Some(c) = self.group.coord() {
                        let weights = self.member.weights();
                        self.send(
                            c,
                            Msg::AggDone {
                                iter,
                                epoch,
                                weights,
                            },
                        );
                    }
                }
            }
            TaskKind::Embed | TaskKind::Forward => {
                let mb = mb.unwrap();
                let Some(s) = self.lifecycle.snaps.get_mut(&mb) else {
                    return;
                };
                if s.attempt != attempt || s.fwd_task != Some(id) {
                    return;
                }
                s.fwd_done = true;
                let mut path = (*s.path).clone();
                path.truncate(self.stage as usize);
                path.push(self.id);
                let path = Arc::new(path);
                s.path = path.clone();
                let (label, hint, plan, prev) = (s.label_in, s.hint, s.plan.clone(), s.prev);
                let delivers = self.policy().acks_on_delivery();
                if kind == TaskKind::Forward && !delivers {
                    self.ack_done(prev, mb, attempt, false, false);
                }
                self.forward_out(mb, label, hint, plan, &[]);
                if kind == TaskKind::Forward && delivers {
                    let sent_on = self.acks.awaits(mb, false);
                    self.ack_done(prev, mb, attempt, false, sent_on);
                }
            }
            TaskKind::Loss => {
                let mb = mb.unwrap();
                let Some(s) = self.lifecycle.snaps.get_mut(&mb) else {
                    return;
                };
                if s.attempt != attempt || s.loss_task != Some(id) {
                    return;
                }
                s.grad_ready = true;
                let (prev, path) = (s.prev, s.path.clone());
                let busy = self.busy_since_arrival(mb, false);
                self.ack(prev, mb, attempt, false, busy);
                self.send_backward(prev, mb, attempt, path);
            }
            TaskKind::Backward | TaskKind::EmbedBackward => {
                let mb = mb.unwrap();
                let Some(s) = self.lifecycle.snaps.get_mut(&mb) else {
                    return;
                };
                if s.attempt != attempt || s.bwd_task != Some(id) {
                    return;
                }
                s.grad_ready = true;
                s.done = true;
                if self.stage != 0 {
                    let held = to_secs(self.now.saturating_sub(s.started));
                    let a = self.cfg.ema_alpha;
                    let h = &mut self.lifecycle.hold_s;
                    *h = Some(h.map_or(held, |x| (1.0 - a) * x + a * held));
                }
                let (prev, next, path, need) = (
                    s.prev,
                    s.next.unwrap_or(self.id),
                    s.path.clone(),
                    s.need_grad,
                );
                let delivers = self.policy().acks_on_delivery();
                if !delivers {
                    self.ack_done(next, mb, attempt, true, false);
                }
                let mut used = vec![id];
                if let Some(f) = self.lifecycle.snaps[&mb].fwd_task {
                    used.push(f);
                }
                if let Some(l) = self.lifecycle.snaps[&mb].loss_task {
                    used.push(l);
                }
                if self.stage == 0 {
                    if delivers {
                        // The trainer has the gradient: nothing goes on.
                        self.ack_done(next, mb, attempt, true, false);
                    }
                    // The microbatch is complete.
                    let (label, first, recheck) = self.dh.finish(mb);
                    if let (Some(Some(l)), Some(s)) = (label, self.lifecycle.snaps.get(&mb)) {
                        let rtt = to_secs(self.now.saturating_sub(s.started));
                        let a = self.cfg.ema_alpha;
                        self.reservations.observe_round_trip(l, rtt, a);
                    }
                    if first {
                        self.event(Event::MbDone {
                            mb,
                            path: path.clone(),
                        });
                    }
                    self.claim(mb, self.id, next, used);
                    self.holder_progress();
                    if let Some(asker) = recheck {
                        // A stage lost this microbatch's contribution while
                        // its backward ran: perhaps this attempt's own.
                        if !asker.is_some_and(|a| self.redo_a_stage(a, mb)) {
                            self.restart(mb, None);
                        }
                    }
                    self.launch();
                } else {
                    self.claim(mb, prev, next, used);
                    let sent_on = need && self.alive(prev);
                    if need {
                        // Other ways the same attempt came (see `also_prev`),
                        // untracked: the tracked one is `prev`'s.
                        let also = std::mem::take(
                            &mut self.lifecycle.snaps.get_mut(&mb).unwrap().also_prev,
                        );
                        let also: Vec<NodeId> = (also.into_iter())
                            .filter(|&p| p != prev && self.alive(p))
                            .collect();
                        for p in also {
                            let msg = Msg::Backward {
                                mb,
                                attempt,
                                path: path.clone(),
                            };
                            self.send(p, msg);
                        }
                        if !self.alive(prev) {
                            self.backward_failed(mb, prev);
                        } else {
                            self.send_backward(prev, mb, attempt, path);
                        }
                    }
                    if delivers {
                        self.ack_done(next, mb, attempt, true, sent_on);
                    }
                    self.admit_waiting();
                }
            }
        }
    }

    /// Sends this node's stored output for `mb` to the next hop.
    pub(super) fn forward_out(
        &mut self,
        mb: MbId,
        label: Option<Label>,
        hint: Option<NodeId>,
        plan: Option<Arc<Vec<NodeId>>>,
        exclude: &[NodeId],
    ) {
        let Some(s) = self.lifecycle.snaps.get(&mb) else {
            return;
        };
        let (attempt, path) = (s.attempt, s.path.clone());
        match self.route(mb, label, hint, plan.as_ref(), exclude) {
            None => {
                let s = self.lifecycle.snaps.get_mut(&mb).unwrap();
                s.stuck = true;
                self.lifecycle.maybe_stuck = true;
            }
            Some((n, out_label)) => {
                let s = self.lifecycle.snaps.get_mut(&mb).unwrap();
                s.next = Some(n);
                s.stuck = false;
                let msg = Msg::Forward {
                    mb,
                    attempt,
                    path,
                    label: out_label,
                    hint: None,
                    need_grad: true,
                    plan,
                };
                self.send_tracked(n, msg, mb, false, attempt);
            }
        }
    }

    pub(super) fn on_backward(
        &mut self,
        from: NodeId,
        mb: MbId,
        attempt: u32,
        path: Arc<Vec<NodeId>>,
    ) {
        if self.phase != Phase::Active {
            return;
        }
        let Some(s) = self.lifecycle.snaps.get_mut(&mb) else {
            return;
        };
        if s.attempt != attempt || !s.fwd_done {
            return;
        }
        if s.grad_in {
            // Duplicate: already have it.
            if s.done {
                self.ack_again(from, mb, attempt, true);
            } else {
                self.notify_queued(from, mb, attempt, true);
            }
            return;
        }
        s.grad_in = true;
        s.next = Some(from);
        s.path = path;
        let recompute = s.stateless;
        self.clear_deadline((mb, false));
        let kind = if self.stage == 0 {
            TaskKind::EmbedBackward
        } else {
            TaskKind::Backward
        };
        let t = self.run_recomputing(kind, Some(mb), attempt, recompute);
        self.lifecycle.snaps.get_mut(&mb).unwrap().bwd_task = Some(t);
        self.lifecycle.arrivals.insert((mb, true), self.now);
        self.notify_queued(from, mb, attempt, true);
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// Microbatch `idx` of holder 0's iteration 0, forwarded by stage-1
    /// node 20 (attempt `attempt`, gradient wanted back: `need_grad`).
    fn forward_from_20(idx: u32, attempt: u32, need_grad: bool) -> Msg {
        Msg::Forward {
            mb: mb(0, 0, idx),
            attempt,
            path: Arc::new(vec![0, 20]),
            label: None,
            hint: None,
            need_grad,
            plan: None,
        }
    }

    /// A forward hop runs one task however often it is re-sent; once done, it
    /// is acknowledged to the sender and passed on to the next stage.
    #[test]
    fn a_forward_hop_runs_once_and_is_acked_when_done() {
        let mut n = started(Policy::Gwtf, 10, 2, &[], &[(20, 1), (30, 3)]);
        let m = mb(0, 0, 0);
        let fwd = || forward_from_20(0, 0, true);
        let acts = deliver(&mut n, 20, fwd());
        let tasks = runs(&acts);
        assert_eq!(tasks.len(), 1);
        assert_eq!(tasks[0].kind, TaskKind::Forward);
        let id = tasks[0].id;
        assert!(runs(&deliver(&mut n, 20, fwd())).is_empty());
        let acts = n.handle(2 * SEC, Input::TaskDone { id });
        let s = sends(&acts);
        assert!(s.iter().any(|(to, msg)| *to == 20
            && matches!(
                msg,
                Msg::Ack {
                    backward: false,
                    ..
                }
            )));
        assert!(s
            .iter()
            .any(|(to, msg)| *to == 30 && matches!(msg, Msg::Forward { .. })));
        assert_eq!(n.lifecycle.snaps[&m].path[..], [0, 20, 10]);
    }

    /// A replacement that gets the same hop twice, first from a recovery
    /// (the sender needs the gradient back) then from its stage
    /// coordinator's re-run for the aggregate (need_grad false), still sends
    /// the gradient back: the sender waits for it (it used to wait until its
    /// holder's last-resort restart, minutes later).
    #[test]
    fn a_rerun_for_the_aggregate_does_not_cancel_a_recoverys_gradient() {
        let mut n = started(Policy::Gwtf, 10, 2, &[], &[(20, 1), (30, 3)]);
        let m = mb(0, 0, 0);
        let fwd = |need_grad: bool| forward_from_20(0, 0, need_grad);
        let id = runs(&deliver(&mut n, 20, fwd(true)))[0].id;
        assert!(runs(&deliver(&mut n, 20, fwd(false))).is_empty());
        n.handle(2 * SEC, Input::TaskDone { id });
        let back = Msg::Backward {
            mb: m,
            attempt: 0,
            path: Arc::new(vec![0, 20, 10, 30]),
        };
        let acts = deliver(&mut n, 30, back);
        let bwd = runs(&acts)
            .iter()
            .find(|t| t.kind == TaskKind::Backward)
            .map(|t| t.id)
            .expect("backward task");
        let acts = n.handle(3 * SEC, Input::TaskDone { id: bwd });
        assert!(
            sends(&acts)
                .iter()
                .any(|(to, msg)| *to == 20 && matches!(msg, Msg::Backward { .. })),
            "{acts:?}"
        );
    }

    /// A relay keeps at most `capacity` (4 here) microbatches' activations:
    /// a fifth forward waits, its sender hears it is queued (not dead), and
    /// it starts when a backward frees memory, or when a held microbatch
    /// starts again as a newer attempt. SWARM's stateless backward keeps
    /// nothing: all five run at once.
    #[test]
    fn a_forward_waits_for_memory_a_backward_frees() {
        let fwd = |idx: u32, attempt: u32| forward_from_20(idx, attempt, true);
        for policy in [Policy::Gwtf, Policy::SwarmPlus, Policy::Swarm] {
            let mut n = started(policy, 10, 2, &[], &[(20, 1), (30, 3)]);
            let mut ids = Vec::new();
            for idx in 0..4 {
                ids.push(runs(&deliver(&mut n, 20, fwd(idx, 0)))[0].id);
            }
            let acts = deliver(&mut n, 20, fwd(4, 0));
            if policy == Policy::Swarm {
                assert_eq!(runs(&acts).len(), 1, "{policy:?}");
                continue;
            }
            assert!(runs(&acts).is_empty(), "{policy:?}: no room, yet it ran");
            assert!(
                sends(&acts).iter().any(|(to, m)| *to == 20
                    && matches!(
                        m,
                        Msg::Queued {
                            backward: false,
                            ..
                        }
                    )),
                "{policy:?}: the sender was not told it waits: {acts:?}"
            );
            // A forward done frees nothing (its activations wait for the
            // backward); the tick tells the sender again.
            n.handle(2 * SEC, Input::TaskDone { id: ids[0] });
            let acts = n.on_timeout(4 * SEC);
            assert!(runs(&acts).is_empty(), "{policy:?}");
            assert!(sends(&acts)
                .iter()
                .any(|(to, m)| *to == 20 && matches!(m, Msg::Queued { .. })));
            let back = Msg::Backward {
                mb: mb(0, 0, 0),
                attempt: 0,
                path: Arc::new(vec![0, 20, 10, 30]),
            };
            let bwd = runs(&deliver(&mut n, 30, back))[0].id;
            let acts = n.handle(5 * SEC, Input::TaskDone { id: bwd });
            let r = runs(&acts);
            assert_eq!(r.len(), 1, "{policy:?}: {acts:?}");
            assert_eq!((r[0].kind, r[0].mb), (TaskKind::Forward, Some(mb(0, 0, 4))));
            // Full again; microbatch 1 restarted (attempt 1) takes its own
            // old slot, and the next waiting forward still waits.
            assert!(runs(&deliver(&mut n, 20, fwd(5, 0))).is_empty());
            let r = runs(&deliver(&mut n, 20, fwd(1, 1))).len();
            assert_eq!(
                r, 1,
                "{policy:?}: the newer attempt did not replace the old"
            );
            assert_eq!(n.activations_held(), 4, "{policy:?}");
        }
    }

    /// With a trainer that recomputes ([`Config::recompute`]) a relay whose
    /// memory is full (4 here) runs a fifth forward at once, keeping only
    /// its input: that microbatch holds no activations, and its backward
    /// recomputes the forward; the four kept ones do not.
    #[test]
    fn a_forward_beyond_memory_is_recomputed_at_its_backward() {
        let fwd = |idx: u32| forward_from_20(idx, 0, true);
        let mut cfg = Config::new(Policy::Gwtf, 4, 1 << 20);
        cfg.recompute = true;
        let mut n = Node::new(Arc::new(cfg), 10, 2, 0.5, 4, 1);
        n.handle(
            SEC,
            Input::Start {
                peers: vec![(20, 1), (30, 3)],
            },
        );
        let mut fwds = Vec::new();
        for idx in 0..6 {
            let acts = deliver(&mut n, 20, fwd(idx));
            let r = runs(&acts);
            assert_eq!(r.len(), 1, "forward {idx} did not run: {acts:?}");
            assert_eq!(r[0].kind, TaskKind::Forward);
            assert_eq!(r[0].recompute, idx >= 4, "forward {idx}");
            fwds.push(r[0].id);
        }
        assert_eq!(n.activations_held(), 4);
        for (i, &id) in fwds.iter().enumerate() {
            n.handle(2 * SEC + i as Time, Input::TaskDone { id });
        }
        for idx in [0, 5] {
            let back = Msg::Backward {
                mb: mb(0, 0, idx),
                attempt: 0,
                path: Arc::new(vec![0, 20, 10, 30]),
            };
            let acts = deliver(&mut n, 30, back);
            let r = runs(&acts);
            assert_eq!(r.len(), 1, "{acts:?}");
            assert_eq!(r[0].kind, TaskKind::Backward);
            assert_eq!(r[0].recompute, idx == 5, "backward {idx}");
        }
    }

    /// SWARM's backward is stateless (`swarm/pipeline/src/moe/server/
    /// expert_backend.py` runs the forward again): under `Policy::Swarm`
    /// every forward keeps only its input, so the runtime's trainer drops
    /// its activations and every backward recomputes them, memory or not.
    #[test]
    fn swarms_forwards_keep_nothing_and_its_backwards_recompute() {
        let fwd = |idx: u32| forward_from_20(idx, 0, true);
        for (policy, recompute) in [(Policy::Swarm, true), (Policy::SwarmDeccom, false)] {
            let cfg = Config::new(policy, 4, 1 << 20);
            let mut n = Node::new(Arc::new(cfg), 10, 2, 0.5, 4, 1);
            n.handle(
                SEC,
                Input::Start {
                    peers: vec![(20, 1), (30, 3)],
                },
            );
            let acts = deliver(&mut n, 20, fwd(0));
            let r = runs(&acts);
            assert_eq!(r.len(), 1, "{policy:?}: {acts:?}");
            assert_eq!(r[0].recompute, recompute, "{policy:?} forward");
            n.handle(2 * SEC, Input::TaskDone { id: r[0].id });
            let back = Msg::Backward {
                mb: mb(0, 0, 0),
                attempt: 0,
                path: Arc::new(vec![0, 20, 10, 30]),
            };
            let acts = deliver(&mut n, 30, back);
            let r = runs(&acts);
            assert_eq!(r.len(), 1, "{policy:?}");
            assert_eq!(r[0].kind, TaskKind::Backward);
            assert_eq!(r[0].recompute, recompute, "{policy:?} backward");
        }
    }

    /// SWARM's trainer call to a peer returns the peer's output: a hop is
    /// acknowledged once the next hop has its output (its receipt), so
    /// that a peer dying while it sends its output fails the call at the
    /// sender, which runs the stage again elsewhere (acked when its work
    /// was done, the lost output was waited for by nobody). GWTF acks when
    /// the work is done (its coordinators re-run a dead node's stage).
    #[test]
    fn swarm_acks_a_hop_once_its_output_reached_the_next_hop() {
        let acked = |acts: &[Action], backward: bool| {
            sends(acts).iter().any(|(to, m)| {
                *to == 20 && matches!(m, Msg::Ack { backward: b, .. } if *b == backward)
            })
        };
        for policy in [Policy::Gwtf, Policy::Swarm] {
            let swarm = policy == Policy::Swarm;
            let mut n = started(policy, 10, 2, &[], &[(20, 1), (30, 3)]);
            let m = mb(0, 0, 0);
            let id = runs(&deliver(&mut n, 20, forward_from_20(0, 0, true)))[0].id;
            let acts = n.handle(2 * SEC, Input::TaskDone { id });
            assert!(sends(&acts)
                .iter()
                .any(|(to, m)| *to == 30 && matches!(m, Msg::Forward { .. })));
            assert_eq!(
                acked(&acts, false),
                !swarm,
                "{policy:?}: forward acked at once"
            );
            let receipt = |backward| Msg::Queued {
                mb: m,
                attempt: 0,
                backward,
                wait: 0,
            };
            // A receipt from another peer than the next hop releases nothing.
            assert!(!acked(&deliver(&mut n, 21, receipt(false)), false));
            let acts = deliver(&mut n, 30, receipt(false));
            assert_eq!(
                acked(&acts, false),
                swarm,
                "{policy:?}: released by the receipt"
            );
            let back = Msg::Backward {
                mb: m,
                attempt: 0,
                path: Arc::new(vec![0, 20, 10, 30]),
            };
            let acts = deliver(&mut n, 30, back);
            let bwd = runs(&acts)[0].id;
            let acts = n.handle(3 * SEC, Input::TaskDone { id: bwd });
            assert!(sends(&acts)
                .iter()
                .any(|(to, m)| *to == 20 && matches!(m, Msg::Backward { .. })));
            let to_30 = sends(&acts)
                .iter()
                .any(|(to, m)| *to == 30 && matches!(m, Msg::Ack { backward: true, .. }));
            assert_eq!(to_30, !swarm, "{policy:?}: backward acked at once");
            // The receiver of the gradient acks it: that releases it too.
            let ack = Msg::Ack {
                mb: m,
                attempt: 0,
                backward: true,
                busy: 0,
                bytes: 1 << 20,
            };
            let acts = deliver(&mut n, 20, ack);
            let to_30 = sends(&acts)
                .iter()
                .any(|(to, m)| *to == 30 && matches!(m, Msg::Ack { backward: true, .. }));
            assert_eq!(to_30, swarm, "{policy:?}");
            assert!(!n.acks.holds_any());
        }
    }

    /// SWARM: the same attempt reaches a relay twice, from two senders (the
    /// first one's sender died after its output left, before its call
    /// ended, and the stage was run again elsewhere). The gradient goes
    /// back to both: one of the two ways may hold a dead node, and the
    /// holder waited for it until its last-resort restart (180 s). GWTF
    /// sends it to the last sender only.
    #[test]
    fn swarm_sends_the_gradient_back_every_way_an_attempt_came() {
        for policy in [Policy::Swarm, Policy::Gwtf] {
            let mut n = started(policy, 10, 2, &[], &[(20, 1), (21, 1), (30, 3)]);
            let m = mb(0, 0, 0);
            let id = runs(&deliver(&mut n, 20, forward_from_20(0, 0, true)))[0].id;
            let again = Msg::Forward {
                mb: m,
                attempt: 0,
                path: Arc::new(vec![0, 21]),
                label: None,
                hint: None,
                need_grad: true,
                plan: None,
            };
            assert!(runs(&deliver(&mut n, 21, again)).is_empty(), "one forward");
            n.handle(2 * SEC, Input::TaskDone { id });
            let back = Msg::Backward {
                mb: m,
                attempt: 0,
                path: Arc::new(vec![0, 21, 10, 30]),
            };
            let bwd = runs(&deliver(&mut n, 30, back))[0].id;
            let acts = n.handle(3 * SEC, Input::TaskDone { id: bwd });
            let mut to: Vec<NodeId> = sends(&acts)
                .iter()
                .filter(|(_, m)| matches!(m, Msg::Backward { .. }))
                .map(|(t, _)| *t)
                .collect();
            to.sort_unstable();
            let want = if policy == Policy::Swarm {
                vec![20, 21]
            } else {
                vec![21]
            };
            assert_eq!(to, want, "{policy:?}");
        }
    }

    /// A node that fenced itself and joined another stage still gets hops
    /// from senders that take it for a member of its old stage: it runs
    /// none (its weights are not that stage's) and introduces itself; the
    /// sender, learning its new stage, fails the hop over at once to
    /// another node of the stage it was meant for.
    #[test]
    fn a_hop_for_another_stage_is_not_run_and_fails_over() {
        // Node 10 serves stage 3 now; node 20 sent it a hop for stage 2.
        let mut n = started(Policy::Gwtf, 10, 3, &[], &[(20, 2), (30, 4)]);
        let acts = deliver(&mut n, 20, forward_from_20(0, 0, true));
        assert!(runs(&acts).is_empty(), "a stage-2 hop ran at stage 3");
        assert!(sends(&acts)
            .iter()
            .any(|(to, m)| *to == 20 && matches!(m, Msg::Introduce { stage: 3, .. })));
        // Its own stage's hop runs.
        let fwd3 = Msg::Forward {
            mb: mb(0, 0, 1),
            attempt: 0,
            path: Arc::new(vec![0, 5, 20]),
            label: None,
            hint: None,
            need_grad: true,
            plan: None,
        };
        assert_eq!(runs(&deliver(&mut n, 20, fwd3)).len(), 1);

        // The sender: stage-1 node 20 forwarded to 10 (then of stage 2).
        let mut s = started(Policy::Gwtf, 20, 1, &[], &[(0, 0), (10, 2), (11, 2)]);
        let m = mb(0, 0, 0);
        let now = s.now;
        s.lifecycle.snaps.insert(m, forwarded(&[0, 20], 10, now));
        awaiting_ack(&mut s, m, false, 10);
        let intro = Msg::Introduce {
            iter: 0,
            stage: 3,
            spare: 1,
            compute_s: 0.1,
            sent_at: now,
            echo: None,
        };
        let acts = deliver(&mut s, 10, intro);
        let to: Vec<NodeId> = (sends(&acts).into_iter())
            .filter(|(_, m)| matches!(m, Msg::Forward { .. }))
            .map(|(to, _)| to)
            .collect();
        assert_eq!(to, vec![11], "failed over to the other node of stage 2");
    }

    /// A relay samples how busy its GPU is once per window: the compute of
    /// the microbatches' tasks done in it, by its own speed estimate; other
    /// tasks do not count, nor does a holder's compute.
    #[test]
    fn a_relay_measures_how_busy_its_gpu_is() {
        let mut n = Node::new(config(Policy::Gwtf), 10, 2, 0.6, 4, 1);
        // 10 forwards of 0.2 s and 5 backwards of 0.4 s: 4 s of compute.
        for i in 0..15 {
            let k = if i < 10 {
                TaskKind::Forward
            } else {
                TaskKind::Backward
            };
            let id = n.run(k, Some(mb(0, 0, i)), 0);
            n.task_done(id);
        }
        let id = n.run(TaskKind::Aggregate { members: 2 }, None, 0);
        n.task_done(id);
        n.now = BUSY_WINDOW / 2;
        n.sample_gpu_busy();
        assert_eq!(n.lifecycle.gpu_busy, None, "half a window: no sample");
        n.now = BUSY_WINDOW;
        n.sample_gpu_busy();
        let b = n.lifecycle.gpu_busy.unwrap();
        assert!((b - 0.4).abs() < 1e-9, "4 s of 10: {b}");
        // An idle window moves the average toward 0.
        n.now = 2 * BUSY_WINDOW;
        n.sample_gpu_busy();
        let idle = n.lifecycle.gpu_busy.unwrap();
        assert!(
            (idle - 0.4 * (1.0 - n.cfg.ema_alpha)).abs() < 1e-9,
            "{idle}"
        );
        let mut h = Node::new(config(Policy::Gwtf), 0, 0, 0.6, 4, 1);
        let id = h.run(TaskKind::Embed, Some(mb(0, 0, 0)), 0);
        h.task_done(id);
        h.now = BUSY_WINDOW;
        h.sample_gpu_busy();
        assert_eq!(
            h.lifecycle.gpu_busy,
            Some(0.0),
            "a holder's compute is not counted"
        );
    }
}
