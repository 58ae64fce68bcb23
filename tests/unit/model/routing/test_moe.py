"""Mixture-of-Experts and MoDE layers against per-token references (megaroute/model/routing/moe.py).

The references compute every expert densely for every token, then select and combine by a routing
decision computed token by token in Python (capacity queues in position order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaroute.config import ConfigError
from megaroute.flops import estimate_flops
from megaroute.inspect import format_report, inspect_config
from megaroute.kernels import reference, resolve
from megaroute.model import ForwardOptions, build_model
from megaroute.model.rope import Positions
from megaroute.model.routing import (
    IntegratedMoDELayer,
    MoELayer,
    RoutingContext,
    StagedMoDELayer,
)
from megaroute.model.routing.moe import expert_capacity

from ...test_flops import _count
from .routing_checks import assert_causal, tokens_for

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton: interpreted on CPU
MOE = ("routing.method=moe", "routing.every=2", "routing.offset=1", "routing.moe.num_experts=4")


def _layer(make_model, *overrides, seed=0):
    model, cfg = make_model(*MOE, *overrides, seed=seed)
    layer = model.layers[1]
    assert isinstance(layer, MoELayer)
    return model, layer, cfg


def _dense_experts(moe, u: torch.Tensor) -> torch.Tensor:
    """Every expert on every token: [B, n, E, D]."""
    gu = torch.einsum("bnd,edh->bneh", u, moe.w_gate_up)
    g, up = gu.chunk(2, dim=-1)
    return torch.einsum("bneh,ehd->bned", F.silu(g) * up, moe.w_down)


def _ref_token_choice(probs: torch.Tensor, k: int, capacity):
    """Token by token, each token's choices in rank order, an assignment kept while its expert has room."""
    B, n, E = probs.shape
    gate = torch.zeros_like(probs)
    sel = torch.zeros(B, n, E, dtype=torch.bool)
    for b in range(B):
        load = [0] * E
        for t in range(n):
            top_p, top_e = probs[b, t].topk(k)
            w = top_p / top_p.sum() if k > 1 else top_p
            for j, e in enumerate(top_e.tolist()):
                if capacity is None or load[e] < capacity:
                    sel[b, t, e] = True
                    gate[b, t, e] = w[j]
                load[e] += 1
    return sel, gate


def _ref_expert_choice(probs: torch.Tensor, capacity: int):
    B, n, E = probs.shape
    sel = torch.zeros(B, n, E, dtype=torch.bool)
    for b in range(B):
        for e in range(E):
            sel[b, probs[b, :, e].topk(capacity).indices, e] = True
    return sel, probs * sel


def _ref_layer(layer, rope, x: torch.Tensor, causal: bool = False, positions=None) -> torch.Tensor:
    """x + the block update with the MoE FFN, computed densely (positions: the tokens' own, default 0..T-1)."""
    blk, moe = layer.block, layer.moe
    B, T, _ = x.shape
    pos = Positions(rope, torch.arange(T).expand(B, T) if positions is None else positions)
    h = x + blk.attn_update(x, pos.cos, pos.sin)
    u = blk.mlp_input(h)
    probs = moe.router(u).float().softmax(-1)
    cap = expert_capacity(T, moe.cfg)
    if moe.cfg.router == "token_choice":
        _, gate = _ref_token_choice(probs, moe.cfg.top_k, None if causal else cap)
    else:
        _, gate = _ref_expert_choice(probs, cap)
    y = (gate.unsqueeze(-1) * _dense_experts(moe, u)).sum(2)
    if blk.mlp is not None:
        y = y + blk.mlp(u)
    return h + y


def _run(layer, rope, x, mode="topk"):
    B, T, _ = x.shape
    ctx = RoutingContext(mode=mode)
    return layer(x, Positions(rope, torch.arange(T).expand(B, T)), ctx, "l"), ctx


def _grads(layer, out):
    layer.zero_grad()
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("overrides", [
    (),  # Switch: top-1, capacity 1.25
    ("routing.moe.top_k=2", "routing.moe.capacity_factor=1.0"),  # GShard top-2 with drops
    ("routing.moe.top_k=2", "routing.moe.shared_experts=1", "routing.moe.expert_hidden=24"),
    ("routing.moe.router=expert_choice", "routing.moe.capacity_factor=1.0"),
    ("routing.moe.router=expert_choice", "routing.moe.top_k=2", "routing.moe.capacity_factor=0.5"),
], ids=["switch", "gshard_top2_drops", "top2_shared", "expert_choice", "expert_choice_k2"])
def test_layer_equals_dense_per_token_reference_forward_and_backward(make_model, overrides):
    model, layer, cfg = _layer(make_model, *overrides)
    with torch.no_grad():
        layer.moe.router.weight.mul_(30)  # decisive, unbalanced routing: drops happen
    x = torch.randn(2, 12, cfg.model.d_model, requires_grad=True)
    out, ctx = _run(layer, model.rope, x)
    ref = _ref_layer(layer, model.rope, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = _grads(layer, out)
    torch.testing.assert_close(grads, _grads(layer, ref), rtol=1e-5, atol=1e-6)
    assert set(grads) == {n for n, _ in layer.named_parameters()}  # every weight trains, router included
    if layer.moe.cfg.router == "token_choice" and layer.moe.cfg.capacity_factor is not None:
        assert ctx.stats["l/moe_dropped"] > 0  # the reference's drops were exercised


def test_causal_token_choice_drops_nothing(make_model):
    model, layer, cfg = _layer(make_model, "routing.moe.capacity_factor=0.25")
    x = torch.randn(2, 12, cfg.model.d_model)
    out, ctx = _run(layer, model.rope, x, "causal")
    torch.testing.assert_close(out, _ref_layer(layer, model.rope, x, causal=True), rtol=1e-5, atol=1e-6)
    assert ctx.stats["l/moe_dropped"] == 0
    _, ctx = _run(layer, model.rope, x, "topk")
    assert ctx.stats["l/moe_dropped"] > 0


# ----------------------------------------------------------------------------- capacity edge cases


def _force_expert(monkeypatch, layer, expert: int):
    """The router sends every token to `expert` first (then the others by index)."""
    E = layer.moe.num_experts
    bias = torch.zeros(E)
    bias[expert] = 10.0
    monkeypatch.setattr(layer.moe.router, "forward", lambda u: u[..., :1] * 0 + bias - 0.1 * torch.arange(E))


def _h(layer, rope, x):
    blk = layer.block
    B, T, _ = x.shape
    pos = Positions(rope, torch.arange(T).expand(B, T))
    return x + blk.attn_update(x, pos.cos, pos.sin)


def test_all_tokens_to_one_expert_keep_the_first_c_and_drop_the_rest(make_model, monkeypatch):
    model, layer, cfg = _layer(make_model)  # top-1, capacity factor 1.25
    _force_expert(monkeypatch, layer, 2)
    T = 16
    C = expert_capacity(T, layer.moe.cfg)
    assert C == 5
    x = torch.randn(2, T, cfg.model.d_model)
    out, ctx = _run(layer, model.rope, x)
    h = _h(layer, model.rope, x)
    # Dropped tokens pass through the residual bit for bit; the first C (by position) ran expert 2.
    assert torch.equal(out[:, C:], h[:, C:])
    assert (out[:, :C] - h[:, :C]).abs().amax(-1).min() > 0
    assert ctx.stats["l/moe_dropped"] == 2 * (T - C)
    assert ctx.stats["l/moe_dropped_frac"] == pytest.approx((T - C) / T)
    assert ctx.stats["l/expert_2_load"] == 1.0 and ctx.stats["l/moe_load_max"] == 4.0
    # Empty experts still take part in backward (zero gradient), so data-parallel ranks stay in step.
    out.sum().backward()
    assert layer.moe.w_down.grad[2].abs().sum() > 0
    assert torch.equal(layer.moe.w_down.grad[[0, 1, 3]], torch.zeros_like(layer.moe.w_down.grad[[0, 1, 3]]))


def test_top_k_equal_to_num_experts_without_drops_is_a_soft_mixture(make_model):
    model, layer, cfg = _layer(make_model, "routing.moe.top_k=4", "routing.moe.capacity_factor=1.0")
    x = torch.randn(2, 8, cfg.model.d_model)
    assert expert_capacity(8, layer.moe.cfg) == 8  # k = E: every token fits every expert
    out, ctx = _run(layer, model.rope, x)
    assert ctx.stats["l/moe_dropped"] == 0
    h = _h(layer, model.rope, x)
    u = layer.block.mlp_input(h)
    probs = layer.moe.router(u).softmax(-1)
    expected = h + (probs.unsqueeze(-1) * _dense_experts(layer.moe, u)).sum(2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_no_capacity_limit_never_drops(make_model, monkeypatch):
    model, layer, cfg = _layer(make_model, "routing.moe.capacity_factor=null")
    _force_expert(monkeypatch, layer, 0)
    _, ctx = _run(layer, model.rope, torch.randn(1, 9, cfg.model.d_model))
    assert ctx.stats["l/moe_dropped"] == 0 and ctx.stats["l/expert_0_load"] == 1.0


def test_balance_and_z_losses(make_model, monkeypatch):
    model, layer, cfg = _layer(make_model, "routing.moe.balance_loss_weight=1", "routing.moe.z_loss_weight=1")
    x = torch.randn(2, 8, cfg.model.d_model)
    _, ctx = _run(layer, model.rope, x)
    assert 0.9 < float(ctx.aux_losses["l/moe_balance"].detach()) < 1.5  # ~1 when near uniform
    _force_expert(monkeypatch, layer, 1)
    _, ctx = _run(layer, model.rope, x)
    logits = layer.moe.router(x).detach()
    losses = {k: float(v.detach()) for k, v in ctx.aux_losses.items()}
    assert losses["l/moe_balance"] == pytest.approx(4 * float(logits.softmax(-1)[..., 1].mean()), rel=1e-5)
    assert losses["l/moe_z_loss"] == pytest.approx(float(torch.logsumexp(logits, -1).square().mean()))
    _, ctx = _run(layer, model.rope, x, "causal")
    assert not ctx.aux_losses


# ----------------------------------------------------------------------------- dispatch kernels


def test_group_permutation_generalises_the_two_path_permutation():
    torch.manual_seed(0)
    B, T, D = 3, 7, 5
    full = torch.rand(B, T) > 0.4
    x, h, w = torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(B, T)
    slot, n_full = reference.path_slots(full)
    src, counts = reference.group_rows(torch.stack([full, ~full], -1).view(B * T, 2))
    assert counts.tolist() == [n_full, B * T - n_full]
    torch.testing.assert_close(reference.permute_groups(x.view(B * T, D), src), reference.permute(x, slot))
    y = torch.randn(B * T, D)
    expected = reference.unpermute(h, slot, w, y[:n_full], y[n_full:])
    got = reference.unpermute_groups(h.view(B * T, D), src, w.view(-1)[src], y).view(B, T, D)
    torch.testing.assert_close(got, expected)


def test_group_rows_with_tokens_in_several_groups():
    sel = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 1]], dtype=torch.bool)  # expert 1 empty
    src, counts = reference.group_rows(sel)
    assert src.tolist() == [0, 2, 0, 1, 2] and counts.tolist() == [2, 0, 3]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, w: reference.unpermute_groups(x, src, w, reference.permute_groups(x, src) * 2),
                             (x, w))


# ----------------------------------------------------------------------------- MoDE


def test_staged_mode_runs_the_moe_on_the_mod_selection(make_model):
    model, cfg = make_model("routing.method=mode_staged", "routing.every=2", "routing.offset=1",
                            "routing.moe.num_experts=4", "routing.capacity=0.5")
    layer = model.layers[1]
    assert isinstance(layer, StagedMoDELayer) and layer.block.mlp is None
    x = torch.randn(2, 10, cfg.model.d_model)
    out, ctx = _run(layer, model.rope, x)
    idx = layer.router(x).squeeze(-1).topk(5, dim=1).indices.sort(dim=1).values
    xs = reference.gather(x, idx)
    moe_ref = _ref_layer(layer, model.rope, xs, positions=idx)
    g = layer.router(x).squeeze(-1).gather(1, idx).unsqueeze(-1)
    torch.testing.assert_close(reference.gather(out, idx), xs + g * (moe_ref - xs), rtol=1e-5, atol=1e-6)
    unselected = ~torch.zeros(2, 10, dtype=torch.bool).scatter(1, idx, True)
    assert torch.equal(out[unselected], x[unselected])
    assert ctx.stats["l/selected_frac"] == 0.5


def test_integrated_mode_noop_tokens_skip_the_block(make_model):
    model, cfg = make_model("routing.method=mode_integrated", "routing.every=2", "routing.offset=1",
                            "routing.moe.num_experts=2", "routing.moe.router=expert_choice", "routing.capacity=0.5")
    layer = model.layers[1]
    assert isinstance(layer, IntegratedMoDELayer) and layer.moe.router.out_features == 3
    with torch.no_grad():
        layer.moe.router.weight.mul_(50)
    x = torch.randn(2, 12, cfg.model.d_model)
    out, ctx = _run(layer, model.rope, x)
    probs = layer.moe.router(x).softmax(-1)
    sel, _ = _ref_expert_choice(probs[..., :2], 3)  # C = round(0.5 * 12 / 2) per expert
    run = sel.any(-1)
    assert torch.equal(out[~run], x[~run])  # the no-op: bit for bit
    assert (out[run] - x[run]).abs().amax(-1).min() > 0
    assert ctx.stats["l/selected_frac"] == pytest.approx(float(run.float().mean()))
    out.sum().backward()
    assert layer.moe.router.weight.grad[:2].abs().sum() > 0


@pytest.mark.parametrize("method,extra,mode", [
    ("moe", (), "topk"),  # position-priority drops are causal in training too
    ("moe", (), "causal"),
    ("moe", ("routing.moe.router=expert_choice",), "causal"),
    ("mode_staged", (), "causal"),
    ("mode_staged", ("routing.causal_method=predictor", "routing.moe.router=expert_choice"), "causal"),
    ("mode_integrated", ("routing.moe.router=expert_choice",), "causal"),
])
def test_causality_probe(make_model, method, extra, mode):
    model, cfg = make_model(f"routing.method={method}", "routing.every=1", "routing.offset=0",
                            "routing.moe.num_experts=4", "routing.capacity=0.5", "routing.moe.capacity_factor=0.5",
                            *extra)
    for layer in model.layers:
        with torch.no_grad():
            layer.moe.router.weight.mul_(20)
    model.train()
    tokens = tokens_for(cfg, 2, 16)
    for _ in range(3):  # set the calibrated thresholds from training batches
        model(tokens_for(cfg, 4, 16, seed=_ + 1))
    model.eval()
    with torch.no_grad():
        assert_causal(lambda t: model(t, options=ForwardOptions(mode=mode)).logits, tokens, cfg.model.vocab_size)


@pytest.mark.parametrize("overrides", [
    (*MOE, "routing.moe.top_k=2"),
    (*MOE, "routing.moe.router=expert_choice"),
    ("routing.method=mode_staged", "routing.moe.num_experts=4", "routing.capacity=0.3"),
    ("routing.method=mode_integrated", "routing.moe.num_experts=4", "routing.moe.router=expert_choice",
     "routing.capacity=0.3"),
], ids=["token_choice", "expert_choice", "staged", "integrated"])
def test_cached_decoding_equals_the_uncached_causal_forward(make_model, overrides):
    # Single-token steps: many run a routed block on no token at all.
    model, cfg = make_model(*overrides)
    for seed in range(2):  # calibrated thresholds from training batches
        model(tokens_for(cfg, 4, 16, seed=seed + 5))
    model.eval()
    tokens = tokens_for(cfg, 2, 10)
    with torch.no_grad():
        full = model(tokens, options=ForwardOptions(mode="causal")).logits
        cache = model.new_cache()
        steps = [model(tokens[:, t: t + 1], options=ForwardOptions(mode="causal", cache=cache)).logits
                 for t in range(10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- FLOPs, config


@pytest.mark.parametrize("overrides", [
    ("routing.method=moe", "routing.moe.capacity_factor=null", "routing.moe.top_k=2", "routing.moe.shared_experts=1"),
    ("routing.method=moe", "routing.moe.router=expert_choice", "routing.moe.capacity_factor=0.75"),
    ("routing.method=mode_staged", "routing.moe.capacity_factor=null", "routing.causal_method=predictor"),
], ids=["token_choice_top2_shared", "expert_choice", "staged"])
def test_forward_flops_match_the_flop_counter(make_model, overrides):
    model, cfg = make_model(*overrides, "routing.every=2", "routing.offset=1", "routing.moe.num_experts=4",
                            "routing.capacity=0.5", "routing.moe.expert_hidden=40")
    T = 20
    tokens = tokens_for(cfg, 2, T)
    total, _ = _count(model, tokens, backward=False)
    est = estimate_flops(cfg.model, cfg.routing, T)
    assert total == 2 * est.forward


def test_integrated_flops_are_an_upper_bound(make_model):
    model, cfg = make_model("routing.method=mode_integrated", "routing.moe.router=expert_choice",
                            "routing.moe.num_experts=4", "routing.capacity=0.5")
    T = 20
    total, _ = _count(model, tokens_for(cfg, 2, T), backward=False)
    est = estimate_flops(cfg.model, cfg.routing, T)
    assert 0 < total <= 2 * est.forward


@pytest.mark.parametrize("override,key", [
    ("routing.moe.num_experts=0", "routing.moe.num_experts"),
    ("routing.moe.top_k=9", "routing.moe.top_k"),
    ("routing.moe.capacity_factor=0", "routing.moe.capacity_factor"),
    ("routing.moe.shared_experts=-1", "routing.moe.shared_experts"),
    ("routing.moe.z_loss_weight=-1", "routing.moe.z_loss_weight"),
    ("routing.moe.router=expert_choice routing.moe.capacity_factor=null", "routing.moe.capacity_factor"),
    ("routing.method=mode_integrated", "routing.moe.router"),
    ("parallel.ep=3", "parallel.ep"),  # 4 experts do not split over 3 expert-parallel ranks
])
def test_bad_config_names_the_key(make_config, override, key):
    with pytest.raises(ConfigError) as e:
        make_config(*MOE, *override.split())
    assert e.value.path == key


def test_inspect_reports_total_and_active_parameters(make_config):
    cfg = make_config(*MOE, "routing.moe.top_k=2", "routing.moe.shared_experts=1", "routing.moe.expert_hidden=24")
    info = inspect_config(cfg, zero_stage=1, tp=1, dp=1, micro_batch=2)
    model = build_model(cfg.model, cfg.routing, device="meta")
    d, per_expert = cfg.model.d_model, 3 * cfg.model.d_model * 24
    assert info["params"]["total"] == sum(p.numel() for p in model.parameters())
    # Two MoE layers (1 and 3); a token uses 2 of the 4 routed experts (no drops at capacity factor 1.25).
    assert info["params"]["active"] == info["params"]["total"] - 2 * (4 - 2) * per_expert
    assert "active per token" in format_report(cfg, info)
    dense = make_config()
    info = inspect_config(dense, zero_stage=1, tp=1, dp=1, micro_batch=2)
    assert info["params"]["active"] == info["params"]["total"] and d == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,E,D", [(7, 3, 5), (4, 4, 3), (1, 2, 17)])
def test_triton_group_permutation_equals_the_reference(N, E, D, dtype):
    pytest.importorskip("triton")
    ops = resolve("triton", DEVICE)
    gen = torch.Generator().manual_seed(N * 10 + E)
    sel = torch.rand(N, E, generator=gen) > 0.5
    sel[0] = False  # a token in no group
    src, _ = reference.group_rows(sel)
    inputs = [torch.randn(N, D, generator=gen), torch.randn(N, D, generator=gen),
              torch.rand(src.numel(), generator=gen), torch.randn(src.numel(), D, generator=gen)]
    results = []
    for mod in (reference, ops):
        x, h, w, y = (t.to(dtype).to(DEVICE).requires_grad_() for t in inputs)
        a, b = mod.permute_groups(x, src.to(x.device)), mod.unpermute_groups(h, src.to(x.device), w, y)
        ((a * 1.5).sum() + (b * b).sum()).backward()
        results.append([a, b, x.grad, h.grad, w.grad, y.grad])
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2 ** -6, "atol": 2e-2}
    for r, t in zip(*results):
        torch.testing.assert_close(t.float().cpu(), r.float().cpu(), **tol)


def test_moe_layer_on_the_triton_dispatch_equals_the_torch_one(make_model):
    pytest.importorskip("triton")
    model, layer, cfg = _layer(make_model, "routing.moe.top_k=2", "routing.moe.capacity_factor=1.0")
    x = torch.randn(2, 9, cfg.model.d_model, requires_grad=True)
    outs = []
    for backend in ("torch", "triton"):
        layer.moe.dispatch = backend
        out, _ = _run(layer, model.rope, x)
        outs.append((out, _grads(layer, out)))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
