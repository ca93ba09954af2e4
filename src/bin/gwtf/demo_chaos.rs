//! When and whom `gwtf demo` kills: every `--crash-every` seconds a kill is
//! due, aimed in turn at a phase of training, and waits for its moment:
//!
//! - forward: right after a relay printed `applied` (it starts the next
//!   iteration's forward passes), that relay;
//! - backward: halfway through an iteration by the last iterations' pace;
//! - aggregation: right after a stage's coordinator printed `committed` (its
//!   all-reduce runs), a member of that stage;
//! - state download: a joiner is started into the stage with the most members
//!   and, as soon as it listens, a member of that stage (maybe the one serving
//!   the stage's state) is killed;
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
    /// Right after a joiner of the victim's stage started: the state download.
    StateDownload,
    Random,
}

impl Aim {
    pub fn name(self) -> &'static str {
        match self {
            Aim::Forward => "forward (right after applied)",
            Aim::Backward => "backward (mid-iteration)",
            Aim::Aggregation => "aggregation (right after committed)",
            Aim::StateDownload => "state download (joiner starting)",
            Aim::Random => "random",
        }
    }
}

/// A kill that is due and waits for its moment.
pub struct Armed {
    aim: Aim,
    since: f64,
    /// Backward: the time to strike.
    at: Option<f64>,
    /// State download: the joiner started for it, and its stage.
    joiner: Option<(NodeId, u32)>,
}

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
                    let j = sw.join(Some(s as u32))?;
                    sw.out.note(&format!(
                        "{:>7.1}s  join: node {j} into stage {s} (to crash a member while it \
                         downloads the stage's state)",
                        sw.now()
                    ));
                    armed.joiner = Some((j, s as u32));
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
            Aim::StateDownload => armed.joiner.is_none(),
            _ => false,
        };
        if strike || late {
            let aim = if late && !strike {
                format!("random ({} did not come in time)", armed.aim.name())
            } else {
                armed.aim.name().to_string()
            };
            let v = sw.victims(None);
            if let Some(id) = sw.rng.pick(&v) {
                sw.kill(id, &aim);
            }
            ch.armed = None;
        }
    }
    Ok(())
}

/// Event-triggered strikes: `node` just printed `ev`.
pub fn chaos_on_event(sw: &mut Swarm, ch: &mut Chaos, node: NodeId, ev: &Event) {
    let Some(armed) = &ch.armed else {
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
            if armed.joiner.is_some_and(|(j, _)| j == node) =>
        {
            let stage = armed.joiner.map(|j| j.1);
            let v: Vec<NodeId> = sw
                .victims(stage)
                .into_iter()
                .filter(|&v| v != node)
                .collect();
            sw.rng.pick(&v)
        }
        _ => None,
    };
    if let Some(id) = target {
        let aim = armed.aim.name();
        sw.kill(id, aim);
        ch.armed = None;
    }
}
