"""The binding itself: bad input answered by exceptions that carry the
library's status and message, answers checked, and no copies."""
import struct

import pytest
import torch

import gwtf
import toy
from gwtf.torch_stage import StageTrainer, state_parameters


def options(**over):
    o = dict(role=gwtf.Role.RELAY, stage=1, swarm_key=toy.KEY, relay_stages=1,
             activation_bytes=[256, 256], state_bytes=[0, 4096],
             bootstrap=[gwtf.Contact("127.0.0.1:9", 5, 0)], listen="127.0.0.1:0")
    o.update(over)
    return o


@pytest.mark.parametrize("bad, says", [
    (dict(relay_stages=0, activation_bytes=[256], state_bytes=[0]), "relay"),
    (dict(swarm_key=b"short"), "key"),
    (dict(stage=5), "stage"),
    (dict(bootstrap=[]), "bootstrap"),
    (dict(listen="not an address"), "address"),
    (dict(role=gwtf.Role.RELAY, save_every=5), "holder"),
    (dict(activation_bytes=[256, 2 << 30]), ""),
])
def test_bad_options_raise_invalid_argument_with_the_library_message(bad, says):
    with pytest.raises(gwtf.GwtfError) as e:
        gwtf.Peer(**options(**bad))
    assert e.value.status in (gwtf.InvalidArgument.status, gwtf.LimitExceeded.status)
    assert isinstance(e.value, ValueError)
    assert says in str(e.value).lower(), str(e.value)


def test_sizes_of_the_wrong_count_are_refused_before_the_library():
    with pytest.raises(gwtf.InvalidArgument, match="2 sizes"):
        gwtf.Peer(**options(activation_bytes=[256]))


def test_a_role_that_is_not_one_is_refused():
    with pytest.raises(ValueError):
        gwtf.Peer(**options(role=7))


def test_frames_are_written_in_place_and_answers_are_checked():
    # A holder and a relay; the relay's first forward is answered wrongly
    # several ways (each refused, the task kept), then rightly.
    a, b = toy.free_addr(), toy.free_addr()
    boot = [gwtf.Contact(a, 1, 0), gwtf.Contact(b, 2, 1)]
    act = 4 * toy.B * toy.D
    common = dict(swarm_key=toy.KEY, relay_stages=1, activation_bytes=[act, act],
                  state_bytes=[0, toy.state_bytes()], bootstrap=boot, chosen_ids=True,
                  microbatches_per_iteration=2)
    holder = gwtf.Peer(role=gwtf.Role.HOLDER, stage=0, node_id=1, listen=a, **common)
    relay = gwtf.Peer(role=gwtf.Role.RELAY, stage=1, node_id=2, listen=b, **common)
    with holder, relay:
        assert relay.id == 2 and relay.local_addr == b
        ht = StageTrainer(holder, toy.make_stage, toy.activation_shape, toy.batch, toy.optimizer)
        forward, event = None, None
        for _ in range(400):
            t = holder.next_task(0.01)
            if t is not None:
                ht.run(t)
                event = event or (t if t.is_event else None)
            forward = relay.next_task(0.01)
            if forward is not None and forward.kind == gwtf.TaskKind.FORWARD:
                break
        assert forward is not None and forward.kind == gwtf.TaskKind.FORWARD, forward
        # An event takes no answer.
        assert event is not None
        with pytest.raises(gwtf.InvalidArgument, match="event"):
            event.done()
        # No copy of the input.
        x = forward.input_tensor(torch.float32, (toy.B, toy.D))
        assert x.data_ptr() == forward.input_address
        # An output frame's tensor is the frame's memory.
        out = relay.alloc(forward.output_bytes)
        y = out.tensor(torch.float32, (toy.B, toy.D))
        assert y.data_ptr() == out.address and len(out) == forward.output_bytes
        y.copy_(x)
        # Wrong answers: each refused with its status; the task stays.
        small = relay.alloc(forward.output_bytes - 4)
        with pytest.raises(gwtf.InvalidArgument):
            forward.done(small)
        small.release()
        with pytest.raises(gwtf.InvalidArgument):
            forward.done()  # no frame where one is due
        with pytest.raises(gwtf.InvalidArgument):
            forward.done_weights(b"\0" * 31)  # a digest of 31 bytes
        with pytest.raises(gwtf.InvalidArgument):
            forward.done_weights(b"\0" * 32)  # another kind's answer
        forward.done(out)
        # Handed over: the frame is no longer ours.
        with pytest.raises(gwtf.InvalidArgument):
            out.buffer
        # Answered: a second answer is not found, the input is gone.
        with pytest.raises(gwtf.NotFound):
            forward.failed("late")
        with pytest.raises(gwtf.InvalidArgument):
            forward.input
        stats = relay.stats()
        assert stats["answers_refused"] >= 3 and stats["tasks_done"] >= 1, stats
    # Closed: every call says so.
    with pytest.raises(gwtf.Closed):
        relay.next_task(0)
    with pytest.raises(gwtf.Closed):
        relay.alloc(16)


def test_a_hostile_state_is_refused_not_trusted():
    t = StageTrainer(None, toy.make_stage, toy.activation_shape)
    t._build(1)
    good = t.export_state()
    assert [p.numel() for p in state_parameters(good)] == [p.numel() for p in t.params]
    for bad in [b"", good[:7], b"GWTFPYS1" + struct.pack("<I", 1 << 30), good[:-1],
                good + b"\0", b"NOTPYST1" + good[8:],
                b"GWTFPYS1" + struct.pack("<IQ", 1, 1 << 60)]:
        with pytest.raises(gwtf.InvalidArgument):
            t._import(bad, None)
    # The weights are unchanged by the refusals.
    assert t.export_state() == good


def test_a_task_used_as_a_context_is_answered_failed_on_an_exception():
    class Boom(Exception):
        pass

    class Recorded(gwtf.Task):
        """A task whose answers are recorded, not sent."""

        def __init__(self):
            self.kind, self.answered, self.calls = gwtf.TaskKind.FORWARD, False, []

        def failed(self, reason=""):
            self.calls.append(reason)

    t = Recorded()
    with pytest.raises(Boom):
        with t:
            raise Boom("no memory")
    assert t.calls == ["Boom: no memory"]
