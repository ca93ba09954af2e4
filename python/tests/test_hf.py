"""Hugging Face models cut into stages (python/examples/hf_stages.py) and
the example swarm of Python processes (python/examples/swarm_hf.py)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gwtf import Microbatch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import hf_stages as hf  # noqa: E402

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_the_stages_composed_are_the_whole_model_forward_and_backward(model):
    spec = hf.ModelSpec.preset(model, layers=4, relay_stages=2)
    whole = hf.build_model(spec)
    x, y = hf.Text.load(None, spec).batch(Microbatch(1, 0, 0))
    want = torch.nn.functional.cross_entropy(whole(input_ids=x).logits.reshape(-1, spec.vocab),
                                             y.reshape(-1))
    want.backward()
    stages = [hf.make_stage(spec, s) for s in range(3)]
    a = stages[0].embed(x)
    for s in (1, 2):
        a = stages[s](a)
    got = stages[0].loss(a, y)
    got.backward()
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-6 * abs(float(want.detach()))
    # Every parameter's gradient, stage by stage, is the whole model's.
    by_value = {}
    for p in whole.parameters():
        by_value.setdefault(p.numel(), []).append(p)
    for st in stages:
        for p in st.parameters():
            twins = [q for q in by_value[p.numel()] if q.shape == p.shape and torch.equal(q, p)]
            assert twins, "a stage parameter the whole model does not have"
            assert any(torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-7) for q in twins)


def run_example(tmp_path, *args):
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(EXAMPLES / "swarm_hf.py"), "--json", str(out), "--timeout", "400",
           *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(p.stdout)
    assert out.exists(), p.stdout + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert p.returncode == (0 if res["ok"] else 1)
    return res, p.stdout


def test_a_tokenizer_trained_here_cuts_the_text_into_tokens(tmp_path):
    path = str(tmp_path / "tok.json")
    vocab = hf.train_tokenizer(None, 512, path)
    assert 256 < vocab <= 512
    # Deterministic: members load the file, but a second training agrees.
    assert hf.train_tokenizer(None, 512, str(tmp_path / "again.json")) == vocab
    assert (tmp_path / "again.json").read_text() == (tmp_path / "tok.json").read_text()
    spec = hf.ModelSpec.preset("gpt2", layers=4, relay_stages=2, vocab=vocab, tokenizer=path)
    text, raw = hf.Text.load(None, spec), hf.Text.load(None, hf.ModelSpec.preset("gpt2"))
    assert len(text.data) < 0.8 * len(raw.data), "the BPE does not merge"
    assert int(text.data.max()) < vocab and int(text.data.min()) >= 0
    from tokenizers import Tokenizer
    sample = bytes(raw.data[:400].tolist()).decode("utf-8", errors="replace")
    tok = Tokenizer.from_file(path)
    assert tok.decode(tok.encode(sample).ids) == sample
    x, y = text.batch(Microbatch(1, 0, 0))
    assert x.shape == (spec.batch, spec.seq) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="at least 256"):
        hf.train_tokenizer(None, 100, path)
    with pytest.raises(ValueError, match="byte-level data"):
        hf.ModelSpec.preset("gpt2", vocab=vocab).check()


def test_a_swarm_of_python_processes_trains_llama_as_one_process_does(tmp_path):
    # On the tokens of a BPE trained here (the gpt2 test below: bytes).
    res, out = run_example(tmp_path, "--model", "llama", "--iterations", "6",
                           "--tokenizer", "bpe", "--vocab", "512", "--tolerance", "1e-5")
    assert res["ok"], out
    assert 256 < res["vocab"] <= 512, out
    assert res["max_loss_diff"] <= 1e-5 and res["lost_microbatches"] == 0
    assert res["replicas_agree"] and res["iterations"] == 6


def test_a_gpt2_swarm_through_sigkills_and_joins_loses_nothing(tmp_path):
    res, out = run_example(tmp_path, "--model", "gpt2", "--relays-per-stage", "3",
                           "--iterations", "14", "--kill-at", "3", "5", "7", "9",
                           "--join-at", "4", "8", "--tolerance", "1e-5")
    assert res["ok"], out
    assert res["crashes"] == 4 and res["joins"] == 2, out
    assert res["lost_microbatches"] == 0 and res["counted_twice"] == 0
    assert res["replicas_agree"] and res["max_loss_diff"] <= 1e-5
    assert res["loss_last"] < res["loss_first"]


def test_a_gpt2_swarm_with_a_relay_paused_loses_nothing(tmp_path):
    # SIGSTOP, then SIGCONT 3 s later: the relay keeps its connections,
    # misses its deadlines, fences itself when it wakes and joins again
    # through a state download, while its stage trains on without it.
    res, out = run_example(tmp_path, "--model", "gpt2", "--relays-per-stage", "2",
                           "--iterations", "40", "--pause-at", "2", "--pause-for", "3",
                           "--tolerance", "1e-5")
    assert res["ok"], out
    assert res["pauses"] == 1 and res["fenced"], out
    assert res["lost_microbatches"] == 0 and res["counted_twice"] == 0
    assert res["replicas_agree"] and res["max_loss_diff"] <= 1e-5


def test_a_member_that_cannot_start_stops_the_run_at_once(tmp_path):
    # gpt2-small cut into 3 stages: the relay stage's state (1.36 GB) is
    # above the peer's tensor limit, which every member is told of, so the
    # first member to start is refused. The run stops with its error, not
    # after --timeout (400 s).
    t0 = time.monotonic()
    res, out = run_example(tmp_path, "--model", "gpt2-small", "--stages", "3",
                           "--iterations", "2")
    assert not res["ok"] and res["iterations"] == 0, out
    assert res["members_died"], out
    assert all("LimitExceeded" in d["message"] and d["status"] == 1
               for d in res["members_died"]), out
    assert "exited on its own" in out and "GWTF_PEER_MAX_TENSOR_BYTES" in out, out
    assert time.monotonic() - t0 < 200, "the run waited for its timeout"


def test_bad_arguments_are_refused_with_a_message(tmp_path):
    ex = [sys.executable, str(EXAMPLES / "swarm_hf.py")]
    for args, says in [(["--stages", "2"], "at least 3"),
                       (["--model", "bert"], "unknown model"),
                       (["--stages", "5", "--layers", "4"], "do not split"),
                       (["--tokenizer", "bpe", "--vocab", "64"], "at least 256")]:
        p = subprocess.run(ex + args, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and says in p.stderr, (args, p.stderr)
