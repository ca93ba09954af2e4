//! When and whom `gwtf demo` kills: every `--crash-every` seconds a kill is
//! due, aimed in turn at a phase of training, and waits for its moment:
//!
//! - forward: right after a relay printed `applied` (it starts the next
//!   iteration's forward passes), that relay;
//! - backward: halfway through an iteration by the last iterations' pace;
//! - aggregation: right after a stage's coordinator printed `committed` (its
//!   all-reduce runs), a member of that stage;
//! - state download: a joiner is started into the stage with the most
//!   members, through a member of that stage, and [`JOIN_STRIKE_S`] after it
//!   listens that member (or another of the stage) is killed: the one that
//!   introduced it and may be serving the stage's state;
//! - random.
//!
//! An aim whose moment does not come within [`patience`] becomes a random
//! kill (and is named so). The last live member of a stage is never a victim
//! unless `--allow-empty-stage`.
use super::demo_cmd::{DemoArgs, Swarm};
use super::demo_events::{Event, Facts, NodeId};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Aim {
    /// Right after a relay printed `applied`: the next iteration's forward.
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
            Aim::Forward => "forward (right after applied)",
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
    /// State download: the joiner started for it, its stage, its first contact.
    joiner: Option<(NodeId, u32, NodeId)>,
}

/// How long after a joiner listens its stage loses a member (time to reach
/// its contact and ask for the state; llama-tiny's state moves in
/// milliseconds on loopback).
pub const JOIN_STRIKE_S: f64 = 0.1;

pub struct Chaos {
    every: f64,
    next_at: f64,
    turn: usize,
    armed: Option<Armed>,
    aims: Vec<Aim>,
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
        }
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

pub fn chaos_tick(sw: &mut Swarm, ch: &mut Chaos, now: f64) -> Res<()> {
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
                // The stage with the most members (so one may go), joined now.
                let members = sw.facts.members_per_stage();
                let stage = (1..members.len())
                    .max_by_key(|&s| (members[s], usize::MAX - s))
                    .filter(|&s| members[s] >= 2 || sw.a.allow_empty_stage);
                if let Some(s) = stage {
                    match sw.join(Some(s as u32)) {
                        Ok((j, contact)) => {
                            sw.out.note(&format!(
                                "{:>7.1}s  join: node {j} into stage {s} through node {contact} \
                                 (to crash a member while it downloads the stage's state)",
                                sw.now()
                            ));
                            armed.joiner = Some((j, s as u32, contact));
                        }
                        Err(e) => sw.out.note(&format!("{now:>7.1}s  no join: {e}")),
                    }
                }
            }
            _ => {}
        }
        ch.armed = Some(armed);
    }
    // Time-based strikes (backward, random, and any that waited too long).
    if let Some(armed) = &ch.armed {
        let late = now - armed.since > patience(ch.every);
        let strike = match armed.aim {
            Aim::Random => true,
            Aim::Backward => armed.at.is_some_and(|at| now >= at),
            Aim::StateDownload => armed.joiner.is_none() || armed.at.is_some_and(|at| now >= at),
            _ => false,
        };
        if strike || late {
            let aim = if late && !strike {
                format!("random ({} did not come in time)", armed.aim.name())
            } else if armed.aim == Aim::StateDownload && armed.joiner.is_none() {
                "random (no stage could spare a member for a state download)".to_string()
            } else {
                armed.aim.name().to_string()
            };
            let victim = match (armed.aim, armed.joiner) {
                (Aim::StateDownload, Some((joiner, stage, contact))) if !late => {
                    let v: Vec<NodeId> = sw
                        .victims(Some(stage))
                        .into_iter()
                        .filter(|&v| v != joiner)
                        .collect();
                    let when = if sw
                        .facts
                        .nodes
                        .get(&joiner)
                        .is_some_and(|n| n.active_s.is_some())
                    {
                        "already a member: too late"
                    } else {
                        "not yet a member"
                    };
                    let pick = if v.contains(&contact) {
                        Some(contact)
                    } else {
                        sw.rng.pick(&v)
                    };
                    pick.map(|id| (id, format!("{aim}; joiner {joiner} {when}")))
                }
                _ => {
                    let v = sw.victims(None);
                    sw.rng.pick(&v).map(|id| (id, aim))
                }
            };
            match victim {
                Some((id, aim)) => sw.kill(id, &aim),
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
    let target = match (armed.aim, ev) {
        (Aim::Forward, Event::Applied { stage, .. }) if *stage > 0 => {
            sw.victims(Some(*stage)).contains(&node).then_some(node)
        }
        (Aim::Aggregation, Event::Committed { stage, .. }) if *stage > 0 => {
            let v = sw.victims(Some(*stage));
            sw.rng.pick(&v)
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
        sw.kill(id, aim);
        ch.armed = None;
    }
}
