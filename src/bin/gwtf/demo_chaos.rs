//! When and whom `gwtf demo` kills: every `--crash-every` seconds a kill is
//! due, aimed in turn at a phase of training, and waits for its moment:
//!
//! - forward: right after a relay printed `applied` (it starts the next
//!   iteration's forward passes), that relay;
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
        if strike || late {
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
                    sw.rng.pick(&v).map(|id| (id, aim, None))
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
        sw.kill(id, aim, None);
        ch.armed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::super::demo_events::{parse_line, Entry, What};
    use super::*;

    #[test]
    fn a_joiner_is_predicted_into_the_smallest_stage_served_by_its_lowest_id() {
        let mut f = Facts::new(5); // relay stages 1, 2, 3
        let mut t = 0.0;
        let mut push = |f: &mut Facts, what: What| {
            t += 0.1;
            f.push(&Entry { t, what });
        };
        for (id, stage) in [(1, 0), (4, 1), (5, 1), (7, 2), (6, 2), (8, 3), (9, 3)] {
            push(
                &mut f,
                What::Launched {
                    node: id,
                    holder: stage == 0,
                    joiner: false,
                    stage: Some(stage),
                },
            );
            push(
                &mut f,
                What::Line {
                    node: id,
                    event: parse_line(&format!(
                        r#"{{"event":"active","node":{id},"stage":{stage}}}"#
                    )),
                },
            );
        }
        // 2 members everywhere: the lowest stage, its lowest id.
        assert_eq!(predict_join(&f), Some((1, 4)));
        push(
            &mut f,
            What::Killed {
                node: 7,
                aim: "x".into(),
                joiner: None,
            },
        );
        assert_eq!(predict_join(&f), Some((2, 6)));
        push(
            &mut f,
            What::Killed {
                node: 6,
                aim: "x".into(),
                joiner: None,
            },
        );
        // An empty stage takes no joiner by this rule (nobody answers for it).
        assert_eq!(predict_join(&f), Some((1, 4)));
    }
}
