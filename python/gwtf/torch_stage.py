"""A trainer for stages written as PyTorch modules: it answers every task a
`Peer` hands out, as `gwtf node`'s built-in trainer does for its own model.

The user gives, per protocol stage, a module (`make_stage(stage)`): for the
data holders' stage 0 a `HolderStage` (the embeddings, and the head with the
loss), for a relay stage any module from the activation it receives to the
one it sends. The trainer keeps each microbatch's autograd graph from its
forward to its backward, keeps each microbatch's parameter gradients apart
(the library says which microbatches an update sums, and in which order),
and applies the swarm's mean gradient with the user's optimizer.

Rules shared with `gwtf node` (so the swarm checks replicas the same way):
- the weights digest is the SHA-256 of the exported state without the
  parameters from before the last update;
- the exported state carries those parameters, so a joiner can run a
  microbatch of the iteration of that update on the weights it saw.

State format (little-endian): b"GWTFPYS1", u32 parameter count; per
parameter: u64 element count, its float32 values; per parameter: u32
optimizer-state entries, each u16 name length, the name, u64 element
count, float32 values; then (after an update) u64 byte count and the
float32 parameters from before it. Nothing is unpickled: a state from a
peer is only ever parsed as numbers.
"""
from __future__ import annotations

import ctypes
import hashlib
import struct
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import Closed, InvalidArgument
from .peer import Microbatch, Peer, Task, TaskKind

__all__ = ["HolderStage", "StageTrainer", "state_parameters"]

MAGIC = b"GWTFPYS1"


class HolderStage(torch.nn.Module):
    """The data holders' stage: `embed(inputs)` gives the activation stage 1
    receives; `loss(activation, targets)` the mean loss of a microbatch from
    the last relay stage's activation. Its parameters are both parts'."""

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, activation: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class _Kept:
    """What a microbatch keeps from its forward to its backward, and the
    update its weights had then (an update in between changed them in
    place: the backward runs the forward again first)."""

    __slots__ = ("inp", "out", "targets", "applied")

    def __init__(self, inp, out, applied, targets=None):
        self.inp, self.out, self.applied, self.targets = inp, out, applied, targets


class StageTrainer:
    """Answers a peer's tasks on PyTorch modules (CPU, float32).

    make_stage(stage) -> module: the stage's module with its initial weights
        (called again for a stage started afresh: it must give the same
        weights each time, e.g. from a seed).
    activation_shape(boundary, mb) -> shape: the activation stage `boundary`
        sends to stage `boundary + 1` (boundary 0: the holders' embedding;
        the last: the last relay's output).
    batch(mb) -> (inputs, targets): a holder's data for a microbatch.
    optimizer(params) -> torch.optim.Optimizer (default AdamW, lr 1e-3).
    """

    def __init__(
        self,
        peer: Peer,
        make_stage: Callable[[int], torch.nn.Module],
        activation_shape: Callable[[int, Microbatch], Sequence[int]],
        batch: Optional[Callable[[Microbatch], Tuple[torch.Tensor, torch.Tensor]]] = None,
        optimizer: Optional[Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]] = None,
    ):
        self.peer = peer
        self.make_stage = make_stage
        self.activation_shape = activation_shape
        self.batch = batch
        self.make_optimizer = optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3))
        self.stage: Optional[int] = None
        self.module: Optional[torch.nn.Module] = None
        self.params: List[torch.nn.Parameter] = []
        self.opt: Optional[torch.optim.Optimizer] = None
        # the last update applied, and the parameters from before it
        self.applied: Optional[int] = None
        self.before: Optional[List[torch.Tensor]] = None
        self.kept: Dict[Microbatch, _Kept] = {}
        self.grads: Dict[Microbatch, Dict[int, torch.Tensor]] = {}
        self.lock = threading.Lock()
        # The digest of the weights as they are, while nothing here changed
        # them: a gradient task reports the digest its update's apply just
        # computed (hashing the state costs ~5 ms per 5 MB).
        self._digest: Optional[bytes] = None

    # ---- the stage's weights

    # Module constructors draw from torch's global generator: two trainers
    # of one process building at once would interleave their draws.
    _building = threading.Lock()

    def _build(self, stage: int) -> None:
        with StageTrainer._building:
            module = self.make_stage(stage)
        if stage == 0 and not isinstance(module, HolderStage):
            raise InvalidArgument("make_stage(0) must give a HolderStage (embed and loss)")
        self.stage, self.module = stage, module
        self.params = [p for p in module.parameters()]
        self.opt = self.make_optimizer(self.params)
        self.applied, self.before = None, None
        self._digest = None
        self.kept.clear()
        self.grads.clear()

    def _serving(self, stage: int) -> None:
        if self.stage != stage:
            self._build(stage)

    def _opt_state(self, p) -> List[Tuple[str, torch.Tensor]]:
        st = self.opt.state.get(p, {})
        out = []
        for name in sorted(st):
            v = st[name]
            if not torch.is_tensor(v):
                v = torch.tensor(float(v))
            out.append((name, v.detach().to(torch.float32).reshape(-1)))
        return out

    def _state_pieces(self, with_before: bool) -> list:
        """The exported state as a list of pieces, each bytes or a float32
        tensor (concatenated: the state); tensors are not copied here."""
        out = [MAGIC, struct.pack("<I", len(self.params))]
        for p in self.params:
            d = _flat32(p)
            out += [struct.pack("<Q", d.numel()), d]
        for p in self.params:
            entries = self._opt_state(p)
            out.append(struct.pack("<I", len(entries)))
            for name, v in entries:
                nb = name.encode()
                out += [struct.pack("<H", len(nb)), nb, struct.pack("<Q", v.numel()), _flat32(v)]
        if with_before and self.applied is not None and self.before is not None:
            n = sum(b.numel() * 4 for b in self.before)
            out.append(struct.pack("<Q", n))
            out += [_flat32(b) for b in self.before]
        return out

    def digest(self) -> bytes:
        """The weights digest replicas compare: SHA-256 of the state
        without the parameters from before the last update."""
        h = hashlib.sha256()
        for piece in self._state_pieces(with_before=False):
            h.update(_view(piece))
        return h.digest()

    def _current_digest(self) -> bytes:
        """`digest()`, computed again only after this trainer changed the
        weights (every change below clears it)."""
        if self._digest is None:
            self._digest = self.digest()
        return self._digest

    def export_state(self) -> bytes:
        """The state as an export task sends it (for a checkpoint of one's
        own, or a test)."""
        return b"".join(bytes(_view(p)) for p in self._state_pieces(with_before=True))

    def _import(self, state, iteration: Optional[int]) -> None:
        self._digest = None
        params, opt_state, before = _parse_state(state)
        if len(params) != len(self.params) or any(
            a.numel() != p.numel() for a, p in zip(params, self.params)
        ):
            raise InvalidArgument("the state does not fit this stage's parameters")
        with torch.no_grad():
            for p, a in zip(self.params, params):
                p.copy_(a.view_as(p))
        self.opt = self.make_optimizer(self.params)
        for p, entries in zip(self.params, opt_state):
            if entries:
                self.opt.state[p] = {
                    name: (v.reshape(()) if name == "step" else v.view_as(p).clone())
                    for name, v in entries
                }
        self.applied = iteration
        self.before = None
        if before is not None and iteration is not None:
            if before.numel() != sum(p.numel() for p in self.params):
                raise InvalidArgument("the parameters from before the last update do not fit")
            self.before = [b.view_as(p).clone() for b, p in zip(_split(before, self.params), self.params)]
        self.kept.clear()
        self.grads.clear()

    # ---- the tasks

    def run(self, task: Task) -> bool:
        """Answers `task` (False for an event, which needs none). An
        exception answers it as failed and is raised on."""
        if task.is_event:
            return False
        with task, self.lock:
            self._run(task)
        return True

    def serve(
        self,
        on_event: Optional[Callable[[Task], None]] = None,
        timeout: float = 0.5,
        on_error: Optional[Callable[[Task, Exception], None]] = None,
        stop: Optional[threading.Event] = None,
    ) -> None:
        """Takes and answers tasks until the peer closes; events go to
        `on_event`. A task that raised was answered as failed (the swarm
        redoes its microbatch); the exception goes to `on_error` (default:
        printed to stderr) and the loop goes on. `stop` set: returns after
        the task at hand (within `timeout` when there is none)."""
        while stop is None or not stop.is_set():
            try:
                task = self.peer.next_task(timeout)
            except Closed:
                return
            if task is None:
                continue
            try:
                if not self.run(task) and on_event is not None:
                    on_event(task)
            except Closed:
                return  # the peer left while this task ran
            except Exception as e:  # noqa: BLE001 - reported, and the swarm recovers
                if on_error is not None:
                    on_error(task, e)
                else:
                    print(f"gwtf: {task!r} failed: {type(e).__name__}: {e}", file=sys.stderr)

    def _run(self, t: Task) -> None:
        k = t.kind
        if k in (TaskKind.IMPORT_STATE,):
            self._build(t.stage)
            self._import(t.input, t.iteration)
            return t.done_weights(self.digest())
        if k == TaskKind.INIT_STATE:
            self._build(t.stage)
            if t.iteration is not None:
                self.applied = t.iteration
                self.before = [p.detach().clone() for p in self.params]
            return t.done_weights(self.digest())
        if k == TaskKind.AVERAGE_STATES:
            self._build(t.stage)
            averaged = self._average(t)
            if t.iteration is not None:
                self.applied = t.iteration
                self.before = [p.detach().clone() for p in self.params]
            return t.done_rebuilt(self.digest(), averaged)
        self._serving(t.stage)
        if k in (TaskKind.EMBED, TaskKind.FORWARD, TaskKind.LOSS, TaskKind.BACKWARD,
                 TaskKind.EMBED_BACKWARD):
            with self._weights_of(t.mb):
                return self._compute(t)
        if k == TaskKind.GRADIENT:
            return self._gradient(t)
        if k == TaskKind.APPLY:
            return self._apply(t)
        if k == TaskKind.EXPORT_STATE:
            # Written straight into the frame: one copy of each tensor.
            pieces = [_view(p) for p in self._state_pieces(with_before=True)]
            out = self.peer.alloc(sum(len(p) for p in pieces))
            addr, off = out.address, 0
            for p in pieces:
                ctypes.memmove(addr + off, p, len(p))
                off += len(p)
            return t.done(out)
        if k == TaskKind.FORGET:
            first = t.iteration or 0
            for d in (self.kept, self.grads):
                for mb in [m for m in d if m.iteration < first]:
                    del d[mb]
            return t.done()
        if k == TaskKind.DISCARD:
            self.kept.pop(t.mb, None)
            return t.done()
        t.failed(f"this trainer does not do {k!r}")

    def _weights_of(self, mb: Microbatch):
        """A context in which the module has the weights `mb`'s iteration
        saw: the current ones, or those from before the last update."""
        trainer = self

        class Swap:
            def __enter__(self):
                self.swapped = False
                a = trainer.applied
                if a is not None and mb.iteration <= a:
                    if mb.iteration < a or trainer.before is None:
                        raise InvalidArgument(
                            f"a microbatch of iteration {mb.iteration} after the update of "
                            f"iteration {a}: its weights are gone"
                        )
                    trainer._swap()
                    self.swapped = True

            def __exit__(self, *exc):
                if self.swapped:
                    trainer._swap()

        return Swap()

    def _swap(self) -> None:
        for i, p in enumerate(self.params):
            p.data, self.before[i] = self.before[i], p.data

    def _out(self, t: Task, y: torch.Tensor) -> None:
        """Answers `t` with `y`, written into a frame of the pool."""
        out = self.peer.alloc(t.output_bytes)
        out.tensor(torch.float32, y.shape).copy_(y.detach())
        t.done(out)

    def _keep_grads(self, mb: Microbatch, grads) -> None:
        """Adds a microbatch's parameter gradients (None: unused) to those
        it keeps (a holder's head and embedding add up, tied or not)."""
        d = self.grads.setdefault(mb, {})
        for i, g in enumerate(grads):
            if g is not None:
                d[i] = d[i] + g if i in d else g.detach()

    def _compute(self, t: Task) -> None:
        k, mb, m = t.kind, t.mb, self.module
        last = self.peer.relay_stages
        if k == TaskKind.EMBED:
            inputs, targets = self.batch(mb)
            h = m.embed(inputs)
            self.kept[mb] = _Kept(inputs, h, self.applied, targets)
            return self._out(t, h)
        if k == TaskKind.LOSS:
            x = t.input_tensor(torch.float32, self.activation_shape(last, mb)).clone().requires_grad_(True)
            kept = self.kept.get(mb)
            if kept is None or kept.targets is None:
                raise InvalidArgument(f"a loss of {mb} whose embedding this holder did not run")
            loss = m.loss(x, kept.targets)
            grads = torch.autograd.grad(loss, [x] + self.params, allow_unused=True)
            self._keep_grads(mb, grads[1:])
            out = self.peer.alloc(t.output_bytes)
            out.tensor(torch.float32, x.shape).copy_(grads[0])
            return t.done_loss(float(loss.detach()), out)
        if k == TaskKind.EMBED_BACKWARD:
            kept = self.kept.pop(mb, None)
            if kept is None:
                raise InvalidArgument(f"an embedding backward of {mb} with no embedding kept")
            if kept.applied != self.applied:
                kept.out = m.embed(kept.inp)
            g = t.input_tensor(torch.float32, kept.out.shape)
            grads = torch.autograd.grad(kept.out, self.params, grad_outputs=g, allow_unused=True)
            self._keep_grads(mb, grads)
            return t.done()
        if k == TaskKind.FORWARD:
            x = t.input_tensor(torch.float32, self.activation_shape(t.stage - 1, mb))
            x = x.clone().requires_grad_(True)
            y = m(x)
            self.kept[mb] = _Kept(x, y, self.applied)
            return self._out(t, y)
        if k == TaskKind.BACKWARD:
            kept = self.kept.pop(mb, None)
            if kept is None:
                raise InvalidArgument(f"a backward of {mb} with no forward kept")
            if kept.applied != self.applied:
                # An update since its forward (a late duplicate, whose
                # gradient no update will sum): the graph's weights changed.
                kept.out = m(kept.inp)
            g = t.input_tensor(torch.float32, kept.out.shape)
            grads = torch.autograd.grad(kept.out, [kept.inp] + self.params, grad_outputs=g,
                                        allow_unused=True)
            self._keep_grads(mb, grads[1:])
            return self._out(t, grads[0])

    def _gradient(self, t: Task) -> None:
        total = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32)
        for mb in t.granted:
            d = self.grads.get(mb)
            if d is None:
                raise InvalidArgument(f"no gradient kept for granted {mb}")
            off = 0
            for i, p in enumerate(self.params):
                n = p.numel()
                if i in d:
                    total[off:off + n] += d[i].reshape(-1)
                off += n
        t.done_gradient(total, self._current_digest())

    def _apply(self, t: Task) -> None:
        mean = t.mean_tensor()
        if mean.numel() != sum(p.numel() for p in self.params):
            raise InvalidArgument(f"a mean of {mean.numel()} floats for {len(self.params)} parameters")
        self.before = [p.detach().clone() for p in self.params]
        self._digest = None
        for p, g in zip(self.params, _split(mean, self.params)):
            p.grad = g.view_as(p).clone()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.applied = t.iteration
        for mb in [m for m in self.grads if t.iteration is not None and m.iteration <= t.iteration]:
            del self.grads[mb]
        t.done_weights(self._current_digest())

    def _average(self, t: Task) -> int:
        """CheckFree: the mean of the neighbouring stages' parameters that
        have this stage's shapes (fresh optimizer state); the number of
        states averaged (0: the initial weights stay)."""
        fits = []
        for _stage, state in _packed_states(t.input):
            try:
                params, _, _ = _parse_state(state)
            except InvalidArgument:
                continue
            if len(params) == len(self.params) and all(
                a.numel() == p.numel() for a, p in zip(params, self.params)
            ):
                fits.append(params)
        self._digest = None
        if fits:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    p.copy_((sum(f[i] for f in fits) / len(fits)).view_as(p))
        return len(fits)



def _flat32(t: torch.Tensor) -> torch.Tensor:
    """`t` as a flat contiguous float32 CPU tensor (a view where it is one)."""
    return t.detach().to(torch.float32).contiguous().reshape(-1)


def _view(piece):
    """A piece of a state as a buffer: bytes, or a tensor's memory (no
    copy; the tensor must outlive the view)."""
    if isinstance(piece, bytes):
        return piece
    if sys.byteorder != "little":  # pragma: no cover
        raise InvalidArgument("states are little-endian; this machine is not")
    n = piece.numel() * 4
    return (ctypes.c_char * n).from_address(piece.data_ptr()) if n else b""


def _split(flat: torch.Tensor, params) -> List[torch.Tensor]:
    out, off = [], 0
    for p in params:
        out.append(flat[off:off + p.numel()])
        off += p.numel()
    return out


class _Reader:
    """Reads a state's numbers, every length checked before it is used."""

    def __init__(self, buf):
        self.b = memoryview(buf).cast("B")
        self.off = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.off + n > len(self.b):
            raise InvalidArgument(f"a state cut short in {what}")
        v = self.b[self.off:self.off + n]
        self.off += n
        return v

    def u(self, fmt: str, what: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def floats(self, n: int, what: str) -> torch.Tensor:
        v = self.take(4 * n, what)
        return torch.frombuffer(bytearray(v), dtype=torch.float32) if n else torch.empty(0)


def _parse_state(buf):
    """(parameters, optimizer state per parameter, parameters from before
    the last update or None), as flat float32 tensors."""
    r = _Reader(buf)
    if bytes(r.take(len(MAGIC), "its magic")) != MAGIC:
        raise InvalidArgument("not a state of this trainer (bad magic)")
    count = r.u("<I", "the parameter count")
    if count > len(r.b) // 8:
        raise InvalidArgument(f"a state of {count} parameters in {len(r.b)} bytes")
    params = [r.floats(r.u("<Q", "a parameter's length"), "a parameter") for _ in range(count)]
    opt = []
    for _ in range(count):
        entries = []
        for _ in range(r.u("<I", "an optimizer state's entry count")):
            name = bytes(r.take(r.u("<H", "a name's length"), "a name")).decode("utf-8", "replace")
            entries.append((name, r.floats(r.u("<Q", "an entry's length"), "an entry")))
        opt.append(entries)
    before = None
    if r.off < len(r.b):
        n = r.u("<Q", "the parameters from before the last update")
        if n % 4:
            raise InvalidArgument("parameters from before the last update of odd length")
        before = r.floats(n // 4, "the parameters from before the last update")
    if r.off != len(r.b):
        raise InvalidArgument(f"{len(r.b) - r.off} bytes after the state")
    return params, opt, before


def _packed_states(buf):
    """An average-states task's input: (stage, state) of each neighbour."""
    r, out = _Reader(buf), []
    while r.off < len(r.b):
        stage = r.u("<I", "a packed state's stage")
        r.take(4, "a packed state's header")
        n = r.u("<Q", "a packed state's length")
        out.append((stage, r.take(n, "a packed state")))
    return out


def state_parameters(state) -> List[torch.Tensor]:
    """The parameters (flat float32) in a state this trainer exported."""
    return _parse_state(state)[0]
