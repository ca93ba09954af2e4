"""The built-in `gpt2-small` preset (src/model/config.rs) is GPT-2: the
library's own stage, driven through the C ABI, gives Hugging Face's GPT-2
loss and gradients with the same weights, at float32 noise."""
import pytest
import torch

from gwtf._ffi import ffi, lib
from gwtf.errors import call

transformers = pytest.importorskip("transformers", reason="the check needs transformers")

V, D, L, H, P, FF = 50257, 768, 12, 12, 1024, 3072
B, T = 1, 8


def floats(fn, stage):
    n = ffi.new("size_t *")
    slot = ffi.new("gwtf_error **")
    fn(stage, ffi.NULL, 0, n, slot)  # BUFFER_TOO_SMALL, with the count
    lib.gwtf_error_free(slot[0])
    buf = torch.empty(n[0], dtype=torch.float32)
    call("floats", fn, stage, ffi.cast("float *", buf.data_ptr()), n[0], n)
    return buf


def split(flat, sizes):
    out, off = [], 0
    for n in sizes:
        out.append(flat[off:off + n])
        off += n
    assert off == flat.numel()
    return out


def test_gpt2_small_is_hugging_face_gpt2_forward_and_backward():
    out = ffi.new("gwtf_stage **")
    call("stage_new", lib.gwtf_stage_new, b"gpt2-small", 1, 0, 7, out)
    stage = ffi.gc(out[0], lib.gwtf_stage_free)
    params = floats(lib.gwtf_stage_export_params, stage)
    assert params.numel() == 124_439_808 + V * D  # GPT-2 small, and the untied head
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (B, T), generator=g)
    targets = torch.randint(0, 256, (B, T), generator=g)
    tok = ffi.new("uint32_t[]", tokens.reshape(-1).tolist())
    tgt = ffi.new("uint32_t[]", targets.reshape(-1).tolist())
    loss = ffi.new("float *")
    call("forward", lib.gwtf_stage_forward, stage, 1, B, T, tok, ffi.NULL, B * T, tgt, B * T,
         ffi.NULL, 0, ffi.NULL, loss)
    call("backward", lib.gwtf_stage_backward, stage, 1, ffi.NULL, 0, ffi.NULL, 0, ffi.NULL)
    grads = floats(lib.gwtf_stage_take_grads, stage)

    # The same weights in Hugging Face's GPT-2 (Conv1D weights are [in, out]:
    # ours are [out, in]).
    block = [D, D, 3 * D * D, 3 * D, D * D, D, D, D, FF * D, FF, D * FF, D]
    sizes = [V * D, P * D] + block * L + [D, D, V * D]
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=P, n_embd=D, n_layer=L, n_head=H, n_inner=FF,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    )
    hf = transformers.GPT2LMHeadModel(cfg).eval()

    def hf_tensors():
        t = hf.transformer
        out = [(t.wte.weight, None), (t.wpe.weight, None)]
        for b in t.h:
            out += [(b.ln_1.weight, None), (b.ln_1.bias, None),
                    (b.attn.c_attn.weight, (3 * D, D)), (b.attn.c_attn.bias, None),
                    (b.attn.c_proj.weight, (D, D)), (b.attn.c_proj.bias, None),
                    (b.ln_2.weight, None), (b.ln_2.bias, None),
                    (b.mlp.c_fc.weight, (FF, D)), (b.mlp.c_fc.bias, None),
                    (b.mlp.c_proj.weight, (D, FF)), (b.mlp.c_proj.bias, None)]
        return out + [(t.ln_f.weight, None), (t.ln_f.bias, None), (hf.lm_head.weight, None)]

    pairs = list(zip(hf_tensors(), split(params, sizes), split(grads, sizes)))
    with torch.no_grad():
        for (p, ours_shape), ours, _ in pairs:
            w = ours.view(ours_shape).t() if ours_shape else ours.view(p.shape)
            p.copy_(w)
    logits = hf(input_ids=tokens).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    want.backward()
    assert abs(loss[0] - float(want.detach())) <= 1e-5 * float(want.detach()), (loss[0], want)
    worst = 0.0
    for (p, ours_shape), _, ours_grad in pairs:
        g_ours = ours_grad.view(ours_shape).t() if ours_shape else ours_grad.view(p.shape)
        scale = p.grad.abs().max().clamp_min(1e-12)
        err = float((g_ours - p.grad).abs().max() / scale)
        worst = max(worst, err)
        assert err <= 1e-4, f"a gradient of shape {tuple(p.shape)}: {err:.2e} of its largest"
    print(f"gpt2-small: loss {loss[0]:.6f} vs {float(want.detach()):.6f}; largest gradient "
          f"difference {worst:.2e} of the tensor's largest")
