//! When and whom `gwtf demo` kills: every `--crash-every` seconds a kill is
//! due, aimed in turn at a phase of training, and waits for its moment:
//!
//! - forward: right after a holder printed `iteration` (its next iteration
//!   opens: the forward passes start);
//! - backward: halfway through an iteration by the last iterations' pace;
//! - aggregation: right after a stage's coordinator printed `committed` (its
//!   all-reduce runs), a member of that stage;
//! - state download: a joiner is started and, [`JOIN_STRIKE_S`] after it
//!   listens, the member it will most likely download its stage's state from
//!   is killed: the swarm puts a joiner in its bottleneck stage (with llama-tiny's
//!   even stages, the one with the fewest members, the lowest on a tie) and it
//!   asks the first member of that stage it knows (the lowest id) for the
//!   state ([`predict_join`]). Whether the kill came in time is in the report;
//! - random.
//!
//! Whom: a node carrying microbatches in flight at that moment, when one may
//! be killed (a kill of a node that carries none shows no recovery). The
//! holders' `mb_done` lines name each microbatch's path; a microbatch of a
//! holder's open iteration not reported done yet is in flight, on the path
//! its index took last ([`Facts::in_flight`]). Forward, backward and random
//! kills wait (up to [`patience`]) for a carrier; an aggregation kill takes a
//! member of the stage that committed (a carrier among them if any), a
//! state-download kill the predicted state server. Each kill says how many
//! microbatches its victim carried.
//!
//! An aim whose moment does not come within [`patience`] becomes a random
//! kill (and is named so). The last live member of a stage is never a victim
//! unless `--allow-empty-stage` (a paused member does not count as live).
//!
//! Pauses (`--pause-every`, `--pause-for`): every `--pause-every` seconds a
//! carrier (by the same rules; any allowed node after [`patience`]) is
//! stopped with SIGSTOP and continued with SIGCONT `--pause-for` seconds
//! later: a node that stalls, then comes back with stale timers and
//! connections, unlike a crash. Cuts (`--cut-every`, `--cut-for`): the same,
//! with the victim's link cut (SIGUSR1: `gwtf node` stops reading and
//! writing its sockets, emulated in user space) and restored (SIGUSR2): a
//! node that runs on, alone, while nobody hears it.
use super::demo_cmd::{DemoArgs, Swarm};
use super::demo_procs::Rng;
use gwtf::swarm::audit::{Event, Facts, InFlight, NodeId};
use std::collections::BTreeMap;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Aim {
    /// Right after a holder printed `iteration`: the next iteration's forward.
    Forward,
    /// Halfway through an iteration (by the last iterations' pace): backward.
    Backward,
    /// Right after a stage's `committed`: its all-reduce.
    Aggregation,
    /// Shortly after a joiner of the victim's stage started: the state download.
    StateDownload,
    Random,
}

impl Aim {
    pub fn name(self) -> &'static str {
        match self {
            Aim::Forward => "forward (right after an iteration opened)",
            Aim::Backward => "backward (mid-iteration)",
            Aim::Aggregation => "aggregation (right after committed)",
            Aim::StateDownload => "state download (a joiner of its stage starting)",
            Aim::Random => "random",
        }
    }
}

/// A kill that is due and waits for its moment.
pub struct Armed {
    aim: Aim,
    since: f64,
    /// Backward, state download: the time to strike.
    at: Option<f64>,
    /// State download: the joiner started for it and the member predicted to
    /// serve its state.
    joiner: Option<(NodeId, NodeId)>,
}

/// How long after a joiner listens its predicted state server is killed:
/// it asks the stages at once, chooses on its next protocol tick (100 ms),
/// then asks the member for the state (llama-tiny's moves in milliseconds on
/// loopback).
pub const JOIN_STRIKE_S: f64 = 0.12;

pub struct Chaos {
    every: f64,
    next_at: f64,
    turn: usize,
    armed: Option<Armed>,
    aims: Vec<Aim>,
    /// Microbatches per holder per iteration.
    microbatches: u64,
    /// `--pause-every` / `--pause-for` (SIGSTOP, SIGCONT).
    pauses: Stops,
    /// `--cut-every` / `--cut-for` (the link cut and restored, emulated).
    cuts: Stops,
    /// When each node was last continued (or its link restored): it runs at
    /// least as long as it was stopped before it is stopped again.
    resumed_at: BTreeMap<NodeId, f64>,
}

/// One kind of stop the chaos deals out: every `every` seconds a node is
/// stopped for `for_s` seconds (a pause, or a cut of its link).
struct Stops {
    cut: bool,
    every: f64,
    for_s: f64,
    next_at: f64,
    /// Stopped nodes and when they run again.
    active: Vec<(NodeId, f64)>,
}

impl Stops {
    fn new(cut: bool, every: f64, for_s: f64) -> Stops {
        Stops {
            cut,
            every,
            for_s,
            next_at: if every > 0.0 { every } else { f64::INFINITY },
            active: Vec::new(),
        }
    }

    fn word(&self) -> &'static str {
        if self.cut {
            "cut"
        } else {
            "pause"
        }
    }
}

impl Chaos {
    pub fn new(a: &DemoArgs) -> Chaos {
        let mut aims = vec![Aim::Forward, Aim::Backward, Aim::Aggregation];
        if a.join_every > 0.0 {
            aims.push(Aim::StateDownload);
        }
        aims.push(Aim::Random);
        Chaos {
            every: a.crash_every,
            next_at: a.crash_every,
            turn: 0,
            armed: None,
            aims,
            microbatches: a.microbatches,
            pauses: Stops::new(false, a.pause_every, a.pause_for),
            cuts: Stops::new(true, a.cut_every, a.cut_for),
            resumed_at: BTreeMap::new(),
        }
    }

    /// Continues every paused node and restores every cut link (at the end
    /// of the run).
    pub fn resume_all(&mut self, sw: &mut Swarm) {
        for stops in [&mut self.pauses, &mut self.cuts] {
            for (id, _) in std::mem::take(&mut stops.active) {
                sw.resume(id);
            }
        }
    }
}

/// Microbatches in flight per node on their expected paths.
pub fn carried(in_flight: &[InFlight]) -> BTreeMap<NodeId, u64> {
    let mut c = BTreeMap::new();
    for m in in_flight {
        for &id in &m.path {
            *c.entry(id).or_default() += 1;
        }
    }
    c
}

/// A victim among `allowed` that carries microbatches in flight (uniformly
/// among those that do), with how many; None when none of them carries any.
pub fn pick_carrier(
    allowed: &[NodeId],
    carried: &BTreeMap<NodeId, u64>,
    rng: &mut Rng,
) -> Option<(NodeId, u64)> {
    let carriers: Vec<(NodeId, u64)> = allowed
        .iter()
        .filter_map(|id| carried.get(id).filter(|&&n| n > 0).map(|&n| (*id, n)))
        .collect();
    rng.pick(&carriers)
}

/// A carrier among `allowed` if any, else (when `fallback`) any of them.
fn pick_victim(
    sw: &mut Swarm,
    allowed: &[NodeId],
    microbatches: u64,
    fallback: bool,
) -> Option<NodeId> {
    let c = carried(&sw.facts.in_flight(microbatches));
    match pick_carrier(allowed, &c, &mut sw.rng) {
        Some((id, _)) => Some(id),
        None if fallback => sw.rng.pick(allowed),
        None => None,
    }
}

/// Continues the paused nodes (restores the cut links) that are due, and
/// stops the next one.
fn stop_tick(
    sw: &mut Swarm,
    st: &mut Stops,
    resumed_at: &mut BTreeMap<NodeId, f64>,
    mb: u64,
    now: f64,
) {
    let due: Vec<NodeId> = (st.active.iter())
        .filter(|p| now >= p.1)
        .map(|p| p.0)
        .collect();
    st.active.retain(|p| now < p.1);
    for id in due {
        sw.resume(id);
        resumed_at.insert(id, now);
    }
    if now < st.next_at {
        return;
    }
    let late = now - st.next_at > patience(st.every);
    let allowed: Vec<NodeId> = (sw.victims(None).into_iter())
        .filter(|id| resumed_at.get(id).is_none_or(|&t| now - t >= st.for_s))
        .collect();
    match pick_victim(sw, &allowed, mb, late) {
        Some(id) => {
            let aim = if late {
                "random (no node carried microbatches in time)"
            } else {
                "microbatches in flight"
            };
            sw.pause(id, st.for_s, aim, st.cut);
            st.active.push((id, now + st.for_s));
            st.next_at = now + st.every;
        }
        None if late => {
            sw.out.note(&format!(
                "{now:>7.1}s  no {}: every stage is down to its last available member (or \
                 its others were just continued)",
                st.word()
            ));
            st.next_at = now + st.every;
        }
        None => {}
    }
}

/// How long an armed kill waits for its moment before striking at random.
pub fn patience(every: f64) -> f64 {
    (every * 1.5).clamp(2.0, 15.0)
}

/// The mean duration of the last few iterations.
pub fn iteration_pace(f: &Facts) -> Option<(f64, f64)> {
    let rows = f.completed_iterations();
    let recent = &rows[rows.len().saturating_sub(4)..];
    match (recent.first(), recent.last()) {
        (Some(a), Some(b)) if recent.len() >= 2 && b.t_s > a.t_s => {
            Some((b.t_s, (b.t_s - a.t_s) / (recent.len() - 1) as f64))
        }
        _ => None,
    }
}

/// The stage a joiner would be put in now and the member it would ask for
/// the state: the relay stage with the fewest live members (the lowest on a
/// tie; every relay of the demo computes as fast), and its lowest id.
pub fn predict_join(f: &Facts) -> Option<(u32, NodeId)> {
    let members = f.members_per_stage();
    let stage = (1..members.len())
        .filter(|&s| members[s] > 0)
        .min_by_key(|&s| (members[s], s))? as u32;
    let server = f
        .nodes
        .iter()
        .find(|(_, n)| n.member() && n.stage == Some(stage))
        .map(|(&id, _)| id)?;
    Some((stage, server))
}

pub fn chaos_tick(sw: &mut Swarm, ch: &mut Chaos, now: f64) -> Res<()> {
    stop_tick(sw, &mut ch.pauses, &mut ch.resumed_at, ch.microbatches, now);
    stop_tick(sw, &mut ch.cuts, &mut ch.resumed_at, ch.microbatches, now);
    if ch.every <= 0.0 {
        return Ok(());
    }
    if ch.armed.is_none() && now >= ch.next_at {
        let aim = ch.aims[ch.turn % ch.aims.len()];
        ch.turn += 1;
        ch.next_at = now + ch.every;
        let mut armed = Armed {
            aim,
            since: now,
            at: None,
            joiner: None,
        };
        match aim {
            Aim::Backward => {
                armed.at = Some(match iteration_pace(&sw.facts) {
                    Some((last, pace)) => {
                        let mut at = last + pace * 0.5;
                        while at < now {
                            at += pace;
                        }
                        at
                    }
                    None => now,
                })
            }
            Aim::StateDownload => {
                // Only when the predicted server may go.
                let target = predict_join(&sw.facts)
                    .filter(|&(stage, server)| sw.victims(Some(stage)).contains(&server));
                if let Some((stage, server)) = target {
                    match sw.join() {
                        Ok(j) => {
                            sw.out.note(&format!(
                                "{:>7.1}s  join: node {j}, expected in stage {stage} with its \
                                 state from node {server} (which will crash)",
                                sw.now()
                            ));
                            armed.joiner = Some((j, server));
                        }
                        Err(e) => sw.out.note(&format!("{now:>7.1}s  no join: {e}")),
                    }
                }
            }
            _ => {}
        }
        ch.armed = Some(armed);
    }
    // Time-based strikes (backward, state download, random, and any that
    // waited too long).
    if let Some(armed) = &ch.armed {
        let late = now - armed.since > patience(ch.every);
        let strike = match armed.aim {
            Aim::Random => true,
            Aim::Backward => armed.at.is_some_and(|at| now >= at),
            Aim::StateDownload => armed.joiner.is_none() || armed.at.is_some_and(|at| now >= at),
            _ => false,
        };
        // Forward, backward and random kills take a node carrying
        // microbatches: at their moment, or as soon after as one does.
        let needs_carrier = matches!(armed.aim, Aim::Random | Aim::Backward)
            || (armed.aim == Aim::StateDownload && armed.joiner.is_none());
        let no_carrier = || {
            let allowed = sw.victims(None);
            let c = carried(&sw.facts.in_flight(ch.microbatches));
            allowed
                .iter()
                .all(|id| c.get(id).copied().unwrap_or(0) == 0)
        };
        if (strike && !(needs_carrier && no_carrier())) || late {
            let victim = match (armed.aim, armed.joiner) {
                (Aim::StateDownload, Some((joiner, server)))
                    if !late && sw.victims(None).contains(&server) =>
                {
                    let when = if sw
                        .facts
                        .nodes
                        .get(&joiner)
                        .is_some_and(|n| n.active_s.is_some())
                    {
                        "already a member"
                    } else {
                        "not yet a member"
                    };
                    Some((
                        server,
                        format!("{} of joiner {joiner} ({when})", armed.aim.name()),
                        Some(joiner),
                    ))
                }
                _ => {
                    let aim = if armed.aim == Aim::Random {
                        armed.aim.name().to_string()
                    } else if armed.aim == Aim::StateDownload && armed.joiner.is_none() {
                        "random (no joiner's state server could be spared)".to_string()
                    } else if late || armed.aim == Aim::StateDownload {
                        format!("random ({} did not come in time)", armed.aim.name())
                    } else {
                        armed.aim.name().to_string()
                    };
                    let v = sw.victims(None);
                    pick_victim(sw, &v, ch.microbatches, true).map(|id| (id, aim, None))
                }
            };
            match victim {
                Some((id, aim, joiner)) => sw.kill(id, &aim, joiner),
                None => sw.out.note(&format!(
                    "{now:>7.1}s  no crash: every stage is down to its last member"
                )),
            }
            ch.armed = None;
        }
    }
    Ok(())
}

/// Event-triggered strikes: `node` just printed `ev`.
pub fn chaos_on_event(sw: &mut Swarm, ch: &mut Chaos, node: NodeId, ev: &Event) {
    let Some(armed) = &mut ch.armed else {
        return;
    };
    let microbatches = ch.microbatches;
    let target = match (armed.aim, ev) {
        (Aim::Forward, Event::Iteration { .. })
            if sw.facts.nodes.get(&node).is_some_and(|n| n.holder) =>
        {
            let v = sw.victims(None);
            pick_victim(sw, &v, microbatches, false)
        }
        (Aim::Aggregation, Event::Committed { stage, .. }) if *stage > 0 => {
            let v = sw.victims(Some(*stage));
            pick_victim(sw, &v, microbatches, true)
        }
        (Aim::StateDownload, Event::Listening { .. })
            if armed.joiner.is_some_and(|j| j.0 == node) =>
        {
            armed.at = Some(sw.now() + JOIN_STRIKE_S);
            None
        }
        _ => None,
    };
    if let Some(id) = target {
        let aim = armed.aim.name();
        sw.kill(id, aim, None);
        ch.armed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gwtf::swarm::audit::{parse_line, Entry, What};

    fn mb(holder: NodeId, index: u64, path: &[NodeId]) -> InFlight {
        InFlight {
            holder,
            iteration: 3,
            index,
            path: path.to_vec(),
        }
    }

    #[test]
    fn victims_are_picked_among_the_nodes_carrying_microbatches_in_flight() {
        // Relays 3, 4 (stage 1) and 5, 6 (stage 2); 7 is in stage 2 too.
        let in_flight = [
            mb(1, 0, &[3, 5]),
            mb(1, 1, &[3, 6]),
            mb(2, 0, &[4, 5]),
            mb(2, 1, &[]), // never done before: no path known
        ];
        let c = carried(&in_flight);
        assert_eq!(
            c.into_iter().collect::<Vec<_>>(),
            vec![(3, 2), (4, 1), (5, 2), (6, 1)]
        );
        let c = carried(&in_flight);
        let mut rng = Rng(11);
        let mut seen = BTreeMap::new();
        for _ in 0..200 {
            // 3 may not go (say, the last in sync of its stage): never picked.
            let (id, n) = pick_carrier(&[4, 5, 6, 7], &c, &mut rng).expect("carriers");
            assert!([4, 5, 6].contains(&id), "{id}");
            assert_eq!(n, c[&id]);
            *seen.entry(id).or_insert(0) += 1;
        }
        // Uniform among the carriers allowed: each is picked.
        assert_eq!(seen.len(), 3, "{seen:?}");
        // None of the allowed carries anything: no carrier.
        assert_eq!(pick_carrier(&[7], &c, &mut rng), None);
        assert_eq!(pick_carrier(&[], &c, &mut rng), None);
        assert_eq!(pick_carrier(&[3, 4], &carried(&[]), &mut rng), None);
    }

    /// What the demo sees of a founding member `id` of `stage`: its launch
    /// and its `active` line.
    fn founded(id: NodeId, stage: u32) -> [What; 2] {
        [
            What::Launched {
                node: id,
                holder: stage == 0,
                joiner: false,
                stage: Some(stage),
            },
            What::Line {
                node: id,
                event: parse_line(&format!(
                    r#"{{"event":"active","node":{id},"stage":{stage}}}"#
                )),
            },
        ]
    }

    /// The holders' `mb_done` lines give the paths; the open iteration's
    /// microbatches not done yet are in flight on the path their index took
    /// last, the dead relays left out.
    #[test]
    fn microbatches_in_flight_follow_the_paths_of_mb_done_lines() {
        let mut f = Facts::new(4); // relay stages 1, 2
        let mut t = 0.0;
        let mut push = |f: &mut Facts, what: What| {
            t += 0.1;
            f.push(&Entry { t, what });
        };
        let line = |node: NodeId, text: String| What::Line {
            node,
            event: parse_line(&text),
        };
        for (id, stage) in [(1, 0), (3, 1), (4, 1), (5, 2), (6, 2)] {
            for what in founded(id, stage) {
                push(&mut f, what);
            }
        }
        let done = |i: u64, idx: u64, path: &str| {
            line(
                1,
                format!(
                    r#"{{"event":"mb_done","node":1,"holder":1,"index":{idx},"iteration":{i},"path":{path}}}"#
                ),
            )
        };
        // Iteration 0 open, no path known yet: two in flight, on no one.
        let paths = |f: &Facts| -> Vec<(u64, u64, Vec<NodeId>)> {
            f.in_flight(2)
                .into_iter()
                .map(|m| (m.iteration, m.index, m.path))
                .collect()
        };
        assert_eq!(paths(&f), vec![(0, 0, vec![]), (0, 1, vec![])]);
        push(&mut f, done(0, 0, "[1,3,5]"));
        assert_eq!(paths(&f), vec![(0, 1, vec![])]);
        push(&mut f, done(0, 1, "[1,4,6]"));
        assert_eq!(paths(&f), vec![], "all done: the aggregation runs");
        push(
            &mut f,
            line(
                1,
                r#"{"event":"iteration","node":1,"iteration":0,"loss":5.0,"microbatches":2,"tokens":256}"#
                    .into(),
            ),
        );
        // Iteration 1 opened: both in flight where their index went last.
        assert_eq!(paths(&f), vec![(1, 0, vec![3, 5]), (1, 1, vec![4, 6])]);
        assert_eq!(
            carried(&f.in_flight(2)).into_iter().collect::<Vec<_>>(),
            vec![(3, 1), (4, 1), (5, 1), (6, 1)]
        );
        push(
            &mut f,
            What::Killed {
                node: 5,
                aim: "x".into(),
                joiner: None,
                carrying: Some(1),
            },
        );
        assert_eq!(paths(&f), vec![(1, 0, vec![3]), (1, 1, vec![4, 6])]);
        push(&mut f, done(1, 1, "[1,4,6]"));
        assert_eq!(paths(&f), vec![(1, 0, vec![3])]);
    }

    #[test]
    fn a_joiner_is_predicted_into_the_smallest_stage_served_by_its_lowest_id() {
        let mut f = Facts::new(5); // relay stages 1, 2, 3
        let mut t = 0.0;
        let mut push = |f: &mut Facts, what: What| {
            t += 0.1;
            f.push(&Entry { t, what });
        };
        for (id, stage) in [(1, 0), (4, 1), (5, 1), (7, 2), (6, 2), (8, 3), (9, 3)] {
            for what in founded(id, stage) {
                push(&mut f, what);
            }
        }
        // 2 members everywhere: the lowest stage, its lowest id.
        assert_eq!(predict_join(&f), Some((1, 4)));
        push(
            &mut f,
            What::Killed {
                node: 7,
                aim: "x".into(),
                joiner: None,
                carrying: None,
            },
        );
        assert_eq!(predict_join(&f), Some((2, 6)));
        push(
            &mut f,
            What::Killed {
                node: 6,
                aim: "x".into(),
                joiner: None,
                carrying: None,
            },
        );
        // An empty stage takes no joiner by this rule (nobody answers for it).
        assert_eq!(predict_join(&f), Some((1, 4)));
    }
}
