"""A swarm member driven by a Python trainer: the pull loop of `gwtf_peer`.

The trainer takes tasks (`Peer.next_task`), computes, and answers each one
(`Task.done`, `Task.done_loss`, ...). Events (`Task.is_event`) need no
answer. Inputs are not copied: `Task.input` is a view of the frame the
tensor arrived in, valid until the task is answered; an output is written
in place into a frame of the library's pool (`Peer.alloc`) that the answer
hands over.
"""
from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple, Union

from ._ffi import ffi, lib
from .errors import Closed, ErrorSlot, InvalidArgument, call

__all__ = [
    "Contact", "Microbatch", "OutFrame", "Peer", "Role", "Task", "TaskKind",
    "node_key_id", "DIGEST_LEN",
]

DIGEST_LEN = lib.GWTF_DIGEST_LEN


class Role(enum.IntEnum):
    """What a member does: a data holder (stage 0) or a relay."""

    HOLDER = lib.GWTF_PEER_ROLE_HOLDER
    RELAY = lib.GWTF_PEER_ROLE_RELAY


class TaskKind(enum.IntEnum):
    """`GWTF_TASK_KIND_*`: tasks (below 100) and events (100 and above)."""

    EMBED = lib.GWTF_TASK_KIND_EMBED
    FORWARD = lib.GWTF_TASK_KIND_FORWARD
    LOSS = lib.GWTF_TASK_KIND_LOSS
    BACKWARD = lib.GWTF_TASK_KIND_BACKWARD
    EMBED_BACKWARD = lib.GWTF_TASK_KIND_EMBED_BACKWARD
    GRADIENT = lib.GWTF_TASK_KIND_GRADIENT
    APPLY = lib.GWTF_TASK_KIND_APPLY
    EXPORT_STATE = lib.GWTF_TASK_KIND_EXPORT_STATE
    IMPORT_STATE = lib.GWTF_TASK_KIND_IMPORT_STATE
    FORGET = lib.GWTF_TASK_KIND_FORGET
    INIT_STATE = lib.GWTF_TASK_KIND_INIT_STATE
    DISCARD = lib.GWTF_TASK_KIND_DISCARD
    AVERAGE_STATES = lib.GWTF_TASK_KIND_AVERAGE_STATES
    EVENT_ITERATION = lib.GWTF_TASK_KIND_EVENT_ITERATION
    EVENT_COMMITTED = lib.GWTF_TASK_KIND_EVENT_COMMITTED
    EVENT_APPLIED = lib.GWTF_TASK_KIND_EVENT_APPLIED
    EVENT_PEER_LOST = lib.GWTF_TASK_KIND_EVENT_PEER_LOST
    EVENT_ACTIVE = lib.GWTF_TASK_KIND_EVENT_ACTIVE
    EVENT_STATE_DOWNLOADED = lib.GWTF_TASK_KIND_EVENT_STATE_DOWNLOADED
    EVENT_STAGE_STALLED = lib.GWTF_TASK_KIND_EVENT_STAGE_STALLED
    EVENT_RECOVERED = lib.GWTF_TASK_KIND_EVENT_RECOVERED
    EVENT_ERROR = lib.GWTF_TASK_KIND_EVENT_ERROR
    EVENT_LEFT = lib.GWTF_TASK_KIND_EVENT_LEFT
    EVENT_STAGE_EMPTY = lib.GWTF_TASK_KIND_EVENT_STAGE_EMPTY
    EVENT_STAGE_RESUMED = lib.GWTF_TASK_KIND_EVENT_STAGE_RESUMED
    EVENT_REFUSED = lib.GWTF_TASK_KIND_EVENT_REFUSED
    EVENT_FENCED = lib.GWTF_TASK_KIND_EVENT_FENCED
    EVENT_CONNECT_FAILED = lib.GWTF_TASK_KIND_EVENT_CONNECT_FAILED
    EVENT_STAGE_RESTORED = lib.GWTF_TASK_KIND_EVENT_STAGE_RESTORED
    EVENT_STAGE_RESTARTED = lib.GWTF_TASK_KIND_EVENT_STAGE_RESTARTED
    EVENT_CHECKPOINT = lib.GWTF_TASK_KIND_EVENT_CHECKPOINT
    EVENT_STAGE_REBUILT = lib.GWTF_TASK_KIND_EVENT_STAGE_REBUILT


@dataclass(frozen=True, order=True)
class Microbatch:
    """A microbatch: its data holder, iteration and index in the iteration
    (ordered as the library orders them)."""

    holder: int
    iteration: int
    index: int


@dataclass(frozen=True)
class Contact:
    """A member to meet at start: founding members list every founding
    member with `id` and `stage`; a joiner lists addresses (`id` 0)."""

    addr: str
    id: int = 0
    stage: int = 0


def node_key_id(path: Union[str, os.PathLike]) -> int:
    """The node id of the key in the file at `path`, creating the file
    (a fresh key) when there is none."""
    out = ffi.new("uint32_t *")
    call("node_key_id", lib.gwtf_node_key_id, os.fsencode(path), out)
    return out[0]


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is optional
        raise ImportError("tensors need torch: pip install torch") from e
    return torch


def _tensor_over(buf, dtype, shape):
    """A torch tensor over `buf` (no copy), of `dtype`, viewed as `shape`."""
    torch = _torch()
    dtype = dtype or torch.float32
    if len(buf) == 0:
        t = torch.empty(0, dtype=dtype)
    else:
        t = torch.frombuffer(buf, dtype=dtype)
    return t.view(*shape) if shape is not None else t


class OutFrame:
    """A frame of the peer's pool for an answer: write into `buffer` (or a
    `tensor` over it), then pass it to an answer, which takes it over.
    A frame never handed over goes back to the pool on `release` (or when
    garbage collected, or at the end of a `with` block)."""

    __slots__ = ("_ptr", "_data", "_len", "__weakref__")

    def __init__(self, ptr):
        self._ptr = ptr
        view = ffi.new("gwtf_frame_view *")
        call("frame view", lib.gwtf_frame_get_view, ptr, view)
        self._data, self._len = view.data, view.len

    def __len__(self) -> int:
        return self._len

    @property
    def address(self) -> int:
        """Where its payload starts (for checks of zero copy)."""
        return int(ffi.cast("uintptr_t", self._data))

    @property
    def buffer(self):
        """The payload, writable, as a buffer (memoryview-compatible)."""
        self._live()
        return ffi.buffer(self._data, self._len) if self._len else bytearray()

    def tensor(self, dtype=None, shape: Optional[Sequence[int]] = None):
        """A torch tensor over the payload (float32 unless `dtype`), to fill
        in place (`out.copy_(y)`)."""
        return _tensor_over(self.buffer, dtype, shape)

    def release(self) -> None:
        """Gives the frame back to the pool (nothing when handed over)."""
        if self._ptr is not None:
            lib.gwtf_frame_release(self._ptr)
            self._ptr = None

    def _take(self):
        """The frame's pointer, for an answer; None when released."""
        self._live()
        return self._ptr

    def _handed_over(self) -> None:
        self._ptr = None

    def _live(self) -> None:
        if self._ptr is None:
            raise InvalidArgument("the frame was handed over or released already")

    def __enter__(self) -> "OutFrame":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


class Task:
    """A task to answer, or an event (`is_event`). Which fields mean
    something depends on `kind`; the others are 0 or empty.

    `input` (and `input_tensor`), `mean` (and `mean_tensor`) are views of
    the library's memory, valid until the task is answered: keep a copy of
    what outlives the answer."""

    __slots__ = (
        "_peer", "_c", "kind", "stage", "id", "mb", "iteration", "output_bytes",
        "microbatches", "loss", "peer", "bytes", "ms", "weights", "message", "answered",
    )

    def __init__(self, peer: "Peer", c):
        self._peer = peer
        self._c = c
        try:
            self.kind = TaskKind(c.kind)
        except ValueError:  # a kind of a newer library
            self.kind = c.kind
        self.stage = c.stage
        self.id = c.id
        self.mb = Microbatch(c.mb.holder, c.mb.iteration, c.mb.index)
        self.iteration = c.iteration if c.has_iteration else None
        self.output_bytes = c.output_bytes
        self.microbatches = c.microbatches
        self.loss = c.loss
        self.peer = c.peer
        self.bytes = c.bytes
        self.ms = c.ms
        self.weights = bytes(ffi.buffer(c.weights, DIGEST_LEN))
        self.message = ffi.string(c.message).decode("utf-8", "replace")
        self.answered = False

    def __repr__(self) -> str:
        k = self.kind.name if isinstance(self.kind, TaskKind) else self.kind
        return f"Task({k}, id={self.id}, stage={self.stage}, mb={self.mb}, iteration={self.iteration})"

    @property
    def is_event(self) -> bool:
        return self.kind >= 100

    # ---- inputs, no copy

    @property
    def input_address(self) -> int:
        """Where the input starts (0: none), for checks of zero copy."""
        return int(ffi.cast("uintptr_t", self._c.input))

    @property
    def input(self):
        """The input tensor's or state's bytes, in the frame they came in."""
        self._unanswered()
        n = self._c.input_len
        return ffi.buffer(self._c.input, n) if n else bytearray()

    def input_tensor(self, dtype=None, shape: Optional[Sequence[int]] = None):
        """A torch tensor over the input (float32 unless `dtype`), no copy."""
        return _tensor_over(self.input, dtype, shape)

    @property
    def granted(self) -> Tuple[Microbatch, ...]:
        """Gradient task: the microbatches to sum, in the order to sum them."""
        self._unanswered()
        g = self._c.granted
        return tuple(
            Microbatch(g[i].holder, g[i].iteration, g[i].index)
            for i in range(self._c.granted_len)
        )

    @property
    def mean(self):
        """Apply task: the mean gradient's bytes (float32)."""
        self._unanswered()
        n = self._c.mean_len
        return ffi.buffer(self._c.mean, 4 * n) if n else bytearray()

    def mean_tensor(self):
        """Apply task: the mean gradient as a float32 tensor, no copy."""
        return _tensor_over(self.mean, None, None)

    # ---- answers

    def done(self, output: Optional[OutFrame] = None) -> None:
        """Answers with `output` (an activation, input gradient or state;
        None for a task whose answer has no tensor)."""
        ptr = output._take() if output is not None else ffi.NULL
        self._answer("task_done", lib.gwtf_peer_task_done, ptr)
        if output is not None:
            output._handed_over()

    def done_loss(self, loss: float, grad: OutFrame) -> None:
        """Answers a loss task: the mean loss and its input's gradient."""
        self._answer("task_done_loss", lib.gwtf_peer_task_done_loss, float(loss), grad._take())
        grad._handed_over()

    def done_gradient(self, sum_, weights: bytes) -> None:
        """Answers a gradient task: the float32 sum of the granted
        microbatches' gradients (a tensor, array or buffer; copied once) and
        the digest of the weights they were computed on."""
        ptr, n, keep = _floats(sum_)
        self._answer(
            "task_done_gradient", lib.gwtf_peer_task_done_gradient, ptr, n, _digest(weights)
        )
        del keep

    def done_weights(self, weights: bytes) -> None:
        """Answers an apply, import or init task with the weights' digest."""
        self._answer("task_done_weights", lib.gwtf_peer_task_done_weights, _digest(weights))

    def done_rebuilt(self, weights: bytes, averaged: int) -> None:
        """Answers an average-states task: the rebuilt weights' digest and
        how many of the task's states they average (0: the initial ones)."""
        self._answer(
            "task_done_rebuilt", lib.gwtf_peer_task_done_rebuilt, _digest(weights), int(averaged)
        )

    def failed(self, reason: str = "") -> None:
        """Says the trainer could not do the task; the swarm redoes the
        microbatch elsewhere (a failed import stops the peer)."""
        self._answer("task_failed", lib.gwtf_peer_task_failed, reason.encode("utf-8"))

    def _answer(self, what, fn, *args) -> None:
        if self.is_event:
            raise InvalidArgument(f"{what}: {self!r} is an event, it takes no answer")
        call(what, fn, self._peer._live(), self.id, *args)
        self.answered = True

    def _unanswered(self) -> None:
        if self.answered:
            raise InvalidArgument("the task is answered: its inputs are gone")

    # A task as a context: an exception inside answers it as failed.
    def __enter__(self) -> "Task":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not self.answered and not self.is_event:
            try:
                self.failed(f"{exc_type.__name__}: {exc}")
            except Closed:
                pass
        return False


def _digest(weights: bytes):
    if len(weights) != DIGEST_LEN:
        raise InvalidArgument(f"a weights digest has {DIGEST_LEN} bytes, not {len(weights)}")
    return ffi.from_buffer("uint8_t[]", bytes(weights))


def _floats(x):
    """A `const float *`, its length, and what keeps the memory alive, for a
    float32 tensor (CPU, contiguous), array or buffer."""
    if hasattr(x, "data_ptr") and hasattr(x, "is_contiguous"):
        torch = _torch()
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise InvalidArgument(f"a gradient sum must be float32 on the CPU, not {x.dtype} on {x.device}")
        x = x.contiguous()
        return ffi.cast("const float *", x.data_ptr()), x.numel(), x
    buf = ffi.from_buffer("float[]", x)
    return buf, len(buf), buf


class Peer:
    """A swarm member. Use it as a context manager (leaving gracefully at
    the end) or call `close`. Thread safe: several threads may take and
    answer tasks at once; `close` (and `abort`) only once they stopped
    (`leave` first makes their `next_task` raise `Closed`)."""

    def __init__(
        self,
        *,
        role: Role,
        swarm_key: bytes,
        relay_stages: int,
        activation_bytes: Sequence[int],
        state_bytes: Sequence[int],
        bootstrap: Sequence[Union[Contact, str]] = (),
        stage: Optional[int] = None,
        listen: str = "127.0.0.1:0",
        node_id: int = 0,
        node_key_path: Optional[Union[str, os.PathLike]] = None,
        gradient_bytes: Optional[Sequence[int]] = None,
        microbatches_per_iteration: int = 4,
        memory_budget_bytes: Optional[int] = None,
        microbatch_bytes: int = 0,
        seed: int = 1,
        compute_estimate_us: Optional[int] = None,
        log_to_stderr: bool = False,
        recompute: bool = False,
        encrypt: bool = False,
        chosen_ids: bool = False,
        keep_states_every: int = 0,
        save_every: int = 0,
        resume_iterations_done: int = 0,
        rebuild_from_neighbours: bool = False,
    ):
        """Starts a member. `stage`: 0 for a holder (None means 0 for one),
        1..relay_stages for a founding relay, None for a relay joining a
        running swarm (the swarm chooses). The sizes are lists of `relay_stages + 1` byte counts (see
        `gwtf_peer_options` in gwtf.h). Raises `InvalidArgument` (and other
        `GwtfError`s) for options the library refuses."""
        o = ffi.new("gwtf_peer_options *")
        if lib.gwtf_peer_options_init(o) != lib.GWTF_STATUS_OK:  # pragma: no cover
            raise InvalidArgument("gwtf_peer_options_init refused its options")
        keep = []  # what the options point to, alive until gwtf_peer_new returns

        def c_str(s):
            b = ffi.new("char[]", os.fsencode(s))
            keep.append(b)
            return b

        def sizes(name, v):
            if v is None:
                return ffi.NULL
            v = [int(x) for x in v]
            if len(v) != relay_stages + 1:
                raise InvalidArgument(
                    f"{name}: {relay_stages + 1} sizes (relay_stages + 1), not {len(v)}"
                )
            a = ffi.new("uint64_t[]", v)
            keep.append(a)
            return a

        o.role = int(Role(role))
        o.listen_addr = c_str(listen)
        o.node_id = node_id
        if stage is None:
            stage = 0 if Role(role) == Role.HOLDER else lib.GWTF_STAGE_AUTO
        o.stage = int(stage)
        contacts = [c if isinstance(c, Contact) else Contact(str(c)) for c in bootstrap]
        if contacts:
            boot = ffi.new("gwtf_peer_contact[]", len(contacts))
            for i, c in enumerate(contacts):
                boot[i].id, boot[i].stage, boot[i].addr = c.id, c.stage, c_str(c.addr)
            keep.append(boot)
            o.bootstrap, o.bootstrap_len = boot, len(contacts)
        key = ffi.from_buffer("uint8_t[]", bytes(swarm_key))
        keep.append(key)
        o.swarm_key, o.swarm_key_len = key, len(key)
        if memory_budget_bytes is not None:
            o.memory_budget_bytes = memory_budget_bytes
        o.microbatch_bytes = microbatch_bytes
        o.seed = seed
        o.relay_stages = relay_stages
        o.microbatches_per_iteration = microbatches_per_iteration
        o.activation_bytes = sizes("activation_bytes", activation_bytes)
        o.gradient_bytes = sizes("gradient_bytes", gradient_bytes)
        o.state_bytes = sizes("state_bytes", state_bytes)
        if compute_estimate_us is not None:
            o.compute_estimate_us = compute_estimate_us
        o.log_to_stderr = int(bool(log_to_stderr))
        o.recompute = int(bool(recompute))
        o.encrypt = int(bool(encrypt))
        if node_key_path is not None:
            o.node_key_path = c_str(node_key_path)
        o.chosen_ids = int(bool(chosen_ids))
        o.keep_states_every = keep_states_every
        o.save_every = save_every
        o.resume_iterations_done = resume_iterations_done
        o.rebuild_from_neighbours = int(bool(rebuild_from_neighbours))
        out = ffi.new("gwtf_peer **")
        call("peer_new", lib.gwtf_peer_new, o, out)
        self._ptr = out[0]
        self.relay_stages = relay_stages
        self.role = Role(role)
        self._lock = threading.Lock()
        self._left = False

    # ---- what it is

    @property
    def id(self) -> int:
        out = ffi.new("uint32_t *")
        call("peer_id", lib.gwtf_peer_id, self._live(), out)
        return out[0]

    @property
    def local_addr(self) -> str:
        """The "IP:PORT" it listens on (with the real port)."""
        buf = ffi.new("char[]", 128)
        call("peer_local_addr", lib.gwtf_peer_local_addr, self._live(), buf, 128, ffi.NULL)
        return ffi.string(buf).decode()

    def stats(self) -> dict:
        """The peer's counters (`gwtf_peer_stats`), by name."""
        s = ffi.new("gwtf_peer_stats *")
        call("peer_get_stats", lib.gwtf_peer_get_stats, self._live(), s, ffi.sizeof(s[0]))
        return {f: getattr(s, f) for f, _ in ffi.typeof(s[0]).fields if not f.startswith("reserved")}

    # ---- the loop

    def next_task(self, timeout: float = 1.0) -> Optional[Task]:
        """The next task or event, waiting up to `timeout` seconds; None
        when none came. Raises `Closed` once the peer left or failed."""
        c = ffi.new("gwtf_peer_task *")
        slot = ErrorSlot()
        ms = max(0, min(int(timeout * 1000), 0xFFFFFFFF))
        st = lib.gwtf_peer_next_task(self._live(), ms, c, ffi.sizeof(c[0]), slot.ptr)
        if st == lib.GWTF_STATUS_TIMEOUT:
            lib.gwtf_error_free(slot.ptr[0])
            return None
        slot.check(st, "next_task")
        return Task(self, c)

    def tasks(self, timeout: float = 1.0) -> Iterator[Task]:
        """Tasks and events until the peer closes (yields nothing on a
        timeout; loop on)."""
        while True:
            try:
                t = self.next_task(timeout)
            except Closed:
                return
            if t is not None:
                yield t

    def alloc(self, nbytes: int, timeout: float = 5.0) -> OutFrame:
        """A frame of `nbytes` from the pool, for an answer."""
        out = ffi.new("gwtf_frame **")
        ms = max(0, min(int(timeout * 1000), 0xFFFFFFFF))
        call("peer_alloc", lib.gwtf_peer_alloc, self._live(), int(nbytes), ms, out)
        return OutFrame(out[0])

    def checkpoint_state(self, iteration: int, stage: int) -> Tuple[bytes, int]:
        """Stage `stage`'s state in this holder's checkpoint of `iteration`
        (after `EVENT_CHECKPOINT`), copied out, and the node it came from."""
        data = ffi.new("uint8_t **")
        n = ffi.new("size_t *")
        frm = ffi.new("uint32_t *")
        call(
            "peer_checkpoint_state", lib.gwtf_peer_checkpoint_state,
            self._live(), iteration, stage, data, n, frm,
        )
        return bytes(ffi.buffer(data[0], n[0])), frm[0]

    # ---- the end

    def leave(self) -> None:
        """Leaves the swarm gracefully (idempotent)."""
        with self._lock:
            if self._ptr is not None and not self._left:
                call("peer_leave", lib.gwtf_peer_leave, self._ptr)
                self._left = True

    def close(self) -> None:
        """Leaves gracefully and frees the peer."""
        try:
            self.leave()
        finally:
            self.abort()

    def abort(self) -> None:
        """Frees the peer without leaving: to the others, a crash."""
        with self._lock:
            if self._ptr is not None:
                lib.gwtf_peer_free(self._ptr)
                self._ptr = None

    def _live(self):
        p = self._ptr
        if p is None:
            raise Closed("the peer is closed")
        return p

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.abort()
        except Exception:
            pass
