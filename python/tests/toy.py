"""A toy language model cut into stages, and a local swarm of Python peers
that trains it (each peer on a thread of its own), for the tests.

Holders (stage 0) embed a token and score the last relay's activation with
a linear head; each relay stage is a linear layer and a tanh. Microbatch
data follows from (holder, iteration, index), so a single process can
train on exactly the swarm's microbatches: the reference.
"""
import random
import socket
import threading
import time

import torch

import gwtf
from gwtf.torch_stage import HolderStage, StageTrainer

V, D, B = 16, 16, 8
KEY = b"0123456789abcdef-python-swarm-test"


class Holder(HolderStage):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V)

    def embed(self, inputs):
        return self.emb(inputs)

    def loss(self, h, targets):
        return torch.nn.functional.cross_entropy(self.head(h), targets)


class Relay(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def make_stage(stage: int) -> torch.nn.Module:
    torch.manual_seed(1000 + stage)
    return Holder() if stage == 0 else Relay()


def batch(mb: gwtf.Microbatch):
    g = torch.Generator().manual_seed((mb.holder << 40) | (mb.iteration << 20) | mb.index)
    x = torch.randint(0, V, (B,), generator=g)
    return x, (3 * x + 1) % V


def activation_shape(boundary, mb):
    return (B, D)


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.05)


def state_bytes():
    """A relay stage's exported state, at most: its parameters three times
    (with AdamW's two moments), those from before an update, and headers."""
    n = sum(p.numel() for p in Relay().parameters())
    return 4 * n * 4 + 4096


def free_addr() -> str:
    """A free port on a loopback address of its own (127.a.b.c at random):
    not 127.0.0.1, whose ports the kernel also hands to outgoing connections."""
    ip = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(1, 250)}"
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"{ip}:{s.getsockname()[1]}"


class Swarm:
    """Founding members with chosen ids: holders 1..H, relays 10*s + r."""

    def __init__(self, holders=2, relay_stages=2, per_stage=2, microbatches=3, check=None):
        self.relay_stages, self.microbatches = relay_stages, microbatches
        layout = [(h, 0) for h in range(1, holders + 1)]
        layout += [(10 * s + r, s) for s in range(1, relay_stages + 1) for r in range(1, per_stage + 1)]
        self.layout = layout
        addrs = {i: free_addr() for i, _ in layout}
        boot = [gwtf.Contact(addrs[i], i, s) for i, s in layout]
        self.lock = threading.Lock()
        self.losses = {}      # (holder, iteration) -> loss
        self.digests = {}     # (stage, iteration) -> {node: digest}
        self.errors = []
        self.check = check
        self.addrs = addrs
        self.peers, self.trainers, self.threads, self.stops = {}, {}, {}, {}
        self.killed, self.joined = [], []
        for i, s in layout:
            self._start(i, gwtf.Peer(
                role=gwtf.Role.HOLDER if s == 0 else gwtf.Role.RELAY, stage=s, node_id=i,
                listen=addrs[i], bootstrap=boot, **self._common(),
            ))

    def _common(self):
        act = 4 * B * D
        return dict(
            chosen_ids=True, swarm_key=KEY, relay_stages=self.relay_stages,
            microbatches_per_iteration=self.microbatches,
            activation_bytes=[act] * (self.relay_stages + 1),
            state_bytes=[0] + [state_bytes()] * self.relay_stages,
            memory_budget_bytes=32 << 20,
        )

    def _start(self, node, peer):
        self.peers[node] = peer
        self.trainers[node] = StageTrainer(peer, make_stage, activation_shape, batch, optimizer)
        self.stops[node] = threading.Event()
        t = threading.Thread(target=self._serve, args=(node,), daemon=True)
        t.start()
        self.threads[node] = t

    def kill(self, node):
        """A crash: the node stops answering and its peer is freed without
        a goodbye (what a SIGKILL is to the others)."""
        self.stops[node].set()
        self.threads[node].join(timeout=30)
        self.peers.pop(node).abort()
        self.killed.append(node)

    def join(self, node, **options):
        """A relay joins the running swarm; the swarm chooses its stage.
        `options`: more `gwtf.Peer` options (`rebuild_from_neighbours`)."""
        addr = free_addr()
        holders = [gwtf.Contact(self.addrs[i]) for i, s in self.layout if s == 0]
        self._start(node, gwtf.Peer(
            role=gwtf.Role.RELAY, stage=None, node_id=node, listen=addr, bootstrap=holders,
            **self._common(), **options,
        ))
        self.joined.append(node)

    def leave(self, node):
        """A member leaves gracefully (its goodbye sent) and stops."""
        self.peers[node].leave()
        self.stops[node].set()
        self.threads[node].join(timeout=30)
        self.peers.pop(node).close()

    def _serve(self, node):
        trainer = self.trainers[node]

        def event(task):
            with self.lock:
                if task.kind == gwtf.TaskKind.EVENT_ITERATION:
                    self.losses[(node, task.iteration)] = task.loss
                elif task.kind == gwtf.TaskKind.EVENT_APPLIED:
                    self.digests.setdefault((task.stage, task.iteration), {})[node] = task.weights
                elif task.kind == gwtf.TaskKind.EVENT_ERROR:
                    self.errors.append((node, task.message))

        def error(task, e):
            with self.lock:
                self.errors.append((node, f"{task!r}: {type(e).__name__}: {e}"))

        if self.check is not None:
            inner = trainer.run

            def run(task):
                self.check(trainer, task)
                return inner(task)

            trainer.run = run
        trainer.serve(on_event=event, on_error=error, timeout=0.2, stop=self.stops[node])

    def wait_iterations(self, n, timeout=120.0):
        """Until every holder reported iteration n - 1 (bounded)."""
        holders = [i for i, s in self.layout if s == 0]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if all((h, n - 1) in self.losses for h in holders):
                    return
            time.sleep(0.05)
        raise AssertionError(f"the swarm did not reach iteration {n} in {timeout} s: {self.losses}")

    def wait_for(self, ready, what, timeout=120.0):
        """Until `ready()` (called under the swarm's lock), bounded."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if ready():
                    return
            time.sleep(0.05)
        raise AssertionError(f"not in {timeout} s: {what}")

    def iteration(self):
        """The highest iteration every holder reported."""
        holders = [i for i, s in self.layout if s == 0]
        with self.lock:
            return min(max((it for (h, it) in self.losses if h == n), default=-1) for n in holders)

    def close(self):
        for p in self.peers.values():
            p.leave()
        for t in self.threads.values():
            t.join(timeout=30)
        for p in self.peers.values():
            p.close()


def reference(holders, relay_stages, microbatches, iterations):
    """The same model trained in one process on exactly the swarm's
    microbatches: {(holder, iteration): mean loss of its microbatches}."""
    stages = [make_stage(s) for s in range(relay_stages + 1)]
    opts = [optimizer(list(m.parameters())) for m in stages]
    out = {}
    n = holders * microbatches
    for it in range(iterations):
        for h in range(1, holders + 1):
            total = 0.0
            for i in range(microbatches):
                x, y = batch(gwtf.Microbatch(h, it, i))
                a = stages[0].embed(x)
                for s in range(1, relay_stages + 1):
                    a = stages[s](a)
                loss = stages[0].loss(a, y)
                loss.backward()
                total += float(loss.detach())
            out[(h, it)] = total / microbatches
        for m, o in zip(stages, opts):
            for p in m.parameters():
                p.grad /= n
            o.step()
            o.zero_grad(set_to_none=True)
    return out
