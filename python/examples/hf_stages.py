"""Hugging Face `transformers` models cut into swarm stages.

A GPT-2 or a LLaMA is built from a config with random initial weights
from a seed (nothing is downloaded) and cut as `gwtf node` cuts its own:
the data holders (stage 0) run the embeddings, the final norm, the head and
the loss; relay stage s (1..relay_stages) runs its range of blocks. Every
process builds the whole model from the same seed and keeps its stage's
modules, so every replica of a stage starts from the same weights, and the
stages composed are exactly the whole model (`tests/test_hf.py` checks it
against the model's own forward).

Data: windows of a text, byte-level (vocabulary 256) or tokens of a
byte-level BPE tokenizer trained here on the same files with `tokenizers`
(`train_tokenizer`; nothing is downloaded). A microbatch's windows are
chosen from (holder, iteration, index), so the swarm and the single-process
reference train on exactly the same microbatches.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from gwtf import Microbatch
from gwtf.torch_stage import HolderStage

BYTE_VOCAB = 256


@dataclass(frozen=True)
class ModelSpec:
    """What every member must agree on: the model, its cut and its data."""

    model: str = "gpt2"      # "gpt2" or "llama"
    layers: int = 4
    width: int = 128
    heads: int = 4
    seq: int = 64            # tokens per window
    batch: int = 4           # windows per microbatch
    relay_stages: int = 2
    seed: int = 1
    lr: float = 1e-3
    vocab: int = BYTE_VOCAB  # the tokenizer's vocabulary (256: bytes)
    tokenizer: Optional[str] = None  # a `tokenizers` JSON file; None: bytes

    @staticmethod
    def preset(name: str, **over) -> "ModelSpec":
        """`gpt2` and `llama`: small configs for a CPU; `gpt2-small`: GPT-2
        small's shape (124M parameters with its 50257 tokens; byte-level
        here), slow on a CPU."""
        base = {
            "gpt2": dict(model="gpt2"),
            "llama": dict(model="llama"),
            "gpt2-small": dict(model="gpt2", layers=12, width=768, heads=12, seq=128),
        }
        if name not in base:
            raise ValueError(f"unknown model {name!r}: gpt2, llama or gpt2-small")
        return ModelSpec(**{**base[name], **over})

    def check(self) -> None:
        if self.relay_stages < 1 or self.layers % self.relay_stages:
            raise ValueError(
                f"{self.layers} layers do not split into {self.relay_stages} relay stages"
            )
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of {self.heads} heads")
        if self.vocab < 2:
            raise ValueError(f"a vocabulary of {self.vocab} tokens")
        if self.tokenizer is None and self.vocab != BYTE_VOCAB:
            raise ValueError(f"byte-level data has {BYTE_VOCAB} tokens, not {self.vocab}")


def build_model(spec: ModelSpec) -> torch.nn.Module:
    """The whole model, from a config and the spec's seed."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    spec.check()
    torch.manual_seed(spec.seed)
    if spec.model == "gpt2":
        cfg = GPT2Config(
            vocab_size=spec.vocab, n_positions=spec.seq, n_embd=spec.width, n_layer=spec.layers,
            n_head=spec.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0,
        )
        cfg._attn_implementation = "sdpa"
        return GPT2LMHeadModel(cfg).eval()
    if spec.model == "llama":
        cfg = LlamaConfig(
            vocab_size=spec.vocab, hidden_size=spec.width, intermediate_size=4 * spec.width,
            num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
            num_key_value_heads=spec.heads, max_position_embeddings=spec.seq,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
        )
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg).eval()
    raise ValueError(f"unknown model {spec.model!r}")


def _hidden(out) -> torch.Tensor:
    """A block's hidden states (older versions return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


class Gpt2Holder(HolderStage):
    def __init__(self, m):
        super().__init__()
        t = m.transformer
        self.wte, self.wpe, self.ln_f, self.lm_head = t.wte, t.wpe, t.ln_f, m.lm_head
        self.vocab = m.config.vocab_size

    def embed(self, tokens):
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        return self.wte(tokens) + self.wpe(pos)

    def loss(self, h, targets):
        logits = self.lm_head(self.ln_f(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


class Gpt2Blocks(torch.nn.Module):
    def __init__(self, m, first, last):
        super().__init__()
        self.blocks = torch.nn.ModuleList(m.transformer.h[first:last])

    def forward(self, x):
        for b in self.blocks:
            x = _hidden(b(x))
        return x


class LlamaHolder(HolderStage):
    def __init__(self, m):
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = m.model.embed_tokens, m.model.norm, m.lm_head
        self.vocab = m.config.vocab_size

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def loss(self, h, targets):
        logits = self.lm_head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


class LlamaBlocks(torch.nn.Module):
    def __init__(self, m, first, last):
        super().__init__()
        self.layers = torch.nn.ModuleList(m.model.layers[first:last])
        self.rotary_emb = m.model.rotary_emb

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        pe = self.rotary_emb(x, position_ids=pos)
        for layer in self.layers:
            x = _hidden(layer(x, position_embeddings=pe, position_ids=pos))
        return x


def make_stage(spec: ModelSpec, stage: int) -> torch.nn.Module:
    """Stage `stage`'s modules of the model built from the spec's seed."""
    m = build_model(spec)
    if stage == 0:
        return Gpt2Holder(m) if spec.model == "gpt2" else LlamaHolder(m)
    if not 1 <= stage <= spec.relay_stages:
        raise ValueError(f"stage {stage} of {spec.relay_stages} relay stages")
    per = spec.layers // spec.relay_stages
    first = (stage - 1) * per
    cls = Gpt2Blocks if spec.model == "gpt2" else LlamaBlocks
    return cls(m, first, first + per)


def activation_shape(spec: ModelSpec) -> Sequence[int]:
    return (spec.batch, spec.seq, spec.width)


def stage_state_bytes(spec: ModelSpec, stage: int) -> int:
    """The largest state `StageTrainer` exports for the stage: parameters,
    AdamW's two moments and step, those from before an update, headers."""
    params = list(make_stage(spec, stage).parameters())
    n = sum(p.numel() for p in params)
    return 4 * n * 4 + 64 * len(params) + 4096


def data_paths(paths: Optional[List[str]]) -> List[str]:
    """The text files given, or the repository's sample text."""
    if paths:
        return list(paths)
    return [str(Path(__file__).resolve().parents[2] / "tests" / "data" / "lighthouse.txt")]


def train_tokenizer(paths: Optional[List[str]], vocab: int, out: str) -> int:
    """Trains a byte-level BPE tokenizer of at most `vocab` tokens on the
    files (as GPT-2's: every byte is a token, so any text encodes), saves it
    to `out` and returns its vocabulary size. Deterministic for the same
    files and `vocab`; the members load the saved file rather than train."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab < BYTE_VOCAB:
        raise ValueError(f"a byte-level BPE needs at least {BYTE_VOCAB} tokens, not {vocab}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[], show_progress=False,
    )
    tok.train(data_paths(paths), trainer)
    tok.save(out)
    return tok.get_vocab_size()


class Text:
    """A text's tokens, cut into windows by microbatch."""

    def __init__(self, tokens: Sequence[int], spec: ModelSpec):
        if len(tokens) < spec.seq + 2:
            raise ValueError(f"a text of {len(tokens)} tokens: windows need {spec.seq + 1}")
        self.data = torch.tensor(list(tokens), dtype=torch.long)
        if int(self.data.max()) >= spec.vocab:
            raise ValueError(f"token {int(self.data.max())} is outside the vocabulary of {spec.vocab}")
        self.spec = spec

    @staticmethod
    def load(paths: Optional[List[str]], spec: ModelSpec) -> "Text":
        """The files, concatenated, as bytes or, with `spec.tokenizer`, as
        that tokenizer's tokens; without files, the repository's sample text."""
        data = b"".join(Path(p).read_bytes() for p in data_paths(paths))
        if spec.tokenizer is None:
            return Text(data, spec)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(spec.tokenizer)
        return Text(tok.encode(data.decode("utf-8", errors="replace")).ids, spec)

    def batch(self, mb: Microbatch):
        """(inputs, targets): `batch` windows of `seq` tokens, and each
        window's next tokens."""
        s = self.spec
        key = hashlib.sha256(f"{mb.holder}/{mb.iteration}/{mb.index}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        starts = torch.randint(0, len(self.data) - s.seq - 1, (s.batch,), generator=g)
        w = torch.stack([self.data[a:a + s.seq + 1] for a in starts.tolist()])
        return w[:, :-1], w[:, 1:]
