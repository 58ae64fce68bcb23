"""Capacity baselines (random / stride / first_k): MoD's compute at the same capacity, no router."""

from __future__ import annotations

import pytest
import torch

from megaroute.kernels import reference
from megaroute.model.rope import Positions
from megaroute.model.routing import CapacityBaselineLayer, DenseLayer, RoutingContext, dispatch, freeze_base, ragged

from .routing_checks import assert_causal, op_counts, record_updates, rows, tokens_for
from megaroute.model import ForwardOptions

METHODS = ("random", "stride", "first_k")


def baseline(method: str, capacity: float = 0.25) -> tuple[str, ...]:
    return (f"routing.method={method}", "routing.every=2", "routing.offset=1", f"routing.capacity={capacity}")


@torch.no_grad()
def sharpen(model, attn: float = 5.0) -> None:
    """Sharper attention than at init, so that positions and neighbours visibly matter."""
    for layer in model.layers:
        layer.block.attn.qkv.weight.mul_(attn)


def selected_positions(calls, i: int) -> torch.Tensor:
    (positions,) = calls[i]
    return positions


# ----------------------------------------------------------------------------- selections and budgets


@pytest.mark.parametrize("method", METHODS)
def test_structure_and_no_controller(make_model, method):
    model, cfg = make_model(*baseline(method))
    assert [type(layer) for layer in model.layers] == [DenseLayer, CapacityBaselineLayer, DenseLayer,
                                                       CapacityBaselineLayer]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in make_model()[0].parameters())
    with pytest.raises(ValueError, match="no routing-controller"):
        freeze_base(model)


@pytest.mark.parametrize("B,T", [(3, 16), (2, 13), (1, 1)])
def test_random_selects_exactly_k_distinct_positions_per_sequence(make_model, monkeypatch, B, T):
    model, cfg = make_model(*baseline("random"))
    calls = record_updates(monkeypatch, model)
    torch.manual_seed(1)
    out = model(tokens_for(cfg, B, T))
    k = dispatch.capacity_k(T, 0.25)
    for i in (1, 3):
        idx = selected_positions(calls, i)
        assert idx.shape == (B, k)
        assert (idx[:, 1:] > idx[:, :-1]).all()  # distinct and ascending
        assert out.routing_stats[f"layer_{i}/selected_frac"].item() == pytest.approx(k / T)
    if T > 1:  # independent draws per sequence and per layer
        assert not torch.equal(selected_positions(calls, 1), selected_positions(calls, 3))


def test_random_covers_positions_uniformly(make_model):
    model, cfg = make_model(*baseline("random"))
    layer, T = model.layers[1], 8
    torch.manual_seed(0)
    idx, valid = layer.select(torch.zeros(4000, T, 1), Positions(model.rope, torch.arange(T).expand(4000, T)), False)
    assert valid is None
    freq = torch.bincount(idx.flatten(), minlength=T).float() / 4000
    torch.testing.assert_close(freq, torch.full((T,), 2 / T), rtol=0, atol=0.04)  # k = 2 of 8


def test_random_causal_mode_is_per_token_bernoulli(make_model, monkeypatch):
    model, cfg = make_model(*baseline("random"))
    calls = record_updates(monkeypatch, model)
    torch.manual_seed(0)
    out = model(tokens_for(cfg, 64, 32), options=ForwardOptions(mode="causal"))
    frac = out.routing_stats["layer_1/selected_frac"].item()
    assert frac == pytest.approx(0.25, abs=0.03)
    # ragged: the block computes exactly the selected rows, no padding (routing/ragged.py)
    assert rows(calls, 1) == round(frac * 64 * 32)


def test_random_decodes_with_a_cache_at_the_capacity(make_model):
    """Causal random draws each token with probability c whatever the length of the call: decoding token by
    token with a KV cache runs about c of the tokens, as the uncached forward does (with k / T of each call,
    k = max(1, round(c T)), a one-token call ran every token)."""
    model, cfg = make_model(*baseline("random"))
    model.eval()
    B, T = 4, 64
    tokens = tokens_for(cfg, B, T)
    torch.manual_seed(0)
    with torch.no_grad():
        cache = model.new_cache()
        ran = [model(tokens[:, t:t + 1], options=ForwardOptions(mode="causal", cache=cache)).routing_stats[
            "layer_1/selected_frac"].item() for t in range(T)]
    assert sum(ran) / T == pytest.approx(0.25, abs=0.06)


@pytest.mark.parametrize("mode", ["topk", "causal", "hard"])
@pytest.mark.parametrize("T,capacity,expected", [
    (16, 0.25, [3, 7, 11, 15]), (13, 0.25, [3, 7, 11]), (10, 0.3, [2, 5, 8]), (3, 0.25, []), (5, 1.0, [0, 1, 2, 3, 4]),
])
def test_stride_positions(make_model, monkeypatch, mode, T, capacity, expected):
    model, cfg = make_model(*baseline("stride", capacity))
    calls = record_updates(monkeypatch, model)
    out = model(tokens_for(cfg, 2, T), tokens_for(cfg, 2, T), options=ForwardOptions(mode=mode))
    for i in (1, 3):
        if expected:
            assert selected_positions(calls, i).tolist() == [expected, expected]
        else:
            assert rows(calls, i) == 0  # nothing to run: the block is skipped, not called on 0 rows
        assert out.routing_stats[f"layer_{i}/selected_frac"].item() == pytest.approx(len(expected) / T)
    out.loss.backward()


@pytest.mark.parametrize("mode", ["topk", "causal", "hard"])
@pytest.mark.parametrize("T,capacity", [(16, 0.25), (13, 0.25), (7, 0.5), (3, 0.01)])
def test_first_k_positions(make_model, monkeypatch, mode, T, capacity):
    model, cfg = make_model(*baseline("first_k", capacity))
    calls = record_updates(monkeypatch, model)
    model(tokens_for(cfg, 2, T), options=ForwardOptions(mode=mode))
    k = dispatch.capacity_k(T, capacity)
    for i in (1, 3):
        assert selected_positions(calls, i).tolist() == [list(range(k))] * 2


@pytest.mark.parametrize("method", ["stride", "first_k"])
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_in_order_positions_select_on_the_host(make_model, monkeypatch, method, mode):
    """Rows at positions 0, 1, ... (no ForwardOptions.positions): the positional rules pick the same
    columns without a mask whose counts are read back (a host sync per routed layer on a GPU), through
    the fixed-k padded path, not the ragged one; stride decodes that way token by token too."""
    model, cfg = make_model(*baseline(method, 0.3))
    model.eval()
    B, T = 3, 13
    tokens = tokens_for(cfg, B, T)
    explicit = model(tokens, tokens, options=ForwardOptions(mode=mode, positions=torch.arange(T).expand(B, T)))

    def refuse(*args, **kwargs):
        raise AssertionError("in-order positions went through a mask")

    monkeypatch.setattr(dispatch, "mask_indices", refuse)
    monkeypatch.setattr(ragged, "index_rows", refuse)
    out = model(tokens, tokens, options=ForwardOptions(mode=mode))
    torch.testing.assert_close(out.logits, explicit.logits, rtol=1e-5, atol=1e-6)
    for i in (1, 3):
        key = f"layer_{i}/selected_frac"
        assert out.routing_stats[key].item() == explicit.routing_stats[key].item()
    if method == "stride" and mode == "causal":
        cache = model.new_cache()
        steps = [model(tokens[:, t:t + 1], options=ForwardOptions(mode=mode, cache=cache)).logits for t in range(T)]
        torch.testing.assert_close(torch.cat(steps, dim=1), explicit.logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- compute semantics


@pytest.mark.parametrize("method", METHODS)
def test_update_weight_one_at_original_positions(make_model, method):
    model, cfg = make_model(*baseline(method, 0.3))
    sharpen(model)
    layer = model.layers[1]
    B, T = 3, 13
    x = torch.randn(B, T, cfg.model.d_model)
    pos = Positions(model.rope, torch.arange(T).expand(B, T))
    torch.manual_seed(3)
    out = layer(x, pos, RoutingContext(), "l")
    torch.manual_seed(3)
    idx, _ = layer.select(x, pos, False)
    chosen = dispatch.indices_to_mask(idx, T)
    assert torch.equal(out[~chosen], x[~chosen])
    x_sel = reference.gather(x, idx)
    expected = x_sel + layer.block.update(x_sel, Positions(model.rope, idx))
    torch.testing.assert_close(reference.gather(out, idx), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_capacity_one_equals_dense(make_model, method, mode):
    dense, cfg = make_model(seed=7)
    model, _ = make_model(*baseline(method, 1.0), seed=11)
    model.load_state_dict(dense.state_dict())  # strict: a baseline adds no parameters
    tokens = tokens_for(cfg, 3, 13)
    torch.testing.assert_close(model(tokens, options=ForwardOptions(mode=mode)).logits, dense(tokens).logits, rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_base_gets_gradients(make_model, method):
    model, cfg = make_model(*baseline(method))
    tokens = tokens_for(cfg, 2, 16)
    model(tokens, tokens).lm_loss.backward()
    for layer in model.layers:
        assert layer.block.attn.qkv.weight.grad.abs().max() > 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_tlops_counts_are_exact(make_model, monkeypatch, method, mode):
    model, cfg = make_model(*baseline(method))
    calls = record_updates(monkeypatch, model)
    T = 16
    torch.manual_seed(5)
    out = model(tokens_for(cfg, 1, T), options=ForwardOptions(mode=mode))  # B = 1: no padding rows
    executed = sum(rows(calls, i) for i in range(4))
    for i in (1, 3):
        assert out.routing_stats[f"layer_{i}/selected_frac"].item() == pytest.approx(rows(calls, i) / T)
    assert rows(calls, 0) == rows(calls, 2) == T
    assert out.routing_stats["tlops_frac"].item() == pytest.approx(executed / (4 * T))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_no_per_sample_python_loop(make_model, method, mode):
    model, cfg = make_model(*baseline(method, 0.5))

    def run(B):
        torch.manual_seed(0)
        model(tokens_for(cfg, B, 12), options=ForwardOptions(mode=mode))

    counts = op_counts(run)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["causal", "hard"])
def test_evaluation_modes_are_causal(make_model, method, mode):
    model, cfg = make_model(*baseline(method))
    sharpen(model)

    def run(tokens):
        torch.manual_seed(0)  # the random baseline draws the same choices for both inputs
        return model(tokens, options=ForwardOptions(mode=mode)).logits

    assert_causal(run, tokens_for(cfg, 2, 16), cfg.model.vocab_size)
