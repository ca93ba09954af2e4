"""CheckFree from Python: a stage emptied with no copy of its state kept
anywhere is rebuilt by a joiner from its neighbour's state (`StageTrainer`
answers the AVERAGE_STATES task), and the swarm trains on through it."""
import torch

import gwtf
from gwtf.torch_stage import StageTrainer, _packed_states, _parse_state
import toy


def test_an_emptied_stage_is_rebuilt_from_its_neighbour(monkeypatch):
    averaged = []  # (states given, states averaged, the rebuilt parameters)
    stages = []  # the stage of each state given
    original = StageTrainer._average

    def average(self, task):
        # Copied: the task's input is valid only until it is answered.
        packed = _packed_states(task.input)
        stages.extend(st for st, _ in packed)
        given = [[t.clone() for t in _parse_state(s)[0]] for _, s in packed]
        n = original(self, task)
        averaged.append((given, n, [p.detach().clone() for p in self.params]))
        return n

    monkeypatch.setattr(StageTrainer, "_average", average)
    events = {"rebuilt": [], "restarted": [], "init": 0}

    def check(trainer, task):
        if task.kind == gwtf.TaskKind.EVENT_STAGE_REBUILT:
            events["rebuilt"].append((task.stage, task.microbatches, task.weights))
        elif task.kind == gwtf.TaskKind.EVENT_STAGE_RESTARTED:
            events["restarted"].append(task.message)
        elif task.kind == gwtf.TaskKind.INIT_STATE:
            events["init"] += 1

    # No holder keeps a copy of any stage's state (keep_states_every = 0).
    swarm = toy.Swarm(holders=1, relay_stages=2, per_stage=1, microbatches=2, check=check)
    try:
        swarm.wait_iterations(2)
        swarm.leave(21)  # stage 2's only member
        before = swarm.iteration()
        swarm.join(91, rebuild_from_neighbours=True)
        swarm.wait_for(lambda: events["rebuilt"], "the joiner rebuilt stage 2")
        swarm.wait_for(lambda: any(91 in by for (st, _), by in swarm.digests.items() if st == 2),
                       "the joiner applied an update after the rebuild")
        swarm.wait_iterations(before + 3)
    finally:
        swarm.close()
    assert not swarm.errors, swarm.errors
    assert not events["restarted"] and events["init"] == 0, events
    assert len(averaged) == 1, averaged
    given, n, rebuilt = averaged[0]
    # Stage 1's state (the same shapes) was given and averaged: the joiner's
    # parameters are stage 1's as it exported them.
    assert n == 1 and stages == [1], (n, stages)
    for got, want in zip(rebuilt, given[0]):
        assert torch.equal(got.reshape(-1), want.reshape(-1))
    stage, count, digest = events["rebuilt"][0]
    assert (stage, count) == (2, 1), events["rebuilt"]
    assert len(digest) == 32
    # Training went on (iterations before + 1 and before + 2 at least),
    # every loss finite.
    losses = [v for (h, it), v in swarm.losses.items() if it > before]
    assert len(losses) >= 2 and all(v == v and abs(v) < 1e6 for v in losses), swarm.losses
