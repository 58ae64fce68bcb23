"""kernels.functions.apply: a Function's forward run directly where autograd records nothing, with the
outputs Function.apply gives, bit for bit; Function.apply wherever autograd records."""

from __future__ import annotations

import pytest
import torch

from megaroute.config import load_config
from megaroute.kernels import functions
from megaroute.model import ForwardOptions, build_model


class _Scale(torch.autograd.Function):
    calls: list = []

    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(x)
        ctx.factor = factor
        _Scale.calls.append(type(ctx).__name__)
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def test_the_forward_runs_directly_only_where_autograd_records_nothing():
    x = torch.randn(3)
    w = torch.randn(3, requires_grad=True)
    _Scale.calls.clear()
    assert torch.equal(functions.apply(_Scale, x, 2.0), x * 2)  # nothing requires grad
    with torch.no_grad():
        assert functions.apply(_Scale, w, 2.0).grad_fn is None  # grad mode off
    assert _Scale.calls == ["_Unrecorded", "_Unrecorded"]
    out = functions.apply(_Scale, w, 3.0)  # recorded: Function.apply, and its backward runs
    assert out.grad_fn is not None and _Scale.calls[-1] != "_Unrecorded"
    out.sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,mode", [("none", "causal"), ("mod", "causal"), ("halting", "hard"),
                                         ("depth_gate", "causal")])
def test_a_model_forward_without_autograd_equals_function_apply_bit_for_bit(monkeypatch, method, mode, dtype):
    """Every Function on a model's inference path (linears, RMSNorm, SwiGLU, RoPE, attention, the
    combine), against the same forward with Function.apply forced; with a KV cache too."""
    cfg = load_config(None, ["model.d_model=64", "model.n_heads=4", "model.n_layers=4", "data.seq_len=24",
                             "model.max_seq_len=32", "model.vocab_size=97", "data.tokenizer.vocab_size=97",
                             f"routing.method={method}", "routing.capacity=0.5"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.routing).to(dtype).eval()
    tokens = torch.randint(0, 97, (3, 24))

    def run():
        with torch.no_grad():
            full = model(tokens, options=ForwardOptions(mode=mode)).logits
            cache = model.new_cache()
            model(tokens[:, :20], options=ForwardOptions(mode=mode, cache=cache))
            step = model(tokens[:, 20:21], options=ForwardOptions(mode=mode, cache=cache)).logits
        return full, step

    unrecorded = []
    with monkeypatch.context() as m:
        m.setattr(functions._Unrecorded, "save_for_backward", lambda self, *t: unrecorded.append(len(t)))
        direct = run()
    assert len(unrecorded) >= 3 * 3 * cfg.model.n_layers  # linears, norms, attention... ran directly
    monkeypatch.setattr(functions, "records", lambda *args: True)
    applied = run()
    for a, b in zip(direct, applied):
        assert torch.equal(a, b)
