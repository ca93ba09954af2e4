//! An emptied stage restored from the copies the data holders keep
//! (`gwtf node --keep-states-every K`): `gwtf node` processes on loopback,
//! the last node of a stage SIGKILLed, a node that joins. The joiner takes
//! the freshest copy a holder offers (`stage_restored`), whose weights are
//! those that stage's replica printed for that iteration, and training goes
//! on from there with a loss close to the uninterrupted run's.
mod common;

use common::swarm_procs::{check_run, llama_tiny_args, llama_tiny_reference, Seen, Swarm};
use std::time::Instant;

const MB: u32 = 3;
const SEED: u64 = 5;
const K: u64 = 5;

fn reference(iterations: u32) -> Vec<f32> {
    llama_tiny_reference(iterations, MB, SEED)
}

/// Killed right after the holders kept a copy of iteration 9: most often
/// the copy holds the stage's last update, and the run goes on as if
/// nothing happened.
#[test]
fn a_stage_emptied_right_after_a_copy_is_restored_from_it() {
    restored_after(|ev| {
        ev.iter()
            .any(|e| e.event() == "copy_kept" && e.u("stage") == 2 && e.u("iteration") >= 9)
    });
}

/// Killed after its update of iteration 12, when the freshest copy is of
/// iteration 9: the restored weights miss updates, which the other stages
/// made, and the loss stays close to the uninterrupted run's.
#[test]
fn a_stage_emptied_between_copies_is_restored_from_an_older_one() {
    restored_after(|ev| {
        ev.iter()
            .any(|e| e.event() == "copy_kept" && e.u("stage") == 2 && e.u("iteration") >= 9)
            && ev
                .iter()
                .any(|e| e.node == 21 && e.event() == "applied" && e.u("iteration") >= 12)
    });
}

/// Node 31 joins while stage 2 is empty, and the run goes to its end:
/// every event, the index of the first after the join, and when it
/// joined. No stage restarted from the initial weights.
fn join_and_finish(swarm: &mut Swarm) -> (Vec<Seen>, usize, Instant) {
    let joined_at = Instant::now();
    let joined = swarm.count();
    swarm.join(31, 1, &[]);
    let ev = swarm.until_done(&[1, 2]);
    let restarted: Vec<_> = (ev.iter().skip(joined))
        .filter(|e| e.event() == "stage_restarted")
        .collect();
    assert!(restarted.is_empty(), "restarted instead: {restarted:?}");
    (ev, joined, joined_at)
}

/// Stage 2's only node is killed once `kill_when` holds (after the holders
/// kept copies of its state); the node that joins restores the stage from
/// the freshest copy (of an iteration at most K before the last update the
/// stage made), with the weights digest the killed node printed for that
/// iteration, and no stage restarts from the initial weights.
fn restored_after(kill_when: impl FnMut(&[Seen]) -> bool) {
    const LONG: u32 = 24;
    let args = llama_tiny_args(LONG, MB, SEED, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let layout = vec![(1, 0), (2, 0), (11, 1), (12, 1), (21, 2)];
    let keep: &[&str] = &["--keep-states-every", "5"];
    let mut swarm = Swarm::start(&layout, &args, &[(1, keep), (2, keep)]);
    swarm.until("copies of stage 2 kept", kill_when);
    swarm.kill(21);
    let ev = swarm.until("stage 2 reported empty by its neighbours", |ev| {
        [1, 2, 11, 12].iter().all(|n| {
            ev.iter()
                .any(|e| e.node == *n && e.event() == "stage_empty" && e.u("stage") == 2)
        })
    });
    let last_final = (ev.iter())
        .filter(|e| e.event() == "iteration")
        .map(|e| e.u("iteration"))
        .max()
        .unwrap();
    // The last update stage 2 made before it emptied.
    let j = (ev.iter())
        .filter(|e| e.node == 21 && e.event() == "applied" && e.u("stage") == 2)
        .map(|e| e.u("iteration"))
        .max()
        .unwrap();
    let (ev, joined, joined_at) = join_and_finish(&mut swarm);
    let after: Vec<_> = ev.iter().skip(joined).collect();
    let restored = (after.iter())
        .find(|e| e.node == 31 && e.event() == "stage_restored")
        .expect("the joiner did not say it restored stage 2");
    let (it, from) = (restored.u("iteration"), restored.u("from"));
    assert_eq!(restored.u("stage"), 2, "{:?}", restored.v);
    assert!([1, 2].contains(&from), "{:?}", restored.v);
    assert!(
        it + K >= j && it <= j,
        "restored from iteration {it}, the stage's last update was {j}"
    );
    let download = (after.iter())
        .find(|e| e.node == 31 && e.event() == "state_download" && e.u("from") == from)
        .expect("no download of the copy");
    let printed = (ev.iter())
        .find(|e| {
            e.node == 21 && e.event() == "applied" && e.u("stage") == 2 && e.u("iteration") == it
        })
        .expect("the killed node printed no digest for the copy's iteration");
    assert_eq!(
        download.s("weights_sha256"),
        printed.s("weights_sha256"),
        "the copy imported is not the state stage 2 held at iteration {it}"
    );
    // The download is timed from the request for the copy to the verified
    // state (it read 0 ms when only the request for a member's state was).
    let ms = download.v["ms"].as_f64().unwrap_or(f64::NAN);
    assert!(ms > 0.0, "the copy's download timed at {ms} ms");
    let resumed = (after.iter())
        .find(|e| e.event() == "iteration" && e.u("iteration") > last_final)
        .expect("no iteration final after the restore");
    eprintln!(
        "stage 2 emptied after its update of iteration {j}; restored from holder {from}'s \
         copy of iteration {it} ({} bytes in {:.1} ms); first iteration final {:.2} s after \
         the joiner started",
        download.u("bytes"),
        download.v["ms"].as_f64().unwrap_or(f64::NAN),
        resumed.at.duration_since(joined_at).as_secs_f64()
    );
    // The updates the killed node made after the iteration the restore
    // stands for are lost with it: the stage makes them again (another
    // commit), so they are no replica's to compare.
    let applied = restored.u("applied");
    let kept: Vec<_> = (ev.iter())
        .filter(|e| !(e.node == 21 && e.event() == "applied" && e.u("iteration") > applied))
        .cloned()
        .collect();
    let losses = check_run(&kept, LONG, MB, 2);
    let want = reference(LONG);
    // The first iteration whose forwards ran on the restored weights (the
    // killed node ran every forward of the iterations it applied).
    let r = (applied.max(j) + 1) as usize;
    let allowed = (want[j as usize - K as usize] - want[j as usize]).abs() as f64;
    let off = (losses[r] - want[r] as f64).abs();
    eprintln!(
        "loss of iteration {r}, the first on the restored weights: {:.4}, uninterrupted {:.4} \
         (off by {off:.4}; the reference moved {allowed:.4} from {} to {j})",
        losses[r],
        want[r],
        j - K
    );
    assert!(off <= allowed, "{losses:?} against {want:?}");
    assert!(losses[LONG as usize - 1] < losses[0], "{losses:?}");
}

/// A swarm of `iterations` with no copies kept (no `--keep-states-every`)
/// whose stage 2's only node was killed after its update of iteration 8,
/// once both stage-1 nodes said stage 2 is empty.
fn stage_2_emptied_with_no_copy(iterations: u32) -> Swarm {
    let args = llama_tiny_args(iterations, MB, SEED, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let layout = vec![(1, 0), (2, 0), (11, 1), (12, 1), (21, 2)];
    let mut swarm = Swarm::start(&layout, &args, &[]);
    swarm.until("stage 2's update of iteration 8", |ev| {
        ev.iter()
            .any(|e| e.node == 21 && e.event() == "applied" && e.u("iteration") >= 8)
    });
    swarm.kill(21);
    swarm.until("stage 2 reported empty by its neighbours", |ev| {
        [11, 12].iter().all(|n| {
            ev.iter()
                .any(|e| e.node == *n && e.event() == "stage_empty" && e.u("stage") == 2)
        })
    });
    swarm
}

/// With no copy kept (no `--keep-states-every`), the emptied stage is
/// rebuilt from its neighbouring relay stage's weights (CheckFree; stage
/// 2's only relay neighbour is stage 1, whose block has the same shapes),
/// not restarted from the initial weights, and training goes on.
#[test]
fn a_stage_emptied_with_no_copy_kept_is_rebuilt_from_its_neighbour() {
    const LONG: u32 = 20;
    let mut swarm = stage_2_emptied_with_no_copy(LONG);
    let (ev, joined, joined_at) = join_and_finish(&mut swarm);
    let after: Vec<_> = ev.iter().skip(joined).collect();
    let rebuilt = (after.iter())
        .find(|e| e.node == 31 && e.event() == "stage_rebuilt")
        .expect("the joiner did not say it rebuilt stage 2");
    assert_eq!(rebuilt.u("stage"), 2, "{:?}", rebuilt.v);
    assert_eq!(rebuilt.s("source"), "checkfree", "{:?}", rebuilt.v);
    assert_eq!(rebuilt.u("averaged"), 1, "{:?}", rebuilt.v);
    let from = rebuilt.v["from"].as_array().expect("from").clone();
    assert!(
        from.len() == 1 && [11, 12].contains(&from[0].as_u64().unwrap_or(0)),
        "{:?}",
        rebuilt.v
    );
    let applied = rebuilt.u("applied");
    let resumed = (after.iter())
        .find(|e| e.event() == "iteration" && e.u("iteration") > applied)
        .expect("no iteration final after the rebuild");
    // The killed node's updates after the one the rebuild stands for are
    // made again by the stage: no replica's to compare.
    let kept: Vec<_> = (ev.iter())
        .filter(|e| !(e.node == 21 && e.event() == "applied" && e.u("iteration") > applied))
        .cloned()
        .collect();
    let losses = check_run(&kept, LONG, MB, 2);
    let want = reference(LONG);
    let r = applied as usize + 1;
    eprintln!(
        "stage 2 rebuilt from node {} standing for iteration {applied}; first iteration final \
         {:.2} s after the joiner started; loss of iteration {r}: {:.4}, uninterrupted {:.4}; \
         last iteration: {:.4}, uninterrupted {:.4}",
        from[0],
        resumed.at.duration_since(joined_at).as_secs_f64(),
        losses[r],
        want[r],
        losses[LONG as usize - 1],
        want[LONG as usize - 1],
    );
    eprintln!("losses after the rebuild: {:?}", &losses[r..]);
    eprintln!("uninterrupted:            {:?}", &want[r..]);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[LONG as usize - 1] < losses[0], "{losses:?}");
}

/// Two nodes join at once while stage 2 is empty and no copy is kept, and
/// the one behind is paused for 1.5 s in the middle of its take-up (once
/// the other started rebuilding the stage): it decided the stage was
/// empty, and it serves it, from its own average of the neighbour's
/// weights, long after the other did. Two groups of stage 2 now hold the
/// same number of updates in other weights. Before, the later one
/// introduced itself, was admitted, and followed the other's member list
/// with its own weights: a member whose weights no digest comparison
/// looked at while it owned no grant (replicas of stage 2 printed two
/// digests per iteration). Now the larger coordinator gives way (its
/// heartbeats carry the weights version) and downloads the other's
/// state: every stage-iteration has one digest (`check_run`), and the two
/// take-ups end in one group. When both averaged the very same weights
/// (stage 1 made no update in between), the two rebuilds hold the same
/// weights under the same version: the groups merge with nothing to fetch.
#[test]
fn two_joiners_that_take_up_one_emptied_stage_end_in_one_group() {
    const LONG: u32 = 100;
    let mut swarm = stage_2_emptied_with_no_copy(LONG);
    let joined = swarm.count();
    swarm.join(31, 1, &[]);
    // Out of step: node 32 decides a little after node 31.
    std::thread::sleep(std::time::Duration::from_millis(30));
    swarm.join(32, 2, &[]);
    let rebuilding = |e: &Seen| {
        [31, 32].contains(&e.node)
            && (e.event() == "active" || (e.event() == "work" && e.s("kind") == "average_states"))
    };
    let ev = swarm.until("a joiner taking stage 2 up", |ev| {
        ev.iter().skip(joined).any(rebuilding)
    });
    let first = (ev.iter().skip(joined))
        .find(|e| rebuilding(e))
        .map_or(31, |e| e.node);
    let other = if first == 31 { 32 } else { 31 };
    swarm.pause(other, std::time::Duration::from_millis(1500));
    let ev = swarm.until_done(&[1, 2]);
    let after: Vec<_> = ev.iter().skip(joined).collect();
    let takes_up = |e: &&&Seen| {
        [31, 32].contains(&e.node)
            && matches!(
                e.event(),
                "stage_rebuilt" | "stage_restored" | "stage_restarted"
            )
    };
    let took_up: Vec<&&Seen> = after.iter().filter(takes_up).collect();
    eprintln!(
        "node {first} took stage 2 up first, node {other} was paused; took it up: {:?}",
        took_up.iter().map(|e| e.node).collect::<Vec<_>>()
    );
    assert!(!took_up.is_empty(), "nobody took stage 2 up");
    if let [earlier, later] = took_up[..] {
        // Both served it: one of them downloads the other's state after,
        // unless both averaged the same neighbour's weights (stage 1 made
        // no update in between): the same weights, under the same
        // version, and their groups merge as one with nothing to fetch.
        let same = !earlier.s("weights_sha256").is_empty()
            && earlier.s("weights_sha256") == later.s("weights_sha256");
        let merged = (after.iter()).any(|e| {
            e.at > later.at
                && e.event() == "state_download"
                && [31, 32].contains(&e.node)
                && [31, 32].contains(&(e.u("from") as u32))
        });
        eprintln!("the two took it up with the same weights: {same}; one downloaded the other's: {merged}");
        assert!(same || merged, "two groups of stage 2: {}", swarm.tail(&ev));
    }
    // The killed node's updates after the one the take-up stands for are
    // made again by the stage: no replica's to compare.
    let applied = took_up.iter().map(|e| e.u("applied")).min().unwrap_or(0);
    let kept: Vec<_> = (ev.iter())
        .filter(|e| !(e.node == 21 && e.event() == "applied" && e.u("iteration") > applied))
        .cloned()
        .collect();
    let losses = check_run(&kept, LONG, MB, 2);
    assert!(losses[LONG as usize - 1] < losses[0], "{losses:?}");
}
