"""A swarm of Python peers training a PyTorch model equals the same model
trained in one process on the same microbatches."""
import gwtf
import toy

ITERATIONS = 8


def test_a_python_swarm_trains_as_one_process_does():
    seen = {"forward": 0, "zero_copy": 0}

    def check(trainer, task):
        # Inputs are views of the frames they came in (no copy).
        if task.kind == gwtf.TaskKind.FORWARD:
            seen["forward"] += 1
            t = task.input_tensor()
            if t.data_ptr() == task.input_address and t.numel() * 4 == task.output_bytes:
                seen["zero_copy"] += 1

    swarm = toy.Swarm(holders=2, relay_stages=2, per_stage=2, microbatches=3, check=check)
    try:
        swarm.wait_iterations(ITERATIONS)
    finally:
        swarm.close()
    assert not swarm.errors, swarm.errors
    ref = compare(swarm, ITERATIONS)
    # Loss falls.
    assert ref[(1, ITERATIONS - 1)] < 0.8 * ref[(1, 0)]
    # Every stage's replicas agree after every update both applied.
    agreed = 0
    for (stage, it), by_node in swarm.digests.items():
        assert len(set(by_node.values())) == 1, f"stage {stage} iteration {it}: {by_node}"
        agreed += len(by_node) > 1
    assert agreed >= 3 * (ITERATIONS - 2), swarm.digests.keys()
    assert seen["forward"] > 0 and seen["zero_copy"] == seen["forward"], seen


def compare(swarm, iterations):
    """The largest relative loss difference against the reference (each
    holder, each iteration), checked against 1e-5."""
    ref = toy.reference(2, swarm.relay_stages, swarm.microbatches, iterations)
    worst = 0.0
    for (h, it), want in ref.items():
        got = swarm.losses[(h, it)]
        diff = abs(got - want) / abs(want)
        assert diff <= 1e-5, f"holder {h} iteration {it}: {got} vs {want}"
        worst = max(worst, diff)
    print(f"largest relative loss difference over {iterations} iterations: {worst:.2e}")
    return ref


def test_relays_killed_and_joiners_lose_nothing():
    iterations = 16
    swarm = toy.Swarm(holders=2, relay_stages=2, per_stage=3, microbatches=3)
    try:
        for at, act in [(2, ("kill", 11)), (4, ("join", 91)), (6, ("kill", 22)),
                        (8, ("kill", 12)), (9, ("join", 92)), (11, ("kill", 21))]:
            swarm.wait_iterations(at)
            getattr(swarm, act[0])(act[1])
        swarm.wait_iterations(iterations)
        # Each joiner trains (it took a stage and applied an update) before
        # the run ends; the swarm trains on meanwhile.
        swarm.wait_for(lambda: all(any(j in by for by in swarm.digests.values())
                                   for j in swarm.joined), "every joiner applied an update")
        iterations = swarm.iteration() + 1
    finally:
        swarm.close()
    assert not swarm.errors, swarm.errors
    ref = compare(swarm, iterations)
    assert ref[(1, iterations - 1)] < 0.7 * ref[(1, 0)]
    for (stage, it), by_node in swarm.digests.items():
        assert len(set(by_node.values())) == 1, f"stage {stage} iteration {it}: {by_node}"
    print(f"{iterations} iterations, killed {swarm.killed}, joined {swarm.joined}")
