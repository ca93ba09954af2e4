//! Unit tests of the stage group's coordinator, on one node fed its own inputs.
use super::super::testkit::*;
use super::*;

/// Holder 0's microbatch `idx` of iteration 0, claimed after 10 and before 30.
fn claim_of(idx: u32) -> Msg {
    Msg::Claim {
        iter: 0,
        mb: mb(0, 0, idx),
        prev: 10,
        next: 30,
    }
}

/// Coordinator 1 of stage 2 (members 2 and 3, node 10 in stage 1) with
/// iteration 0 open (holder 0, passed on from stage 1), and the
/// microbatches per iteration.
fn opened() -> (Node, u32) {
    let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[(10, 1)]);
    let per = n.cfg.mb_per_iter;
    let open = Msg::StartIter {
        iter: 0,
        holders: Arc::new(vec![0]),
    };
    deliver(&mut n, 10, open);
    (n, per)
}

/// Members 2 and 3 claim holder 0's microbatches `0..per` in turn: the
/// coordinator commits; its epoch, and the aggregate task its own commit
/// starts here.
fn claims_until_committed(n: &mut Node, per: u32) -> (u64, TaskId) {
    let (mut epoch, mut agg) = (None, None);
    for idx in 0..per {
        let acts = deliver(n, 2 + (idx % 2) as NodeId, claim_of(idx));
        epoch = epoch.or(sends(&acts).iter().find_map(|(_, m)| match m {
            Msg::Commit { epoch, .. } => Some(*epoch),
            _ => None,
        }));
        agg = agg.or(runs(&acts)
            .iter()
            .find(|t| matches!(t.kind, TaskKind::Aggregate { .. }))
            .map(|t| t.id));
    }
    (epoch.expect("committed"), agg.expect("an aggregate task"))
}

/// Each microbatch is granted to exactly one claimant: the first; a later
/// claimant is refused, and the first one's re-sent claim is granted again
/// (claims are idempotent).
#[test]
fn a_microbatch_is_granted_to_exactly_one_claimant() {
    let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[]);
    let (a, b) = (mb(0, 0, 0), mb(0, 0, 1));
    let claim = |m: MbId| Msg::Claim {
        iter: 0,
        mb: m,
        prev: 20,
        next: 30,
    };
    let reply = |acts: Vec<Action>, to: NodeId| -> Option<bool> {
        sends(&acts).into_iter().find_map(|(t, m)| match m {
            Msg::ClaimReply { granted, .. } if t == to => Some(*granted),
            _ => None,
        })
    };
    assert_eq!(reply(deliver(&mut n, 2, claim(a)), 2), Some(true));
    assert_eq!(reply(deliver(&mut n, 3, claim(a)), 3), Some(false));
    assert_eq!(reply(deliver(&mut n, 2, claim(a)), 2), Some(true));
    assert_eq!(reply(deliver(&mut n, 3, claim(b)), 3), Some(true));
    let ci = &n.coordinating.coord_iters[&0];
    assert_eq!(ci.granted[&a].0, 2);
    assert_eq!(ci.granted[&b].0, 3);
}

/// A stage commits as soon as every microbatch of the iteration's
/// participants is granted here, before the iteration ends (the end
/// waits for every stage's work; this stage's all-reduce need not).
#[test]
fn a_stage_commits_when_its_own_work_is_done() {
    let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[(10, 1)]);
    let per = n.cfg.mb_per_iter;
    let commits = |acts: &[Action]| {
        sends(acts)
            .iter()
            .filter(|(_, m)| matches!(m, Msg::Commit { iter: 0, .. }))
            .count()
    };
    // The iteration opens with holder 0 (passed on from stage 1).
    let open = Msg::StartIter {
        iter: 0,
        holders: Arc::new(vec![0]),
    };
    assert_eq!(commits(&deliver(&mut n, 10, open)), 0);
    for idx in 0..per {
        let from = 2 + (idx % 2) as NodeId;
        let c = commits(&deliver(&mut n, from, claim_of(idx)));
        // The last grant commits (to the other two members, and to
        // itself), with no EndIter.
        assert_eq!(c, if idx + 1 == per { 2 } else { 0 }, "claim {idx}");
    }
    assert!(n.coordinating.coord_iters[&0].end.is_none());
}

/// Member `from` syncs its grants of iteration 0 with `n`.
fn sync(n: &mut Node, from: NodeId, granted: Vec<(MbId, NodeId, NodeId)>) -> Vec<Action> {
    let msg = Msg::Sync {
        iter: 0,
        granted,
        end: None,
    };
    deliver(n, from, msg)
}

/// A coordinator that took over from one that left or died re-runs what
/// is still missing at the end of the iteration (its predecessor's own
/// grants, which nobody can sync): at once when every live member has
/// synced its grants, else after a heartbeat period for the syncs still to
/// come; never after `redo_timeout`.
#[test]
fn a_successor_recomputes_its_predecessors_grants_at_once() {
    let restarts = |acts: &[Action]| {
        sends(acts)
            .iter()
            .filter(|(to, m)| *to == 0 && matches!(m, Msg::Restart { mb, .. } if mb.idx == 0))
            .count()
    };
    for member_syncs in [true, false] {
        let mut n = started(Policy::Gwtf, 2, 2, &[1, 3], &[(0, 0), (10, 1)]);
        assert_eq!(n.group.coord(), Some(1));
        deliver(&mut n, 1, Msg::Goodbye);
        assert_eq!(n.group.coord(), Some(2));
        let per = n.cfg.mb_per_iter;
        if member_syncs {
            // Member 3 syncs its grants: all but microbatch 0 (granted to 1).
            sync(&mut n, 3, (1..per).map(|i| (mb(0, 0, i), 10, 30)).collect());
        }
        let end = Msg::EndIter {
            iter: 0,
            origin: 0,
            holders: Arc::new(vec![0]),
        };
        let acts = deliver(&mut n, 0, end);
        let t0 = n.now;
        if member_syncs {
            assert_eq!(restarts(&acts), 1, "every member synced: at once");
            continue;
        }
        assert_eq!(restarts(&acts), 0, "member 3 has not synced yet");
        let mut restarted_at = None;
        let mut t = t0;
        while t < t0 + n.cfg.redo_timeout && restarted_at.is_none() {
            t += n.cfg.tick;
            let acts = n.on_timeout(t);
            if restarts(&acts) > 0 {
                restarted_at = Some(t);
            }
        }
        let at = restarted_at.expect("restarted before redo_timeout");
        assert!(
            at - t0 <= 2 * n.cfg.heartbeat_ticks as Time * n.cfg.tick,
            "{at}"
        );
    }
}

/// A claim that reaches a member before it knows it is the new coordinator
/// (the claimant saw the old one go first) is answered with the member list
/// and kept: when this node takes over, it grants it at once, instead of
/// the claimant sending it again a heartbeat period later.
#[test]
fn a_claim_that_came_before_the_take_over_is_granted_with_it() {
    let mut n = started(Policy::Gwtf, 2, 2, &[1, 3], &[(0, 0), (10, 1)]);
    assert_eq!(n.group.coord(), Some(1));
    let acts = deliver(&mut n, 3, claim_of(5));
    assert!(sends(&acts)
        .iter()
        .all(|(_, m)| !matches!(m, Msg::ClaimReply { .. })));
    let acts = deliver(&mut n, 1, Msg::Goodbye);
    assert_eq!(n.group.coord(), Some(2));
    let granted = sends(&acts).into_iter().any(|(to, m)| {
        to == 3 && matches!(m, Msg::ClaimReply { mb, granted: true } if mb.idx == 5)
    });
    assert!(granted, "{acts:?}");
}

/// At the holders' stage, a coordinator that took over from a holder that
/// finished the iteration and then left (or died, during the all-reduce)
/// gives that holder's own microbatches up once every live holder synced
/// and commits without them, instead of asking the gone holder to restart
/// them and waiting `redo_timeout` for an answer that cannot come.
#[test]
fn the_holders_stage_gives_a_gone_holders_part_up_at_once() {
    let mut n = started(Policy::Gwtf, 2, 0, &[1, 3], &[(10, 1)]);
    assert_eq!(n.group.coord(), Some(1));
    deliver(&mut n, 1, Msg::Goodbye);
    assert_eq!(n.group.coord(), Some(2));
    let per = n.cfg.mb_per_iter;
    for h in [2, 3] {
        sync(&mut n, 3, (0..per).map(|i| (mb(h, 0, i), 10, 60)).collect());
    }
    let end = Msg::EndIter {
        iter: 0,
        origin: 1,
        holders: Arc::new(vec![1, 2, 3]),
    };
    // Holder 3, the only other live member, synced: nothing more can come,
    // so the commit goes out with the end, without holder 1's part.
    let acts = deliver(&mut n, 3, end);
    assert!(sends(&acts)
        .iter()
        .any(|(_, m)| matches!(m, Msg::Commit { iter: 0, .. })));
    assert_eq!(n.coordinating.coord_iters[&0].dropped.len(), per as usize);
}

/// Once an iteration is committed no grant moves: only the owner of a
/// grant hears "granted"; a microbatch of an iteration already final is
/// refused outright; a node that does not coordinate answers with the
/// member list instead.
#[test]
fn a_committed_or_final_iteration_grants_nothing_new() {
    let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[]);
    let a = mb(0, 0, 0);
    let claim = |iter, m: MbId| Msg::Claim {
        iter,
        mb: m,
        prev: 20,
        next: 30,
    };
    deliver(&mut n, 2, claim(0, a));
    n.coordinating.coord_iters.get_mut(&0).unwrap().commit = Some(BTreeSet::new());
    let granted = |acts: &[Action]| {
        sends(acts).iter().find_map(|(_, m)| match m {
            Msg::ClaimReply { granted, .. } => Some(*granted),
            _ => None,
        })
    };
    assert_eq!(granted(&deliver(&mut n, 3, claim(0, a))), Some(false));
    assert_eq!(
        granted(&deliver(&mut n, 3, claim(0, mb(0, 0, 5)))),
        Some(false)
    );
    assert_eq!(granted(&deliver(&mut n, 2, claim(0, a))), Some(true));
    n.iters.finalize_before(5);
    assert_eq!(
        granted(&deliver(&mut n, 2, claim(3, mb(0, 3, 0)))),
        Some(false)
    );

    let mut m = started(Policy::Gwtf, 2, 2, &[1, 3], &[]);
    let acts = deliver(&mut m, 3, claim(0, a));
    assert!(granted(&acts).is_none());
    assert!(sends(&acts).iter().any(|(to, m)| *to == 3
        && matches!(
            m,
            Msg::Heartbeat {
                members: Some(_),
                ..
            }
        )));
}

/// A member whose part of the all-reduce failed (every member alive) tells
/// the coordinator, which commits again with a new epoch at its next tick,
/// not at once (a failure that repeats must not spin), and not for a stale
/// epoch's failure; the member's failed aggregate task reports it.
#[test]
fn a_failed_all_reduce_is_committed_again() {
    let (mut n, per) = opened();
    let commits = |acts: &[Action]| -> Vec<u64> {
        sends(acts)
            .iter()
            .filter_map(|(_, m)| match m {
                Msg::Commit { iter: 0, epoch, .. } => Some(*epoch),
                _ => None,
            })
            .collect()
    };
    let (mut first, mut agg) = (Vec::new(), None);
    for idx in 0..per {
        let acts = deliver(&mut n, 2 + (idx % 2) as NodeId, claim_of(idx));
        first.extend(commits(&acts));
        // Its commit reaches itself as a member: an aggregate task runs.
        agg = agg.or(runs(&acts)
            .iter()
            .find(|t| matches!(t.kind, TaskKind::Aggregate { .. }))
            .map(|t| t.id));
    }
    let (epoch, agg) = (first[0], agg.expect("an aggregate task"));
    // A stale epoch's failure changes nothing.
    let stale = deliver(
        &mut n,
        2,
        Msg::AggFailed {
            iter: 0,
            epoch: epoch ^ 1,
        },
    );
    assert!(commits(&stale).is_empty());
    assert!(n.coordinating.coord_iters[&0].commit.is_some());
    // So does one from a node not in the commit.
    let stranger = deliver(&mut n, 9, Msg::AggFailed { iter: 0, epoch });
    assert!(!stranger
        .iter()
        .any(|a| matches!(a, Action::Event(Event::AggregateFailed { .. }))));
    assert!(n.coordinating.coord_iters[&0].commit.is_some());
    // The member's own aggregate fails: it reports to its coordinator
    // (itself), which waits for its next tick to commit again.
    let acts = n.handle(n.now, Input::TaskFailed { id: agg });
    assert!(commits(&acts).is_empty());
    assert!(acts.iter().any(|a| matches!(
        a,
        Action::Event(Event::AggregateFailed {
            stage: 2,
            iter: 0,
            member: 1
        })
    )));
    let t = n.now + n.cfg.tick;
    let acts = n.on_timeout(t);
    // To the other two members; its own reaches itself as a new task.
    let again = commits(&acts);
    assert_eq!(again.len(), 2, "{again:?}");
    assert!(again.iter().all(|&e| e != epoch && e == again[0]));
    assert!(runs(&acts)
        .iter()
        .any(|t| matches!(t.kind, TaskKind::Aggregate { .. }) && t.id != agg));
    // A second failure report of the old epoch is stale now.
    let acts = deliver(&mut n, 3, Msg::AggFailed { iter: 0, epoch });
    assert!(!acts
        .iter()
        .any(|a| matches!(a, Action::Event(Event::AggregateFailed { .. }))));
}

/// A member dies with granted microbatches: each is re-run from the node
/// that had sent it the activations (`Redo`), unless that node is known
/// dead too, in which case the holder restarts it at once instead of after
/// a `redo_timeout` spent waiting for an answer that cannot come.
#[test]
fn a_lost_contribution_whose_sender_is_dead_is_restarted_at_once() {
    for prev_dead in [false, true] {
        let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[(0, 0), (10, 1), (30, 3)]);
        assert_eq!(n.group.coord(), Some(1));
        deliver(&mut n, 2, claim_of(0));
        if prev_dead {
            let now = n.now;
            n.handle(now, Input::PeerLost { peer: 10 });
        }
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 2 });
        let asked: Vec<(NodeId, &str)> = sends(&acts)
            .into_iter()
            .filter(|(_, m)| matches!(m, Msg::Redo { .. } | Msg::Restart { .. }))
            .map(|(to, m)| (to, m.name()))
            .collect();
        let want = if prev_dead {
            vec![(0, "Restart")]
        } else {
            vec![(10, "Redo")]
        };
        assert_eq!(asked, want, "sender dead: {prev_dead}");
    }
}

/// A member lost while its commit's all-reduce runs: its grants stand, for
/// the runtime's ring goes on without a member lost in its all-gather half
/// and its result then holds them. The survivors' `AggDone` apply the
/// commit with them, nothing recomputed; a survivor's `AggFailed` (the
/// ring could not go on) has them recomputed before the next commit; and
/// with no word from the survivors they are recomputed after `redo_timeout`.
#[test]
fn a_member_lost_during_the_all_reduce_keeps_its_grants_until_the_ring_ends() {
    for ending in ["done", "failed", "silent"] {
        let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[(10, 1), (30, 3)]);
        let per = n.cfg.mb_per_iter;
        deliver(
            &mut n,
            10,
            Msg::StartIter {
                iter: 0,
                holders: Arc::new(vec![0]),
            },
        );
        let (epoch, agg) = claims_until_committed(&mut n, per);
        let redone = |acts: &[Action]| {
            sends(acts)
                .iter()
                .filter(|(_, m)| matches!(m, Msg::Redo { .. } | Msg::Restart { .. }))
                .count()
        };
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 2 });
        assert_eq!(redone(&acts), 0, "{ending}: nothing recomputed yet");
        let ci = &n.coordinating.coord_iters[&0];
        assert!(ci.commit.is_some(), "{ending}");
        let of2 = ci.granted.values().filter(|g| g.0 == 2).count();
        assert_eq!(of2, per.div_ceil(2) as usize, "{ending}");
        let committed = |acts: &[Action]| {
            acts.iter().find_map(|a| match a {
                Action::Event(Event::StageCommitted { mbs, .. }) => Some(mbs.clone()),
                _ => None,
            })
        };
        match ending {
            "done" => {
                let acts = deliver(
                    &mut n,
                    3,
                    Msg::AggDone {
                        iter: 0,
                        epoch,
                        weights: 0,
                    },
                );
                assert!(
                    committed(&acts).is_none(),
                    "the coordinator's own part runs"
                );
                let now = n.now;
                let acts = n.handle(now, Input::TaskDone { id: agg });
                let mbs = committed(&acts).expect("applied");
                assert_eq!(mbs.len(), per as usize);
                assert_eq!(mbs.iter().filter(|x| x.1 == 2).count(), of2);
                assert_eq!(redone(&acts), 0);
            }
            "failed" => {
                let acts = deliver(&mut n, 3, Msg::AggFailed { iter: 0, epoch });
                assert_eq!(redone(&acts), of2, "each of its grants recomputed");
                let ci = &n.coordinating.coord_iters[&0];
                assert!(ci.commit.is_none());
                assert_eq!(ci.lost.len(), of2);
                assert!(ci.granted.values().all(|g| g.0 != 2));
            }
            _ => {
                let t = n.now + n.cfg.redo_timeout - n.cfg.tick;
                assert_eq!(redone(&n.on_timeout(t)), 0, "still waiting");
                let t = n.now + 2 * n.cfg.tick;
                assert_eq!(redone(&n.on_timeout(t)), of2, "given up");
                assert!(n.coordinating.coord_iters[&0].commit.is_none());
            }
        }
    }
}

/// The coordinator's own grants reach its deputy (the next live member by
/// id): all of them when it becomes the deputy, each new one at once.
#[test]
fn the_coordinators_own_grants_are_copied_to_its_deputy() {
    let mut n = started(Policy::Gwtf, 1, 2, &[2, 3], &[(10, 1), (30, 3)]);
    let deputies = |acts: &[Action]| -> Vec<(NodeId, usize)> {
        sends(acts)
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Deputy { iter: 0, granted } => Some((to, granted.len())),
                _ => None,
            })
            .collect()
    };
    // Its own claim, before any heartbeat: kept, not sent yet.
    assert!(deputies(&deliver(&mut n, 1, claim_of(0))).is_empty());
    // The next heartbeat sends node 2 all of it.
    let mut sent = Vec::new();
    for k in 1..=n.cfg.heartbeat_ticks as Time {
        let t = n.now + k * n.cfg.tick;
        sent.extend(deputies(&n.on_timeout(t)));
    }
    assert_eq!(sent, vec![(2, 1)]);
    // A later one goes at once; another member's grant does not.
    assert_eq!(deputies(&deliver(&mut n, 1, claim_of(1))), vec![(2, 1)]);
    assert!(deputies(&deliver(&mut n, 3, claim_of(2))).is_empty());
}

/// The deputy takes over from a coordinator that died: the grants it had
/// given itself are lost with their hops, and one stage of each is rerun
/// from the hop before (`Redo`), not restarted from the holder. A copy
/// from a node that is not the coordinator is not kept.
#[test]
fn a_dead_coordinators_own_grants_are_rerun_one_stage_by_its_deputy() {
    for from_coordinator in [true, false] {
        let mut n = started(Policy::Gwtf, 2, 2, &[1, 3], &[(0, 0), (10, 1), (30, 3)]);
        assert_eq!(n.group.coord(), Some(1));
        let from = if from_coordinator { 1 } else { 3 };
        let granted = vec![(mb(0, 0, 0), 10, 30), (mb(0, 0, 1), 10, 30)];
        deliver(&mut n, from, Msg::Deputy { iter: 0, granted });
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 1 });
        assert_eq!(n.group.coord(), Some(2));
        let redo: Vec<(NodeId, MbId)> = sends(&acts)
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Redo {
                    mb,
                    dead: 1,
                    next: 30,
                } => Some((to, *mb)),
                _ => None,
            })
            .collect();
        let restarts = sends(&acts)
            .iter()
            .filter(|(_, m)| matches!(m, Msg::Restart { .. }))
            .count();
        assert_eq!(restarts, 0);
        if from_coordinator {
            assert_eq!(redo, vec![(10, mb(0, 0, 0)), (10, mb(0, 0, 1))]);
            assert_eq!(n.coordinating.coord_iters[&0].lost.len(), 2);
        } else {
            assert!(redo.is_empty());
        }
    }
}

/// Coordinator 1's commit of iteration 0 to members 1, 2 and 3: holder 0's
/// microbatch 0 granted to 1, microbatch 1 to 3 (its digest off by one when
/// `wrong_digest`), and its epoch.
fn commit_by_1(wrong_digest: bool) -> (Msg, u64) {
    let mut all = BTreeMap::new();
    all.insert(mb(0, 0, 0), (1, 10, 30));
    all.insert(mb(0, 0, 1), (3, 10, 30));
    let epoch = (1 << 32) | 1;
    let commit = Msg::Commit {
        iter: 0,
        epoch,
        members: Arc::new(vec![1, 2, 3]),
        digest: commit_digest(&all, &BTreeSet::new()) ^ wrong_digest as u64,
        // Delivered to node 2, which owns none of it.
        mine: Arc::new(Vec::new()),
    };
    (commit, epoch)
}

/// The coordinator (1) dies while its commit's all-reduce runs; its deputy
/// (2) takes over. When the members' syncs and the copy of 1's own grants
/// are all the commit covered (its digest), the deputy applies the
/// all-reduce's result as is, 1's microbatch in it, nothing recomputed.
/// When they are not (a copy missed), or a member's part failed, 1's grant
/// is lost and one stage of it is rerun.
#[test]
fn a_successor_takes_over_its_dead_coordinators_commit_only_when_it_knows_all_of_it() {
    for case in ["whole", "partial", "failed"] {
        let mut n = started(Policy::Gwtf, 2, 2, &[1, 3], &[(0, 0), (10, 1), (30, 3)]);
        let (m0, m1) = (mb(0, 0, 0), mb(0, 0, 1));
        let granted = vec![(m0, 10, 30)];
        deliver(&mut n, 1, Msg::Deputy { iter: 0, granted });
        let (commit, epoch) = commit_by_1(case == "partial");
        let acts = deliver(&mut n, 1, commit);
        let agg = runs(&acts)[0].id;
        let redone = |acts: &[Action]| {
            sends(acts)
                .iter()
                .filter(|(_, m)| matches!(m, Msg::Redo { mb, .. } if *mb == m0))
                .count()
        };
        let now = n.now;
        let acts = n.handle(now, Input::PeerLost { peer: 1 });
        assert_eq!(
            redone(&acts),
            0,
            "{case}: the successor waits for the syncs"
        );
        if case == "failed" {
            let acts = deliver(&mut n, 3, Msg::AggFailed { iter: 0, epoch });
            assert_eq!(redone(&acts), 1, "{case}");
            continue;
        }
        let sync = Msg::Sync {
            iter: 0,
            granted: vec![(m1, 10, 30)],
            end: None,
        };
        let acts = deliver(&mut n, 3, sync);
        if case == "partial" {
            assert_eq!(redone(&acts), 1, "{case}: 1's grant is rerun");
            assert!(n.coordinating.coord_iters[&0].commit.is_none());
            continue;
        }
        assert_eq!(redone(&acts), 0);
        assert_eq!(n.coordinating.coord_iters[&0].epoch, epoch, "taken over");
        let done = Msg::AggDone {
            iter: 0,
            epoch,
            weights: 0,
        };
        deliver(&mut n, 3, done);
        let now = n.now;
        let acts = n.handle(now, Input::TaskDone { id: agg });
        let mbs = acts
            .iter()
            .find_map(|a| match a {
                Action::Event(Event::StageCommitted { mbs, .. }) => Some(mbs.clone()),
                _ => None,
            })
            .expect("applied");
        assert_eq!(*mbs, vec![(m0, 1), (m1, 3)]);
    }
}

/// The coordinator (1) dies after its commit's all-reduce ended. A member
/// (3) sees it die first: its sync and its `AggDone` reach the deputy (2)
/// before the deputy knows it coordinates. They are kept, and once it
/// takes over it applies the ring's result at once (before, the `AggDone`
/// was dropped, and the commit waited a whole `redo_timeout` for it, then
/// was abandoned: one stage of 1's grants rerun and a whole new ring).
#[test]
fn an_agg_done_that_comes_before_the_take_over_is_kept_for_it() {
    let mut n = started(Policy::Gwtf, 2, 2, &[1, 3], &[(0, 0), (10, 1), (30, 3)]);
    let (m0, m1) = (mb(0, 0, 0), mb(0, 0, 1));
    deliver(
        &mut n,
        1,
        Msg::Deputy {
            iter: 0,
            granted: vec![(m0, 10, 30)],
        },
    );
    let (commit, epoch) = commit_by_1(false);
    let acts = deliver(&mut n, 1, commit);
    let agg = runs(&acts)[0].id;
    let now = n.now;
    let acts = n.handle(now, Input::TaskDone { id: agg });
    assert!(sends(&acts)
        .iter()
        .any(|(to, m)| *to == 1 && matches!(m, Msg::AggDone { .. })));
    // Member 3 saw 1 die before 2 did.
    let sync = Msg::Sync {
        iter: 0,
        granted: vec![(m1, 10, 30)],
        end: None,
    };
    deliver(&mut n, 3, sync);
    let done = Msg::AggDone {
        iter: 0,
        epoch,
        weights: 0,
    };
    deliver(&mut n, 3, done);
    assert_eq!(n.group.coord(), Some(1));
    let now = n.now;
    let acts = n.handle(now, Input::PeerLost { peer: 1 });
    assert_eq!(n.group.coord(), Some(2));
    let applied = acts.iter().find_map(|a| match a {
        Action::Event(Event::StageCommitted { mbs, .. }) => Some(mbs.clone()),
        _ => None,
    });
    assert_eq!(applied.as_deref(), Some(&vec![(m0, 1), (m1, 3)]));
    let redone = sends(&acts)
        .iter()
        .filter(|(_, m)| matches!(m, Msg::Redo { .. } | Msg::Commit { .. }))
        .count();
    assert_eq!(redone, 0, "nothing rerun, no new ring");
}

/// The coordinator (1) dies during its commit's all-reduce, and a member's
/// part fails first: the member's `AggFailed` goes to 1, which is gone. The
/// member tells the successor (2) again when it syncs with it, and the
/// successor, when it is that member itself, tells itself: it reruns 1's
/// grant at once. (Before, the successor took the commit over as whole and
/// waited `redo_timeout` for an all-reduce that had failed: the demo's
/// swarm stood still 5 s after such a crash.)
#[test]
fn an_all_reduce_that_failed_before_the_take_over_is_told_to_the_successor() {
    let (m0, m1) = (mb(0, 0, 0), mb(0, 0, 1));
    let (commit, epoch) = commit_by_1(false);
    let fails = |n: &mut Node, commit: Msg| {
        let agg = runs(&deliver(n, 1, commit))[0].id;
        let now = n.now;
        let acts = n.handle(now, Input::TaskFailed { id: agg });
        assert!(sends(&acts)
            .iter()
            .any(|(to, m)| *to == 1 && matches!(m, Msg::AggFailed { .. })));
    };
    // A member (3): its sync to the successor says it again.
    let mut n = started(Policy::Gwtf, 3, 2, &[1, 2], &[(0, 0), (10, 1), (30, 3)]);
    fails(&mut n, commit.clone());
    let now = n.now;
    let acts = n.handle(now, Input::PeerLost { peer: 1 });
    assert_eq!(n.group.coord(), Some(2));
    let told = sends(&acts)
        .into_iter()
        .any(|(to, m)| to == 2 && matches!(m, Msg::AggFailed { iter: 0, epoch: e } if *e == epoch));
    assert!(told, "{acts:?}");
    // The successor (2) itself: 1's grant is rerun at once.
    let mut n = started(Policy::Gwtf, 2, 2, &[1, 3], &[(0, 0), (10, 1), (30, 3)]);
    let granted = vec![(m0, 10, 30)];
    deliver(&mut n, 1, Msg::Deputy { iter: 0, granted });
    fails(&mut n, commit);
    let sync = Msg::Sync {
        iter: 0,
        granted: vec![(m1, 10, 30)],
        end: None,
    };
    deliver(&mut n, 3, sync);
    let now = n.now;
    let acts = n.handle(now, Input::PeerLost { peer: 1 });
    assert_eq!(n.group.coord(), Some(2));
    let redone = sends(&acts)
        .iter()
        .any(|(_, m)| matches!(m, Msg::Redo { mb, .. } if *mb == m0));
    assert!(redone, "1's grant rerun at once: {acts:?}");
    assert!(
        n.coordinating.coord_iters[&0].commit.is_none(),
        "not taken over"
    );
}

/// The end of an iteration is passed along the pipeline once per heartbeat
/// period, but at once when another origin announces it: the holders'
/// coordinator died after the end and its successor announced it again;
/// the stages that are done tell the successor only when its end reaches
/// their coordinators (before, they told the dead one until the next
/// re-broadcast, 12 s later).
#[test]
fn an_end_from_a_new_origin_is_passed_on_at_once() {
    let mut n = started(Policy::Gwtf, 12, 2, &[11, 13], &[(0, 0), (30, 3)]);
    assert_eq!(n.group.coord(), Some(11));
    let end = |origin| Msg::EndIter {
        iter: 0,
        origin,
        holders: Arc::new(vec![0, 1]),
    };
    let passed = |acts: &[Action]| -> Vec<NodeId> {
        sends(acts)
            .into_iter()
            .filter(|(_, m)| matches!(m, Msg::EndIter { .. }))
            .map(|(to, _)| to)
            .collect()
    };
    assert_eq!(passed(&deliver(&mut n, 0, end(0))), vec![30, 11]);
    n.now += SEC;
    assert!(passed(&deliver(&mut n, 0, end(0))).is_empty(), "not news");
    assert_eq!(passed(&deliver(&mut n, 1, end(1))), vec![30, 11]);
    assert!(passed(&deliver(&mut n, 1, end(1))).is_empty());
}

/// A relay stage's lost contribution that only a restart from its holder
/// can redo (SWARM-plus restarts; GWTF when the node before is gone too)
/// is given up as soon as the holder is known gone (its connection
/// failed), not after four restarts nobody answers (four `redo_timeout`s):
/// the stage commits without it. One a live node can redo is not.
#[test]
fn a_contribution_only_a_gone_holder_could_redo_is_given_up_at_once() {
    for (policy, prev_dead) in [
        (Policy::SwarmPlus, false),
        (Policy::Gwtf, true),
        (Policy::Gwtf, false),
    ] {
        let mut n = started(policy, 1, 2, &[2, 3], &[(0, 0), (10, 1), (30, 3)]);
        deliver(&mut n, 2, claim_of(0));
        if prev_dead {
            let now = n.now;
            n.handle(now, Input::PeerLost { peer: 10 });
        }
        let now = n.now;
        n.handle(now, Input::PeerLost { peer: 2 });
        let ci = &n.coordinating.coord_iters[&0];
        assert!(ci.lost.contains_key(&mb(0, 0, 0)), "{policy:?}");
        let now = n.now + SEC;
        n.handle(now, Input::PeerLost { peer: 0 });
        let ci = &n.coordinating.coord_iters[&0];
        let given_up = ci.dropped.contains(&mb(0, 0, 0)) && !ci.lost.contains_key(&mb(0, 0, 0));
        let want = policy == Policy::SwarmPlus || prev_dead;
        assert_eq!(given_up, want, "{policy:?}, node before dead: {prev_dead}");
    }
}

/// SWARM's stage whose all-reduce failed (a member died in it) does not
/// commit again: once every live member reported, they step on what each
/// has, the dead one's contributions dropped (SWARM's averaging round fails for the group and
/// its optimizer steps with the local gradients, `collaborative.py`).
/// GWTF commits again, the dead member's contributions recomputed first.
#[test]
fn swarm_steps_without_the_failed_all_reduce() {
    for policy in [Policy::Swarm, Policy::Gwtf] {
        let mut n = started(policy, 1, 2, &[2, 3], &[(10, 1), (30, 3), (0, 0)]);
        let per = n.cfg.mb_per_iter;
        let open = Msg::StartIter {
            iter: 0,
            holders: Arc::new(vec![0]),
        };
        deliver(&mut n, 10, open);
        let (epoch, agg) = claims_until_committed(&mut n, per);
        // Member 3 dies in the reduce-scatter half; 2 reports the failure.
        let now = n.now;
        n.handle(now, Input::PeerLost { peer: 3 });
        let mut acts = deliver(&mut n, 2, Msg::AggFailed { iter: 0, epoch });
        if policy == Policy::Swarm {
            // Each live member reports: the coordinator's own part too.
            let stepped = |acts: &[Action]| {
                acts.iter()
                    .any(|a| matches!(a, Action::Event(Event::StageCommitted { .. })))
            };
            assert!(!stepped(&acts));
            let now = n.now;
            acts = n.handle(now, Input::TaskFailed { id: agg });
        }
        let committed = acts.iter().find_map(|a| match a {
            Action::Event(Event::StageCommitted { mbs, dropped, .. }) => {
                Some((mbs.len(), dropped.len()))
            }
            _ => None,
        });
        let applied = sends(&acts)
            .iter()
            .any(|(to, m)| *to == 2 && matches!(m, Msg::Applied { .. }));
        if policy == Policy::Swarm {
            // Member 3 had claimed the odd half.
            let half = (per / 2) as usize;
            assert_eq!(committed, Some((per as usize - half, half)), "{policy:?}");
            assert!(applied);
        } else {
            assert_eq!(committed, None, "{policy:?}");
            assert!(!applied);
            assert!(sends(&acts)
                .iter()
                .any(|(_, m)| matches!(m, Msg::Redo { .. })));
        }
    }
}

/// The commit tells each member which microbatches it counts as that
/// member's: exactly its grants (members 2 and 3 claimed every other one;
/// the coordinator, 1, claimed none).
#[test]
fn a_commit_tells_each_member_its_own_grants() {
    let (mut n, per) = opened();
    let mut mine = BTreeMap::new();
    for idx in 0..per {
        let acts = deliver(&mut n, 2 + (idx % 2) as NodeId, claim_of(idx));
        for (to, m) in sends(&acts) {
            if let Msg::Commit { mine: list, .. } = m {
                mine.insert(to, list.to_vec());
            }
        }
    }
    let owned = |m: u32| -> Vec<MbId> {
        (0..per)
            .filter(|i| i % 2 == m)
            .map(|i| mb(0, 0, i))
            .collect()
    };
    assert_eq!(mine.get(&2), Some(&owned(0)));
    assert_eq!(mine.get(&3), Some(&owned(1)));
    // Its own commit reaches it inside: it sums nothing.
    let (task, mine) = n.member.running(0).expect("its own commit");
    assert!(task.is_some() && mine == 0);
}

/// A grant's owner that left the member set without its death being
/// noticed here (a view change) is not left out of the all-reduce while
/// its microbatch is counted in: its grants are redone before the commit,
/// which then counts exactly the members that reduce (in a swarm, a
/// coordinator committed six microbatches and applied the mean of four).
#[test]
fn a_commit_counts_no_grant_of_a_node_outside_it() {
    let (mut n, per) = opened();
    for idx in 0..per - 1 {
        deliver(&mut n, 2 + (idx % 2) as NodeId, claim_of(idx));
    }
    // Member 3 leaves the set as a stale list would make it.
    n.group.members_mut().remove(&3);
    let acts = deliver(&mut n, 2, claim_of(per - 1));
    assert!(
        !sends(&acts)
            .iter()
            .any(|(_, m)| matches!(m, Msg::Commit { .. })),
        "committed with 3's grants and without 3"
    );
    let ci = &n.coordinating.coord_iters[&0];
    assert!(ci.granted.values().all(|g| g.0 != 3));
    assert!(!ci.lost.is_empty(), "3's grants are to be redone");
    assert!(sends(&acts)
        .iter()
        .any(|(_, m)| matches!(m, Msg::Redo { .. } | Msg::Restart { .. })));
}

/// The coordinator (1) falls silent right after its commit's all-reduce
/// ended (its link cut, or it was paused) instead of its connection
/// breaking: its deputy (2) takes over once the silence is sure, and with
/// the member's sync and `AggDone` it applies the ring's result as is, the
/// commit that 1 may have applied before it fell silent: no replica holds
/// other weights for that iteration.
#[test]
fn a_coordinator_that_falls_silent_after_its_all_reduce_has_its_commit_applied_as_is() {
    let mut cfg = (*config(Policy::Gwtf)).clone();
    cfg.fence_on_pause = true;
    let cfg = Arc::new(cfg);
    let mut n = started_with(cfg.clone(), 2, 2, &[1, 3], &[(0, 0), (10, 1), (30, 3)]);
    let (m0, m1) = (mb(0, 0, 0), mb(0, 0, 1));
    let granted = vec![(m0, 10, 30)];
    deliver(&mut n, 1, Msg::Deputy { iter: 0, granted });
    let (commit, epoch) = commit_by_1(false);
    let acts = deliver(&mut n, 1, commit);
    let agg = runs(&acts)[0].id;
    let now = n.now;
    n.handle(now, Input::TaskDone { id: agg });
    // 1 says nothing more; a neighbour is heard every tick.
    let mut t = n.now;
    let mut all = Vec::new();
    for _ in 0..4 * cfg.suspect_ticks {
        t += cfg.tick;
        deliver(&mut n, 30, Msg::QueryFlows);
        all.extend(n.on_timeout(t));
        if n.group.coord() == Some(2) {
            break;
        }
    }
    assert_eq!(n.group.coord(), Some(2), "the deputy took over");
    let sync = Msg::Sync {
        iter: 0,
        granted: vec![(m1, 10, 30)],
        end: None,
    };
    all.extend(deliver(&mut n, 3, sync));
    let done = Msg::AggDone {
        iter: 0,
        epoch,
        weights: 0,
    };
    all.extend(deliver(&mut n, 3, done));
    for _ in 0..2 * cfg.heartbeat_ticks {
        t += cfg.tick;
        deliver(&mut n, 30, Msg::QueryFlows);
        all.extend(n.on_timeout(t));
    }
    let committed: Vec<_> = (all.iter())
        .filter_map(|a| match a {
            Action::Event(Event::StageCommitted { mbs, .. }) => Some(mbs.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(committed.len(), 1, "{committed:?}");
    assert_eq!(*committed[0], vec![(m0, 1), (m1, 3)], "1's commit, as is");
}

/// A relay that coordinates a group of one and holds no grant of an
/// ended iteration commits nothing once every holder of it is gone: such
/// a commit would apply nothing and tell nobody, only give up the
/// microbatches. In a swarm, a relay behind a 1 Mbit/s link that had lost
/// its connections to its stage's group committed, after the holders
/// finished and left, every iteration the group had committed before it
/// with all its microbatches given up. With a holder alive the commit is
/// not held back (that holder needs the stage's word to end the
/// iteration).
#[test]
fn a_relay_commits_nothing_for_holders_all_gone() {
    for alive_holder in [false, true] {
        let mut n = started(Policy::Gwtf, 1, 2, &[], &[(0, 0), (5, 0), (10, 1), (30, 3)]);
        let holders = Arc::new(vec![0, 5]);
        let open = Msg::StartIter {
            iter: 0,
            holders: holders.clone(),
        };
        deliver(&mut n, 10, open);
        let end = Msg::EndIter {
            iter: 0,
            origin: 0,
            holders,
        };
        deliver(&mut n, 10, end);
        let now = n.now;
        n.handle(now, Input::PeerLost { peer: 0 });
        if !alive_holder {
            let now = n.now;
            n.handle(now, Input::PeerLost { peer: 5 });
        }
        let mut t = n.now;
        for _ in 0..2000 {
            t += n.cfg.tick;
            n.on_timeout(t);
        }
        assert_eq!(n.nobody_to_commit_for(0), !alive_holder);
        // The commit (its all-reduce not run here, so nothing is applied).
        let committed = n.coordinating.coord_iters[&0].commit.is_some();
        assert_eq!(committed, alive_holder, "a holder alive: {alive_holder}");
    }
}

/// A commit whose all-reduce a live member has not reported a heartbeat
/// period later goes to that member again, same epoch (the commit or the
/// report may have been lost): not before, and not to a member that
/// reported. A member asked again answers with its result once its
/// all-reduce ended, and stays quiet while it runs.
#[test]
fn a_commit_goes_again_to_a_member_that_did_not_report() {
    let (mut n, per) = opened();
    let (epoch, _) = claims_until_committed(&mut n, per);
    let done = |weights| Msg::AggDone {
        iter: 0,
        epoch,
        weights,
    };
    deliver(&mut n, 2, done(7));
    let again = |acts: &[Action]| -> Vec<NodeId> {
        (sends(acts).into_iter())
            .filter_map(|(to, m)| match m {
                Msg::Commit {
                    iter: 0, epoch: e, ..
                } if *e == epoch => Some(to),
                _ => None,
            })
            .collect()
    };
    let period = n.cfg.heartbeat_ticks as Time * n.cfg.tick;
    let mut t = n.now;
    let end = t + period - n.cfg.tick;
    let mut sent = Vec::new();
    // Members 2 and 3 stay alive (heard every tick).
    while t < end {
        t += n.cfg.tick;
        deliver(&mut n, 2, Msg::QueryFlows);
        deliver(&mut n, 3, Msg::QueryFlows);
        sent.extend(again(&n.on_timeout(t)));
    }
    assert!(sent.is_empty(), "before a heartbeat period: {sent:?}");
    for _ in 0..2 {
        t += n.cfg.tick;
        deliver(&mut n, 2, Msg::QueryFlows);
        deliver(&mut n, 3, Msg::QueryFlows);
        sent.extend(again(&n.on_timeout(t)));
    }
    // Member 3, and this node itself (its own all-reduce still runs).
    sent.retain(|&m| m != 1);
    assert_eq!(sent, vec![3]);

    // The member's side: member 3 of coordinator 1, asked again while its
    // all-reduce runs, says nothing; once done, it tells its result again.
    let mut m = started(Policy::Gwtf, 3, 2, &[1, 2], &[(10, 1)]);
    let commit = Msg::Commit {
        iter: 0,
        epoch,
        members: Arc::new(vec![1, 2, 3]),
        digest: 5,
        mine: Arc::new(Vec::new()),
    };
    let acts = deliver(&mut m, 1, commit.clone());
    let task = runs(&acts)
        .iter()
        .find(|t| matches!(t.kind, TaskKind::Aggregate { .. }))
        .expect("an aggregate task")
        .id;
    let reports = |acts: &[Action]| {
        (sends(acts).into_iter())
            .filter(|(to, m)| *to == 1 && matches!(m, Msg::AggDone { .. }))
            .count()
    };
    assert_eq!(reports(&deliver(&mut m, 1, commit.clone())), 0);
    let t = m.now;
    assert_eq!(reports(&m.handle(t, Input::TaskDone { id: task })), 1);
    assert_eq!(reports(&deliver(&mut m, 1, commit)), 1);
}

/// Coordinator 1 of stage 2 with members 2, 3 and 4, leaving stragglers
/// out (`Config::leave_out_stragglers` as `on`), its weights holding 5
/// updates (iteration 4 applied), iteration 5 open, and the links it
/// measured: 2.5 MB/s to everyone, 4 at `bw_4`.
fn opened_with_straggler(on: bool, bw_4: f64) -> (Node, u32) {
    let mut cfg = (*config(Policy::Gwtf)).clone();
    cfg.leave_out_stragglers = on;
    cfg.stage_state_bytes[2] = 4 << 20;
    let mut n = started_with(Arc::new(cfg), 1, 2, &[2, 3, 4], &[(10, 1)]);
    n.iters.downloaded((4, 9));
    for (p, bw) in [(2, 2.5e6), (3, 2.5e6), (10, 2.5e6), (4, bw_4)] {
        n.learn(p, if p == 10 { 1 } else { 2 });
        let v = n.peers.get_mut(&p).unwrap();
        (v.lat, v.bw) = (Some(0.01), Some(bw));
    }
    let open = Msg::StartIter {
        iter: 5,
        holders: Arc::new(vec![0]),
    };
    deliver(&mut n, 10, open);
    let per = n.cfg.mb_per_iter;
    (n, per)
}

/// The first `claimants` of members 2, 3 and 4 claim all of iteration 5's
/// microbatches in turn: the members of the commit sent, and the `LeftOut`
/// events raised.
fn commit_of_5(n: &mut Node, per: u32, claimants: u32) -> (Vec<NodeId>, Vec<Event>) {
    let (mut members, mut left_out) = (None, Vec::new());
    for idx in 0..per {
        let claim = Msg::Claim {
            iter: 5,
            mb: mb(0, 5, idx),
            prev: 10,
            next: 30,
        };
        let acts = deliver(n, 2 + (idx % claimants) as NodeId, claim);
        for a in &acts {
            match a {
                Action::Send {
                    msg: Msg::Commit { members: m, .. },
                    ..
                } => members = Some(m.to_vec()),
                Action::Event(e @ Event::LeftOut { .. }) => left_out.push(e.clone()),
                _ => {}
            }
        }
    }
    let mut members = members.expect("committed");
    members.sort();
    (members, left_out)
}

/// A member with no grant behind a link 20 times slower than the
/// coordinator's others (its share of the all-reduce: 8 s) is left out;
/// one twice as slow is waited for.
#[test]
fn a_member_far_slower_than_the_others_is_left_out_while_it_has_no_grant() {
    let (mut n, per) = opened_with_straggler(true, 1.25e5);
    let (members, left_out) = commit_of_5(&mut n, per, 2);
    assert_eq!(members, vec![1, 2, 3]);
    assert_eq!(
        left_out,
        vec![Event::LeftOut {
            stage: 2,
            iter: 5,
            slow: vec![4]
        }]
    );
    let (mut n, per) = opened_with_straggler(true, 1.25e6);
    assert_eq!(commit_of_5(&mut n, per, 2), (vec![1, 2, 3, 4], vec![]));
    // Off (the simulator): waited for.
    let (mut n, per) = opened_with_straggler(false, 1.25e5);
    assert_eq!(commit_of_5(&mut n, per, 2), (vec![1, 2, 3, 4], vec![]));
}

/// A slow member with grants is in the commit: its gradients are summed.
#[test]
fn a_slow_member_with_grants_is_waited_for() {
    let (mut n, per) = opened_with_straggler(true, 1.25e5);
    assert_eq!(commit_of_5(&mut n, per, 3), (vec![1, 2, 3, 4], vec![]));
}

/// A member left out of a commit holds weights without its update: it
/// serves no state, and its heartbeats tell fewer updates, until the
/// state it downloads again comes, or its runtime applied the updates
/// after that state from the means it kept.
#[test]
fn a_member_left_out_holds_fewer_updates_until_it_downloads_the_state() {
    let mut cfg = (*config(Policy::Gwtf)).clone();
    cfg.leave_out_stragglers = true;
    let mut n = started_with(Arc::new(cfg), 4, 2, &[1, 2], &[(10, 1)]);
    n.iters.downloaded((4, 9));
    deliver(
        &mut n,
        1,
        Msg::Applied {
            iter: 5,
            version: 11,
        },
    );
    assert_eq!((n.iters.updates(), n.iters.gap()), (5, true));
    let acts = deliver(&mut n, 7, Msg::StateRequest);
    assert!(
        matches!(sends(&acts)[..], [(7, Msg::Heartbeat { updates: 5, .. })]),
        "{acts:?}"
    );
    let acts = n.handle(
        n.now,
        Input::Message {
            from: 1,
            msg: Msg::StateResponse {
                version: (5, 11),
                members: Arc::new(vec![1, 2, 4]),
                bytes: 0,
                coord: 1,
            },
        },
    );
    assert!(sends(&acts).is_empty(), "{acts:?}");
    assert_eq!((n.iters.updates(), n.iters.gap()), (6, false));
    // Left out again; the state that comes is older than the update,
    // which the runtime applies from the mean it kept.
    deliver(
        &mut n,
        1,
        Msg::Applied {
            iter: 6,
            version: 12,
        },
    );
    assert_eq!((n.iters.updates(), n.iters.gap()), (6, true));
    n.caught_up(6);
    assert_eq!((n.iters.updates(), n.iters.gap()), (7, false));
    let acts = deliver(&mut n, 7, Msg::StateRequest);
    assert!(
        matches!(
            sends(&acts)[..],
            [(
                7,
                Msg::StateResponse {
                    version: (6, 12),
                    ..
                }
            )]
        ),
        "{acts:?}"
    );
}
