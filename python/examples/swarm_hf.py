#!/usr/bin/env python3
"""A local swarm of Python processes training a Hugging Face model, through
SIGKILLs and joins, checked against the same model trained in one process.

    python python/examples/swarm_hf.py --model gpt2 --holders 2 --relays-per-stage 2 \\
        --stages 4 --iterations 30 --crash-every 3 --join-every 5 --json out.json

Each member is a process of its own (this script with `--member`): a
`gwtf.Peer` whose tasks a `gwtf.torch_stage.StageTrainer` answers on its
stage of the model (`hf_stages.py`). The holders run the embeddings and
the head; with `--stages S` the model's blocks are cut into S - 2 relay
stages. Every `--crash-every` seconds a relay is SIGKILLed (one whose stage
keeps another live member), every `--join-every` seconds a new relay joins
and the swarm chooses its stage. After `--iterations`, the same model is
trained in this process on exactly the swarm's microbatches.

Prints a summary and writes (with --json) ok, iterations,
lost_microbatches, counted_twice, replicas_agree, crashes, joins,
loss_first, loss_last, reference_loss_last, max_loss_diff, tokens_per_s,
reference_tokens_per_s. Exits 1 when a microbatch was lost or counted
twice, replicas disagreed, or a loss differs from the reference by more
than --tolerance (relative).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

KEY = b"swarm_hf example key: 32 bytes.."


def free_addr() -> str:
    """A free port on a loopback address of its own (127.a.b.c)."""
    ip = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(1, 250)}"
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"{ip}:{s.getsockname()[1]}"


# ---- a member (a child process)

def member(cfg: dict) -> int:
    import torch

    import gwtf
    import hf_stages as hf
    from gwtf.torch_stage import StageTrainer

    torch.set_num_threads(1)
    spec = hf.ModelSpec(**cfg["spec"])
    text = hf.Text.load(cfg["data"], spec) if cfg["stage"] == 0 else None
    out_lock = threading.Lock()

    def say(**ev):
        with out_lock:
            print(json.dumps({"node": cfg["id"], **ev}), flush=True)

    act = 4 * spec.batch * spec.seq * spec.width
    try:
        peer = gwtf.Peer(
            role=gwtf.Role.HOLDER if cfg["stage"] == 0 else gwtf.Role.RELAY,
            stage=cfg["stage"], node_id=cfg["id"], chosen_ids=True, listen=cfg["addr"],
            bootstrap=[gwtf.Contact(a, i, s) for a, i, s in cfg["boot"]], swarm_key=KEY,
            relay_stages=spec.relay_stages, microbatches_per_iteration=cfg["microbatches"],
            activation_bytes=[act] * (spec.relay_stages + 1), state_bytes=cfg["state_bytes"],
            memory_budget_bytes=cfg["memory_mb"] << 20, log_to_stderr=cfg["log"],
        )
    except gwtf.GwtfError as e:
        # The swarm's coordinator stops the run at once with this line.
        say(event="start_failed", message=f"{type(e).__name__}: {e}")
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    trainer = StageTrainer(
        peer, lambda s: hf.make_stage(spec, s), lambda b, mb: hf.activation_shape(spec),
        text.batch if text else None, lambda p: torch.optim.AdamW(p, lr=spec.lr),
    )
    K = gwtf.TaskKind

    def event(t):
        if t.kind == K.EVENT_ITERATION:
            say(event="iteration", iteration=t.iteration, loss=t.loss, microbatches=t.microbatches)
        elif t.kind == K.EVENT_APPLIED:
            say(event="applied", stage=t.stage, iteration=t.iteration, weights=t.weights.hex())
        elif t.kind in (K.EVENT_ACTIVE, K.EVENT_STATE_DOWNLOADED):
            say(event="active" if t.kind == K.EVENT_ACTIVE else "state_download",
                stage=t.stage, message=t.message)
        elif t.kind in (K.EVENT_ERROR, K.EVENT_STAGE_RESTARTED, K.EVENT_STAGE_EMPTY,
                        K.EVENT_FENCED):
            say(event=t.kind.name.lower().replace("event_", ""), stage=t.stage, message=t.message)

    def error(t, e):
        say(event="task_failed", task=repr(t), error=f"{type(e).__name__}: {e}")

    say(event="listening", stage=cfg["stage"])
    try:
        trainer.serve(on_event=event, on_error=error, timeout=0.2, stop=stop)
    finally:
        peer.close()
        say(event="left")
    return 0


# ---- the swarm (this process)

class Swarm:
    def __init__(self, a, spec, state_bytes):
        self.a, self.spec, self.state_bytes = a, spec, state_bytes
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.events = []          # every event line, in order
        self.procs = {}           # id -> Popen
        self.stage_of = {}        # id -> stage (joiners: once known)
        self.killed, self.joined, self.paused = [], [], []
        holders = list(range(1, a.holders + 1))
        relays = [(10 * s + r, s) for s in range(1, spec.relay_stages + 1)
                  for r in range(1, a.relays_per_stage + 1)]
        self.layout = [(h, 0) for h in holders] + relays
        self.addrs = {i: free_addr() for i, _ in self.layout}
        self.boot = [(self.addrs[i], i, s) for i, s in self.layout]
        self.holders = holders
        self.next_joiner = 101

    def start(self, node, stage, boot):
        cfg = dict(
            id=node, stage=stage, addr=self.addrs.setdefault(node, free_addr()), boot=boot,
            spec=self.spec.__dict__, data=self.a.data, microbatches=self.a.microbatches,
            state_bytes=self.state_bytes, memory_mb=self.a.memory_mb, log=self.a.log,
        )
        p = subprocess.Popen(
            [sys.executable, __file__, "--member", json.dumps(cfg)],
            stdout=subprocess.PIPE, stderr=None if self.a.log else subprocess.DEVNULL, text=True,
        )
        self.procs[node] = p
        if stage is not None:
            self.stage_of[node] = stage
        threading.Thread(target=self._read, args=(node, p), daemon=True).start()

    def note(self, what, node):
        """The coordinator's own acts, in the events' timeline."""
        with self.lock:
            self.events.append({"node": "swarm", "event": what, "target": node,
                                "t": round(time.monotonic() - self.t0, 3)})

    def _read(self, node, p):
        for line in p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            ev["t"] = round(time.monotonic() - self.t0, 3)
            with self.lock:
                self.events.append(ev)
                if ev.get("event") == "active" and ev.get("stage"):
                    self.stage_of[node] = ev["stage"]  # a fenced member may rejoin elsewhere
                elif ev.get("event") == "applied" and ev.get("stage"):
                    self.stage_of.setdefault(node, ev["stage"])

    def iterations_done(self):
        with self.lock:
            done = {h: -1 for h in self.holders}
            for e in self.events:
                if e.get("event") == "iteration" and e["node"] in done:
                    done[e["node"]] = max(done[e["node"]], e["iteration"])
            return min(done.values()) + 1

    def kill_one(self, rng):
        """SIGKILLs a relay whose stage keeps another live member."""
        with self.lock:
            live = [n for n, p in self.procs.items() if p.poll() is None and n not in self.holders]
            by_stage = {}
            for n in live:
                if n in self.stage_of:
                    by_stage.setdefault(self.stage_of[n], []).append(n)
            candidates = [n for ns in by_stage.values() if len(ns) >= 2 for n in ns]
        if not candidates:
            return None
        victim = rng.choice(candidates)
        self.procs[victim].send_signal(signal.SIGKILL)
        self.procs[victim].wait()
        self.killed.append(victim)
        self.note("sigkill", victim)
        return victim

    def pause_one(self, rng, secs):
        """SIGSTOPs a live relay for `secs` (SIGCONT from a timer): it keeps
        its connections and misses its deadlines, then wakes."""
        with self.lock:
            live = [n for n, p in self.procs.items()
                    if p.poll() is None and n not in self.holders and n in self.stage_of]
        if not live:
            return None
        victim = rng.choice(live)
        p = self.procs[victim]
        p.send_signal(signal.SIGSTOP)
        self.paused.append(victim)
        self.note("sigstop", victim)

        def wake():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                self.note("sigcont", victim)

        threading.Timer(secs, wake).start()
        return victim

    def died(self):
        """Members that exited on their own (not SIGKILLed here), each with
        what it said last: (node, exit status, message)."""
        with self.lock:
            gone = [(n, p.returncode) for n, p in self.procs.items()
                    if p.poll() is not None and n not in self.killed]
            said = {}
            for e in self.events:
                if e.get("event") in ("start_failed", "error", "task_failed"):
                    said[e["node"]] = e.get("message") or e.get("error")
        return [(n, code, said.get(n, "no message")) for n, code in gone]

    def joining(self):
        """Whether a joiner is still starting (alive, its stage unknown):
        the next one waits for it, so that joiners do not pile up on a
        loaded machine (a Python member takes seconds to import torch)."""
        with self.lock:
            return any(self.procs[j].poll() is None and j not in self.stage_of
                       for j in self.joined)

    def join_one(self):
        node = self.next_joiner
        self.next_joiner += 1
        self.start(node, None, [(self.addrs[h], 0, 0) for h in self.holders])
        self.joined.append(node)
        self.note("start_joiner", node)
        return node

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def reference(spec, text, holders, microbatches, iterations):
    """The same model trained in one process on the swarm's microbatches:
    {(holder, iteration): mean loss}, and its tokens per second."""
    import torch

    import hf_stages as hf
    from gwtf import Microbatch

    stages = [hf.make_stage(spec, s) for s in range(spec.relay_stages + 1)]
    opts = [torch.optim.AdamW(list(m.parameters()), lr=spec.lr) for m in stages]
    out, n = {}, len(holders) * microbatches
    t0 = time.monotonic()
    for it in range(iterations):
        if it == 1:
            t0 = time.monotonic()  # timed from the end of the first, as the swarm is
        for h in holders:
            total = 0.0
            for i in range(microbatches):
                x, y = text.batch(Microbatch(h, it, i))
                a = stages[0].embed(x)
                for s in range(1, spec.relay_stages + 1):
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
    secs = time.monotonic() - t0
    tokens = max(1, iterations - 1) * n * spec.batch * spec.seq
    return out, tokens / secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--member", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt2", help="gpt2, llama or gpt2-small")
    ap.add_argument("--holders", type=int, default=2)
    ap.add_argument("--relays-per-stage", type=int, default=2)
    ap.add_argument("--stages", type=int, default=4,
                    help="stages of the cut, the holders' first and last included")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=2, help="per holder per iteration")
    ap.add_argument("--crash-every", type=float, default=0.0, help="seconds (0: no crashes)")
    ap.add_argument("--join-every", type=float, default=0.0, help="seconds (0: no joins)")
    ap.add_argument("--kill-at", type=int, nargs="*", default=[], metavar="ITER",
                    help="also SIGKILL a relay once the swarm reached these iterations")
    ap.add_argument("--join-at", type=int, nargs="*", default=[], metavar="ITER",
                    help="also start a joiner once the swarm reached these iterations")
    ap.add_argument("--pause-at", type=int, nargs="*", default=[], metavar="ITER",
                    help="SIGSTOP a relay once the swarm reached these iterations (SIGCONT "
                         "after --pause-for s): a laptop whose lid closes")
    ap.add_argument("--pause-for", type=float, default=10.0, metavar="SEC")
    ap.add_argument("--data", nargs="*", help="text files (default: the sample text)")
    ap.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes",
                    help="bytes (256 tokens) or a byte-level BPE trained here on the data "
                         "with `tokenizers` (--vocab tokens at most)")
    ap.add_argument("--vocab", type=int, default=1024, help="the BPE's vocabulary")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest relative loss difference against the reference")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--events", help="write every member's events here (JSON lines, t: seconds)")
    ap.add_argument("--log", action="store_true", help="the members' library logs on stderr")
    a = ap.parse_args()
    if a.member:
        return member(json.loads(a.member))
    a.kill_at, a.join_at, a.pause_at = sorted(a.kill_at), sorted(a.join_at), sorted(a.pause_at)
    if a.stages < 3:
        ap.error("--stages must be at least 3 (holders, a relay stage, holders)")
    if a.holders < 1 or a.relays_per_stage < 1 or a.iterations < 1 or a.microbatches < 1:
        ap.error("--holders, --relays-per-stage, --iterations and --microbatches must be >= 1")

    import tempfile

    import hf_stages as hf

    over = dict(relay_stages=a.stages - 2, seed=a.seed)
    if a.layers:
        over["layers"] = a.layers
    run_dir = tempfile.TemporaryDirectory(prefix="swarm_hf-")
    try:
        if a.tokenizer == "bpe":
            # Trained once here; the members and the reference load the file.
            path = str(Path(run_dir.name) / "tokenizer.json")
            over["vocab"] = hf.train_tokenizer(a.data, a.vocab, path)
            over["tokenizer"] = path
        spec = hf.ModelSpec.preset(a.model, **over)
        spec.check()
        text = hf.Text.load(a.data, spec)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    state_bytes = [0] + [hf.stage_state_bytes(spec, s) for s in range(1, spec.relay_stages + 1)]
    rng = random.Random(a.seed)
    swarm = Swarm(a, spec, state_bytes)
    print(f"swarm_hf: {a.model} ({spec.layers} blocks, width {spec.width}, "
          f"{'bytes' if spec.tokenizer is None else f'a BPE of {spec.vocab} tokens'}) cut into "
          f"{a.stages} stages: {a.holders} holders, {spec.relay_stages} relay stages of "
          f"{a.relays_per_stage}; {a.iterations} iterations of {a.holders * a.microbatches} "
          f"microbatches", flush=True)
    for node, stage in swarm.layout:
        swarm.start(node, stage, swarm.boot)
    t_start, started = time.monotonic(), None
    next_crash = next_join = None
    timed_out = False
    shown = -1
    try:
        while True:
            done = swarm.iterations_done()
            now = time.monotonic()
            if done >= 1 and started is None:
                started = now  # the first iteration ends: members are up
                next_crash = now + a.crash_every if a.crash_every > 0 else None
                next_join = now + a.join_every if a.join_every > 0 else None
            if done >= a.iterations:
                break
            if now - t_start > a.timeout:
                timed_out = True
                break
            died = swarm.died()
            if died:
                # A member gone on its own: the run cannot be what was
                # asked for, so it stops now rather than at --timeout.
                for n, code, msg in died:
                    print(f"  member {n} exited on its own (status {code}): {msg}", flush=True)
                break
            if next_crash is not None and now >= next_crash:
                v = swarm.kill_one(rng)
                if v is not None:
                    print(f"  killed relay {v} (stage {swarm.stage_of.get(v)})", flush=True)
                next_crash = now + a.crash_every
            if next_join is not None and now >= next_join and not swarm.joining():
                print(f"  relay {swarm.join_one()} joins", flush=True)
                next_join = now + a.join_every
            while a.kill_at and done >= a.kill_at[0]:
                a.kill_at.pop(0)
                v = swarm.kill_one(rng)
                print(f"  iteration {done}: killed relay {v} (stage {swarm.stage_of.get(v)})",
                      flush=True)
            while a.pause_at and done >= a.pause_at[0]:
                a.pause_at.pop(0)
                v = swarm.pause_one(rng, a.pause_for)
                print(f"  iteration {done}: paused relay {v} for {a.pause_for:g} s", flush=True)
            while a.join_at and done >= a.join_at[0]:
                a.join_at.pop(0)
                print(f"  iteration {done}: relay {swarm.join_one()} joins", flush=True)
            if done != shown and done % 5 == 0:
                print(f"  {done}/{a.iterations} iterations", flush=True)
                shown = done
            time.sleep(0.05)
    finally:
        t_end = time.monotonic()
        swarm.died_before_stop = swarm.died()
        swarm.stop()

    # ---- the facts
    ev = swarm.events
    losses, counts = {}, {}
    for e in ev:
        if e.get("event") == "iteration" and e["iteration"] < a.iterations:
            losses[(e["node"], e["iteration"])] = e["loss"]
            counts[(e["node"], e["iteration"])] = e["microbatches"]
    iterations = swarm.iterations_done() if not timed_out else min(
        swarm.iterations_done(), a.iterations)
    iterations = min(iterations, a.iterations)
    lost = sum(max(0, a.microbatches - counts.get((h, it), 0))
               for h in swarm.holders for it in range(iterations))
    twice = sum(max(0, c - a.microbatches) for c in counts.values())
    digests = {}
    for e in ev:
        if e.get("event") == "applied":
            digests.setdefault((e["stage"], e["iteration"]), set()).add(e["weights"])
    disagree = sorted(k for k, v in digests.items() if len(v) > 1)
    failed = [e for e in ev if e.get("event") in ("error", "task_failed", "stage_restarted")]
    fenced = sorted({e["node"] for e in ev if e.get("event") == "fenced"})
    ref, ref_tps = {}, 0.0
    if iterations:
        print(f"  reference: the same model in one process on the same {iterations} "
              "iterations", flush=True)
        ref, ref_tps = reference(spec, text, swarm.holders, a.microbatches, iterations)
    diffs = [abs(losses[k] - v) / abs(v) for k, v in ref.items() if k in losses]
    max_diff = max(diffs) if diffs else float("inf")
    mean = lambda it, src: sum(src[(h, it)] for h in swarm.holders) / len(swarm.holders)  # noqa: E731
    # Timed from the end of the first iteration (the members are up).
    per_iteration = a.holders * a.microbatches * spec.batch * spec.seq
    secs = t_end - (started or t_start)
    tps = per_iteration * max(0, iterations - 1) / secs if secs > 0 else 0.0
    died = swarm.died_before_stop
    ok = (not timed_out and not died and iterations == a.iterations and lost == 0
          and twice == 0 and not disagree and max_diff <= a.tolerance)
    res = dict(
        ok=ok, model=a.model, vocab=spec.vocab, iterations=iterations,
        lost_microbatches=lost, counted_twice=twice,
        replicas_agree=not disagree, stage_iterations_compared=sum(len(v) > 0 for v in digests.values()),
        crashes=len(swarm.killed), joins=len(swarm.joined), pauses=len(swarm.paused),
        fenced=fenced,
        loss_first=mean(0, losses) if iterations else None,
        loss_last=mean(iterations - 1, losses) if iterations else None,
        reference_loss_last=mean(iterations - 1, ref) if iterations else None,
        max_loss_diff=max_diff, tokens_per_s=tps, reference_tokens_per_s=ref_tps,
        errors=[e.get("message") or e.get("error") for e in failed][:20],
        timed_out=timed_out,
        members_died=[dict(node=n, status=c, message=m) for n, c, m in died],
    )
    print(f"swarm_hf: {'ok' if ok else 'FAILED'}: {iterations}/{a.iterations} iterations, "
          f"{lost} microbatches lost, {twice} counted twice, replicas "
          f"{'agree' if not disagree else 'DISAGREE at ' + str(disagree[:5])} "
          f"({res['stage_iterations_compared']} stage-iterations), {len(swarm.killed)} crashes, "
          f"{len(swarm.joined)} joins, {len(swarm.paused)} pauses")
    if iterations:
        print(f"  loss {res['loss_first']:.4f} -> {res['loss_last']:.4f} "
              f"(reference {res['reference_loss_last']:.4f}; largest relative difference "
              f"{max_diff:.2e}); {tps:.0f} tokens/s (one process: {ref_tps:.0f})")
    for e in res["errors"]:
        print(f"  error: {e}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    if a.events:
        Path(a.events).write_text("".join(json.dumps(e) + "\n" for e in ev))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
