"""Mixture-of-Depths: each known way public implementations get the routing wrong, tested.

The specification is megaroute/model/routing/mod.py's docstring: route -> top-k (sorted) -> gather
with original positions -> block update -> combine once, weighted by g(router logit).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaroute.kernels import cpu, reference
from megaroute.model import ForwardOptions, build_model
from megaroute.model.block import TransformerBlock
from megaroute.model.rope import Positions
from megaroute.model.routing import DenseLayer, MoDLayer, RoutingContext, dispatch

from .routing_checks import op_counts, tokens_for

MOD = ("routing.method=mod", "routing.every=2", "routing.offset=1")  # layers 1 and 3 routed of 4


def mod_layers(model) -> list[MoDLayer]:
    return [layer for layer in model.layers if isinstance(layer, MoDLayer)]


def unit_router_weight(monkeypatch, layer: MoDLayer) -> None:
    monkeypatch.setattr(layer, "weight_fn", lambda r: torch.ones_like(r))


def full_positions(rope, B: int, T: int) -> Positions:
    return Positions(rope, torch.arange(T).expand(B, T))


def gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return t.gather(1, idx.unsqueeze(-1).expand(-1, -1, t.shape[-1]))


@torch.no_grad()
def amplify(model, router: float = 1.0, attn: float = 1.0) -> None:
    """Make routing effects visible at init: the identity gate multiplies a block's update by a
    router logit of ~1e-3, and near-uniform attention hides positional effects."""
    for layer in mod_layers(model):
        layer.router.weight.mul_(router)
    for layer in model.layers:
        layer.block.attn.qkv.weight.mul_(attn)


@pytest.fixture
def make_layer(make_config):
    """A routed layer (with its model's RoPE) initialised exactly as inside a model."""

    def make(*overrides: str, seed: int = 0, attn: float = 1.0):
        cfg = make_config(*MOD, *overrides)
        torch.manual_seed(seed)
        model = build_model(cfg.model, cfg.routing)
        amplify(model, attn=attn)
        layer = model.layers[1]
        assert isinstance(layer, MoDLayer)
        return layer, model.rope, cfg

    return make


def run_layer(layer, rope, x, mode="topk"):
    ctx = RoutingContext(mode=mode)
    B, T, _ = x.shape
    return layer(x, full_positions(rope, B, T), ctx, "l"), ctx


# ----------------------------------------------------------------------------- structure


def test_routed_every_nth_block_each_with_its_own_router(make_model):
    model, cfg = make_model(*MOD)
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [DenseLayer, MoDLayer, DenseLayer, MoDLayer]
    assert all(isinstance(layer.block, TransformerBlock) for layer in model.layers)

    model, cfg = make_model("routing.method=mod", "routing.every=1", "routing.offset=0")
    routers = [layer.router.weight for layer in mod_layers(model)]
    assert len(routers) == cfg.model.n_layers
    assert len({id(w) for w in routers}) == len(routers)
    assert len({w.data_ptr() for w in routers}) == len(routers)
    names = [n for n, _ in model.named_parameters() if n.endswith("router.weight")]
    assert names == [f"layers.{i}.router.weight" for i in range(cfg.model.n_layers)]
    # independently initialised, independently trained
    assert not torch.equal(routers[0], routers[1])
    tokens = tokens_for(cfg, 2, 12)
    model(tokens, tokens).lm_loss.backward()
    grads = [w.grad for w in routers]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert not torch.allclose(grads[0], grads[1])
    # updating one router leaves the others untouched
    before = [w.detach().clone() for w in routers]
    with torch.no_grad():
        routers[0].add_(1.0)
    assert all(torch.equal(w, b) for w, b in zip(routers[1:], before[1:]))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("gate", ["identity", "sigmoid"])
@pytest.mark.parametrize("causal_method", ["aux_loss", "predictor"])
def test_router_receives_gradient_through_the_gate(make_model, gate, causal_method):
    # The LM loss alone (no auxiliary loss) must train the router: it sits on the gradient path.
    model, cfg = make_model(*MOD, f"routing.router_weight={gate}", f"routing.causal_method={causal_method}",
                            "routing.capacity=0.5")
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    out.lm_loss.backward()
    for layer in mod_layers(model):
        g = layer.router.weight.grad
        assert g is not None and torch.isfinite(g).all()
        assert g.abs().max() > 0


def test_router_gradient_in_causal_mode(make_model):
    model, cfg = make_model(*MOD)
    amplify(model, router=100.0)
    tokens = tokens_for(cfg, 2, 16)
    model(tokens, tokens, options=ForwardOptions(mode="causal")).lm_loss.backward()
    assert all(layer.router.weight.grad.abs().max() > 0 for layer in mod_layers(model))


# ----------------------------------------------------------------------------- exactness


def test_capacity_one_with_unit_gate_equals_dense(make_model, monkeypatch):
    dense, cfg = make_model(seed=7)
    mod, _ = make_model(*MOD, "routing.capacity=1.0", seed=11)
    result = mod.load_state_dict(dense.state_dict(), strict=False)
    # the MoD layer wraps the same TransformerBlock as `layer.block`; only the routers (and their
    # causal thresholds) are extra
    assert result.unexpected_keys == []
    assert sorted(result.missing_keys) == [f"layers.{i}.{key}" for i in (1, 3)
                                           for key in ("cut.threshold", "cut.updates", "router.weight")]
    tokens = tokens_for(cfg, 3, 13)
    ref = dense(tokens).logits

    # with the real (identity) gate the update is scaled by the router logit: not equal
    assert (mod(tokens).logits - ref).abs().max() > 1e-4

    for layer in mod_layers(mod):
        unit_router_weight(monkeypatch, layer)
    out = mod(tokens, tokens)
    assert torch.equal(out.logits, ref)
    assert out.routing_stats["layer_1/selected_frac"].item() == 1.0


def test_gathered_tokens_get_original_rope_positions(make_layer, monkeypatch):
    # attn=20: sharper attention than at init, so that positions visibly matter
    layer, rope, cfg = make_layer("routing.capacity=0.4", attn=20.0)
    unit_router_weight(monkeypatch, layer)
    B, T = 2, 13
    k = dispatch.capacity_k(T, 0.4)
    assert k == 5
    x = torch.randn(B, T, cfg.model.d_model)
    out, _ = run_layer(layer, rope, x)

    idx = layer.router(x).squeeze(-1).topk(k, dim=1).indices.sort(dim=1).values
    assert (idx != torch.arange(k)).any(dim=1).all(), "test needs selections that are not a prefix"
    x_sel = gather(x, idx)
    delta_mod = gather(out, idx) - x_sel

    # a plain TransformerBlock with the same weights, run on the gathered subset with explicit positions
    plain = TransformerBlock(cfg.model)
    plain.load_state_dict(layer.block.state_dict())
    delta_ref = plain(x_sel, Positions(rope, idx)) - x_sel
    torch.testing.assert_close(delta_mod, delta_ref, rtol=1e-5, atol=1e-6)

    # the known bug: positions 0..k-1 for the gathered tokens gives a different update
    delta_wrong = plain(x_sel, Positions(rope, torch.arange(k).expand(B, k))) - x_sel
    assert (delta_wrong - delta_ref).abs().max() > 1e-3
    assert (delta_mod - delta_wrong).abs().max() > 1e-3


@pytest.mark.parametrize("gate", ["identity", "sigmoid"])
def test_update_is_gate_times_block_delta(make_layer, gate):
    layer, rope, cfg = make_layer(f"routing.router_weight={gate}", "routing.capacity=0.3", attn=5.0)
    B, T = 3, 11
    x = torch.randn(B, T, cfg.model.d_model)
    out, _ = run_layer(layer, rope, x)
    logits = layer.router(x).squeeze(-1)
    idx = logits.topk(dispatch.capacity_k(T, 0.3), dim=1).indices.sort(dim=1).values
    r = logits.gather(1, idx)
    g = r if gate == "identity" else torch.sigmoid(r)
    x_sel = gather(x, idx)
    expected = x_sel + g.unsqueeze(-1) * layer.block.update(x_sel, Positions(rope, idx))
    torch.testing.assert_close(gather(out, idx), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_residual_added_exactly_once(make_layer, monkeypatch, mode):
    layer, rope, cfg = make_layer("routing.capacity=0.5")
    monkeypatch.setattr(layer.router, "forward", lambda x: x[..., :1] + 0.5)  # plenty selected in both modes
    x = torch.randn(2, 9, cfg.model.d_model)
    # a block whose update is exactly zero must leave every token exactly as it was
    with torch.no_grad():
        layer.block.attn.out.weight.zero_()
        layer.block.mlp.down.weight.zero_()
    out, ctx = run_layer(layer, rope, x, mode)
    assert ctx.stats["l/selected_frac"] > 0
    assert torch.equal(out, x)


def test_selected_tokens_equal_block_output_with_unit_router_weight(make_layer, monkeypatch):
    # out[idx] = x[idx] + 1 * delta = block(x[idx]); a second residual would give x[idx] + block(x[idx])
    layer, rope, cfg = make_layer("routing.capacity=0.5")
    unit_router_weight(monkeypatch, layer)
    x = torch.randn(2, 10, cfg.model.d_model)
    out, _ = run_layer(layer, rope, x)
    idx = layer.router(x).squeeze(-1).topk(5, dim=1).indices.sort(dim=1).values
    torch.testing.assert_close(gather(out, idx), layer.block(gather(x, idx), Positions(rope, idx)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["topk", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unselected_tokens_are_bit_identical(make_layer, mode, dtype):
    layer, rope, cfg = make_layer("routing.capacity=0.25")
    layer.to(dtype)
    x = torch.randn(3, 13, cfg.model.d_model, dtype=dtype)
    out, ctx = run_layer(layer, rope, x, mode)
    logits = layer.router(x).squeeze(-1)
    if mode == "topk":
        selected = dispatch.indices_to_mask(logits.topk(dispatch.capacity_k(13, 0.25), dim=1).indices, 13)
    else:
        selected = logits > 0
    assert 0 < selected.sum() < selected.numel()
    assert torch.equal(out[~selected], x[~selected])
    # the selected ones did change (in bf16 a tiny gated update may round away on some rows)
    changed = (out[selected] - x[selected]).abs().amax(dim=-1) > 0
    assert changed.all() if dtype == torch.float32 else changed.any()
    assert out.dtype == dtype


# ----------------------------------------------------------------------------- shapes and k


@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (3, 7), (2, 13), (4, 32)])
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_batch_and_odd_lengths(make_model, B, T, mode):
    model, cfg = make_model(*MOD, "routing.capacity=0.25")
    amplify(model, router=50.0)
    tokens = tokens_for(cfg, B, T)
    out = model(tokens, tokens, options=ForwardOptions(mode=mode))
    assert out.logits.shape == (B, T, cfg.model.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    if mode == "topk":
        for name in ("layer_1", "layer_3"):
            assert out.routing_stats[f"{name}/selected_frac"].item() == pytest.approx(
                dispatch.capacity_k(T, 0.25) / T)


@pytest.mark.parametrize(
    "T,c,k",
    [(1, 0.125, 1), (3, 0.125, 1), (8, 0.125, 1), (256, 0.125, 32), (13, 0.25, 3), (7, 0.5, 4),
     (7, 1.0, 7), (5, 1e-6, 1), (4096, 0.125, 512)],
)
def test_capacity_k(T, c, k):
    assert dispatch.capacity_k(T, c) == k


@pytest.mark.parametrize("T", [1, 2, 3, 7])
def test_tiny_capacity_still_selects_one_token(make_layer, T):
    layer, rope, cfg = make_layer("routing.capacity=0.001")
    B = 3
    x = torch.randn(B, T, cfg.model.d_model)
    out, ctx = run_layer(layer, rope, x)
    changed = (out != x).any(dim=-1)
    assert changed.sum(dim=1).tolist() == [1] * B
    assert ctx.stats["l/selected_frac"].item() == pytest.approx(1 / T)


@pytest.mark.parametrize("causal_method", ["aux_loss", "predictor"])
def test_causal_mode_with_no_token_selected(make_layer, make_model, monkeypatch, causal_method):
    layer, rope, cfg = make_layer(f"routing.causal_method={causal_method}")
    # force every decision logit negative: router [B, T, 1] or predictor [B, T]
    if causal_method == "aux_loss":
        monkeypatch.setattr(layer.router, "forward", lambda h: -1.0 - h.square().sum(-1, keepdim=True))
    else:
        monkeypatch.setattr(layer.predictor, "forward", lambda h: -1.0 - h.square().sum(-1))
    x = torch.randn(2, 7, cfg.model.d_model)
    out, ctx = run_layer(layer, rope, x, "causal")
    assert torch.equal(out, x)
    assert ctx.stats["l/selected_frac"].item() == 0.0
    # topk mode still selects k >= 1
    out, ctx = run_layer(layer, rope, x, "topk")
    assert ctx.stats["l/selected_frac"].item() > 0

    # a whole model whose routers all decline: runs, and backward works
    model, cfg = make_model(*MOD, f"routing.causal_method={causal_method}")
    for mod_layer in mod_layers(model):
        with torch.no_grad():
            if causal_method == "aux_loss":
                mod_layer.router.weight.zero_()  # logit 0 is not > 0
            else:
                mod_layer.predictor.net[-1].weight.zero_()
                mod_layer.predictor.net[-1].bias.fill_(-1.0)
    tokens = tokens_for(cfg, 2, 9)
    res = model(tokens, tokens, options=ForwardOptions(mode="causal"))
    assert res.routing_stats["layer_1/selected_frac"].item() == 0.0
    assert torch.isfinite(res.loss)
    res.loss.backward()


def test_causal_mode_ragged_selection_across_the_batch(make_layer, monkeypatch):
    # sequence 0 selects nothing, sequence 1 some tokens, sequence 2 all: each equals its own run
    layer, rope, cfg = make_layer(attn=5.0)
    B, T, D = 3, 9, cfg.model.d_model
    x = torch.randn(B, T, D)
    fixed = torch.randn(B, T)
    fixed[0] = -fixed[0].abs() - 0.1
    fixed[2] = fixed[2].abs() + 0.1
    fixed[1, :] = torch.tensor([1.0, -1, -1, 2, 0.5, -1, -2, 3, -1])
    monkeypatch.setattr(layer.router, "forward", lambda h: fixed[: h.shape[0]].unsqueeze(-1))
    out, ctx = run_layer(layer, rope, x, "causal")
    assert ctx.stats["l/selected_frac"].item() == pytest.approx((0 + 4 + 9) / (B * T))
    assert torch.equal(out[0], x[0])
    for b in (1, 2):
        sel = (fixed[b] > 0).nonzero().squeeze(-1).unsqueeze(0)
        x_sel = gather(x[b: b + 1], sel)
        expected = x_sel + fixed[b: b + 1].gather(1, sel).unsqueeze(-1) * layer.block.update(
            x_sel, Positions(rope, sel))
        torch.testing.assert_close(gather(out[b: b + 1], sel), expected, rtol=1e-5, atol=1e-6)
        unselected = fixed[b] <= 0
        assert torch.equal(out[b][unselected], x[b][unselected])


# ----------------------------------------------------------------------------- batching


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_batch_equals_per_sample(make_model, mode):
    model, cfg = make_model(*MOD, "routing.capacity=0.3")
    amplify(model, router=50.0, attn=5.0)
    tokens = tokens_for(cfg, 4, 11)
    batched = model(tokens, options=ForwardOptions(mode=mode)).logits
    single = torch.cat([model(tokens[b: b + 1], options=ForwardOptions(mode=mode)).logits for b in range(4)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_no_per_sample_python_loop(make_model, mode):
    # The number of torch calls a forward makes does not depend on the batch size.
    model, cfg = make_model(*MOD, "routing.causal_method=predictor")
    counts = op_counts(lambda B: model(tokens_for(cfg, B, 12), options=ForwardOptions(mode=mode)))
    assert sum(counts[0].values()) > 50
    assert counts[0] == counts[1]


# ----------------------------------------------------------------------------- statistics


def _capture_router_logits(model):
    captured = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer, MoDLayer):
            layer.router.register_forward_hook(
                lambda mod, inp, out, i=i: captured.__setitem__(i, out.detach().squeeze(-1)))
    return captured


def test_selected_frac_and_router_stats(make_model):
    model, cfg = make_model(*MOD, "routing.capacity=0.25")
    amplify(model, router=50.0)
    captured = _capture_router_logits(model)
    T = 13
    tokens = tokens_for(cfg, 3, T)
    out = model(tokens)
    for i in (1, 3):
        stats = {k.split("/")[1]: v for k, v in out.routing_stats.items() if k.startswith(f"layer_{i}/")}
        assert set(stats) == {"selected_frac", "router_logit_mean", "router_logit_std", "causal_agreement"}
        assert stats["selected_frac"].item() == pytest.approx(3 / 13)  # k = round(3.25) = 3
        assert stats["router_logit_mean"].item() == pytest.approx(captured[i].mean().item(), abs=1e-6)
        assert stats["router_logit_std"].item() == pytest.approx(captured[i].std().item(), abs=1e-6)
        assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())

    out = model(tokens, options=ForwardOptions(mode="causal"))
    for i in (1, 3):
        frac = out.routing_stats[f"layer_{i}/selected_frac"].item()
        threshold = model.layers[i].cut.threshold  # set by the training-mode forward above
        assert frac == pytest.approx((captured[i] > threshold).float().mean().item())
        assert 0 < frac < 1
        assert f"layer_{i}/causal_agreement" not in out.routing_stats  # needs top-k to compare with


@pytest.mark.parametrize("causal_method", ["aux_loss", "predictor"])
def test_causal_agreement(make_layer, causal_method):
    layer, rope, cfg = make_layer(f"routing.causal_method={causal_method}", "routing.capacity=0.25")
    x = torch.randn(4, 16, cfg.model.d_model)
    _, ctx = run_layer(layer, rope, x)
    agreement = ctx.stats["l/causal_agreement"]
    assert 0.0 <= agreement.item() <= 1.0
    logits = layer.router(x).squeeze(-1)
    selected = dispatch.indices_to_mask(logits.topk(4, dim=1).indices, 16)
    decision = (logits if causal_method == "aux_loss" else layer.predictor(x)) > 0
    assert agreement.item() == pytest.approx((decision == selected).float().mean().item())


# ----------------------------------------------------------------------------- causality


@pytest.mark.parametrize("causal_method", ["aux_loss", "predictor"])
def test_causal_mode_is_causal(make_model, causal_method):
    model, cfg = make_model(*MOD, f"routing.causal_method={causal_method}", "routing.capacity=0.25")
    amplify(model, router=50.0, attn=5.0)
    if causal_method == "predictor":
        with torch.no_grad():  # a predictor that is not ~0 everywhere, so decisions vary with input
            for layer in mod_layers(model):
                layer.predictor.net[-1].weight.mul_(50.0)
    T = 16
    tokens = tokens_for(cfg, 2, T)
    base = model(tokens, options=ForwardOptions(mode="causal"))
    for name in ("layer_1", "layer_3"):
        assert 0 < base.routing_stats[f"{name}/selected_frac"].item() < 1
    for t in (0, 3, 8, 14):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] * 7 + 3) % cfg.model.vocab_size
        logits = model(changed, options=ForwardOptions(mode="causal")).logits
        torch.testing.assert_close(logits[:, : t + 1], base.logits[:, : t + 1], rtol=0, atol=1e-5)
        assert (logits[:, t + 1:] - base.logits[:, t + 1:]).abs().max() > 1e-3


def test_topk_mode_is_not_causal(make_model):
    """Top-k over the sequence sees the future: a later token can push an earlier one out of the
    selection and so change earlier logits. That is why `topk` is for training only and
    evaluation/sampling must use ForwardOptions(mode="causal")."""
    model, cfg = make_model(*MOD, "routing.capacity=0.125")
    amplify(model, router=50.0, attn=5.0)
    T, t = 16, 7
    tokens = tokens_for(cfg, 1, T)
    base = model(tokens).logits
    worst = 0.0
    for trial in range(20):
        changed = tokens.clone()
        changed[:, t + 1:] = tokens_for(cfg, 1, T - t - 1, seed=100 + trial)
        worst = max(worst, (model(changed).logits[:, : t + 1] - base[:, : t + 1]).abs().max().item())
        if worst > 1e-3:
            break
    assert worst > 1e-3  # far above the 1e-5 the causal mode is held to


# ----------------------------------------------------------------------------- auxiliary losses


def test_aux_loss_method_adds_router_bce(make_model):
    model, cfg = make_model(*MOD, "routing.causal_method=aux_loss", "routing.aux_loss_weight=0.5",
                            "routing.capacity=0.25")
    captured = _capture_router_logits(model)
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    assert set(out.aux_losses) == {"layer_1/router_bce", "layer_3/router_bce"}
    for i in (1, 3):
        logits = captured[i]
        target = dispatch.indices_to_mask(logits.topk(4, dim=1).indices, 16).float()
        expected = 0.5 * F.binary_cross_entropy_with_logits(logits, target)
        torch.testing.assert_close(out.aux_losses[f"layer_{i}/router_bce"].detach(), expected)
    torch.testing.assert_close(out.loss, out.lm_loss + sum(out.aux_losses.values()))
    # the BCE trains the router
    grad = torch.autograd.grad(out.aux_losses["layer_1/router_bce"], mod_layers(model)[0].router.weight)[0]
    assert grad.abs().max() > 0

    assert model(tokens, tokens, options=ForwardOptions(mode="causal")).aux_losses == {}  # evaluation: no aux loss
    off, _ = make_model(*MOD, "routing.aux_loss_weight=0")
    res = off(tokens, tokens)
    assert res.aux_losses == {} and res.loss is res.lm_loss


def test_predictor_method_adds_predictor_bce(make_model):
    model, cfg = make_model(*MOD, "routing.causal_method=predictor", "routing.predictor_loss_weight=0.25",
                            "routing.predictor_hidden=16")
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    assert set(out.aux_losses) == {"layer_1/predictor_bce", "layer_3/predictor_bce"}
    assert all(torch.isfinite(v) and v > 0 for v in out.aux_losses.values())
    torch.testing.assert_close(out.loss, out.lm_loss + sum(out.aux_losses.values()))
    assert all(layer.predictor.net[0].out_features == 16 for layer in mod_layers(model))
    # aux_loss models have no predictor at all
    plain, _ = make_model(*MOD, "routing.causal_method=aux_loss")
    assert all(layer.predictor is None for layer in mod_layers(plain))


def test_predictor_reads_a_stop_gradient_copy(make_model):
    model, cfg = make_model(*MOD, "routing.causal_method=predictor")
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    predictor_loss = sum(v for k, v in out.aux_losses.items() if k.endswith("predictor_bce"))
    named = list(model.named_parameters())
    grads = torch.autograd.grad(predictor_loss, [p for _, p in named], allow_unused=True)
    for (name, _), grad in zip(named, grads):
        if ".predictor." in name:
            if name.endswith("weight"):
                assert grad is not None and grad.abs().max() > 0, name
        else:
            assert grad is None or not grad.any(), f"predictor loss leaked into {name}"
    # while the LM loss does reach the blocks and the embedding
    lm_grads = torch.autograd.grad(out.lm_loss, [model.embed.weight, mod_layers(model)[0].block.attn.qkv.weight])
    assert all(g.abs().max() > 0 for g in lm_grads)


# ----------------------------------------------------------------------------- dispatch primitives


def test_dispatch_primitives():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.8, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    idx = dispatch.topk_indices(scores, 2)
    assert idx.tolist() == [[1, 3], [0, 1]]
    mask = torch.tensor([[False, True, False, True, False], [False] * 5, [True] * 5])
    order, valid = dispatch.mask_indices(mask)
    assert order.shape == (3, 5)
    assert order[0, :2].tolist() == [1, 3] and valid[0].tolist() == [True, True, False, False, False]
    assert not valid[1].any()
    assert order[2].tolist() == [0, 1, 2, 3, 4] and valid[2].all()
    assert torch.equal(dispatch.indices_to_mask(idx, 5), torch.tensor(
        [[False, True, False, True, False], [True, True, False, False, False]]))
    x = torch.randn(2, 5, 3)
    out = reference.combine(x, idx, torch.full((2, 2), 2.0), torch.ones(2, 2, 3))
    assert torch.equal(out[0, [0, 2, 4]], x[0, [0, 2, 4]])
    torch.testing.assert_close(out[0, [1, 3]], x[0, [1, 3]] + 2.0)
    assert torch.equal(reference.gather(x, idx)[1], x[1, :2])


def test_router_scores_in_the_residual_streams_precision_under_autocast(make_model):
    """The router is float32 on a float32 stream even inside bf16 autocast (selective precision);
    a bf16 stream keeps bf16; its gradient reaches x and the weight in their own dtypes."""
    model, cfg = make_model(*MOD)
    router = mod_layers(model)[0].router
    x = torch.randn(2, 5, cfg.model.d_model, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x @ router.weight.t(), rtol=1e-6, atol=1e-6)
    logits.sum().backward()
    assert x.grad.dtype == torch.float32 and router.weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert router(x.detach().bfloat16()).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- the router's fused node


def _training_call(layer, rope, x, autocast: bool):
    """One training-mode call and backward (output grad fixed, auxiliary losses included): -> (output,
    statistics, x's gradient, the layer's parameter gradients), the threshold's state restored after."""
    state = {k: v.clone() for k, v in layer.cut.state_dict().items()}
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, ctx = run_layer(layer, rope, x)
        aux = sum(ctx.aux_losses.values())
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    torch.autograd.backward([out, aux], [grad_out, torch.ones(())])
    layer.cut.load_state_dict(state)
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), ctx.stats, x.grad, grads


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal_method", ["aux_loss", "predictor"])
@pytest.mark.parametrize("gate", ["sigmoid", "identity"])
def test_the_fused_router_node_matches_calling_the_router(make_layer, monkeypatch, autocast, causal_method, gate):
    """MoD's training layer takes the router's logits, their top-k and the gathered rows from one autograd
    node (mod._RouteTopkGather), whose backward sums x's three gradients in one pass (the CPU kernels'
    router_grads): the same output and statistics bit for bit, and the same gradients (summed in
    another order), as the router module called and the rows gathered by the dispatcher (Router.fused
    False)."""
    from megaroute.model.routing import mod

    layer, rope, cfg = make_layer(f"routing.causal_method={causal_method}", f"routing.router_weight={gate}")
    x = torch.randn(3, 11, cfg.model.d_model, generator=torch.Generator().manual_seed(0))
    calls, kernel_calls = [], []
    apply = mod._RouteTopkGather.apply
    monkeypatch.setattr(mod._RouteTopkGather, "apply", lambda *args: calls.append(1) or apply(*args))
    kernels = cpu.load()  # its backward's one-pass kernel where the CPU kernels are built
    if kernels is not None:
        router_grads = kernels.router_grads
        monkeypatch.setattr(kernels, "router_grads", lambda *args: kernel_calls.append(1) or router_grads(*args))
    fused = _training_call(layer, rope, x, autocast)
    assert calls == [1] and kernel_calls == ([1] if kernels is not None else [])
    layer.router.fused = False
    plain = _training_call(layer, rope, x, autocast)
    assert calls == [1]
    assert torch.equal(fused[0], plain[0])
    assert fused[1].keys() == plain[1].keys() and all(torch.equal(fused[1][k], plain[1][k]) for k in plain[1])
    torch.testing.assert_close(fused[2], plain[2], rtol=1e-6, atol=1e-6)
    assert fused[3].keys() == plain[3].keys() and "router.weight" in plain[3]
    for name in plain[3]:
        torch.testing.assert_close(fused[3][name], plain[3][name], rtol=1e-6, atol=1e-6, msg=name)


def test_the_router_node_steps_aside_whenever_a_router_call_is_observable(make_layer, monkeypatch):
    """Router.gathers: the fused node only where calling the module would be exactly Router.forward and
    nobody could see the difference; a forward hook on the router still sees every training call."""
    layer, rope, cfg = make_layer()
    router = layer.router
    x = torch.randn(2, 9, cfg.model.d_model)
    assert router.gathers(x)
    with torch.no_grad():
        assert not router.gathers(x)
    assert not router.gathers(x.double()) and not router.gathers(x.bfloat16())
    seen = []
    handle = router.register_forward_hook(lambda module, args, out: seen.append(out))
    assert not router.gathers(x)
    out, _ = run_layer(layer, rope, x.requires_grad_())
    assert len(seen) == 1 and seen[0].shape == (2, 9, 1)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    assert not router.gathers(x)
    handle.remove()
    assert router.gathers(x)
    router.fused = False
    assert not router.gathers(x)
    router.fused = True
    monkeypatch.setattr(router.weight, "ds_id", 0, raising=False)  # partitioned by ZeRO-3
    assert not router.gathers(x)
    monkeypatch.delattr(router.weight, "ds_id")
    monkeypatch.setattr(router, "forward", lambda h: h[..., :1])
    assert not router.gathers(x)


@pytest.mark.parametrize("outputs", [(0, 2, 3), (0,), (2,), (3,), (0, 3)], ids=["all", "logits", "rows", "x", "logits+x"])
def test_the_router_node_passes_gradcheck(outputs):
    """_RouteTopkGather's backward in float64 against finite differences, with gradients reaching it through
    every subset of its outputs (the branches where the others are None)."""
    from megaroute.model.routing import mod

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 5, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        out = mod._RouteTopkGather.apply(x, w, 3)
        return tuple(out[i] for i in outputs)

    assert torch.autograd.gradcheck(fn, (x, w))


@pytest.mark.parametrize("outputs", [(0, 2, 3), (0, 3), (2, 3), (0, 2), (2,)], ids=["all", "logits+x", "rows+x", "logits+rows", "rows"])
def test_the_router_nodes_torch_backward_returns_x_shaped_gradients(monkeypatch, outputs):
    """The router node's backward without the CPU kernels (CUDA, or no extension) returns x's gradient
    as a tensor of its own, not a view: autograd adds the next gradient reaching x into it in place only
    then. Its values are the kernel path's (or, without the kernels, autograd's of the plain ops)."""
    from megaroute.model.routing import mod

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 5, generator=gen, requires_grad=True)
    w = torch.randn(1, 5, generator=gen, requires_grad=True)
    grads_out = [None if s is None else torch.randn(s, generator=gen) for s in [(2, 7), None, (2, 3, 5), (2, 7, 5)]]

    def backward():
        x.grad = w.grad = None
        out = mod._RouteTopkGather.apply(x, w, 3)
        seen = []
        out[0].grad_fn.register_hook(lambda grad_inputs, _grad_outputs: seen.append(grad_inputs[0]))
        torch.autograd.backward([out[i] for i in outputs], [grads_out[i] for i in outputs])
        return seen[0], x.grad.clone(), None if w.grad is None else w.grad.clone()

    with_kernels = backward()
    monkeypatch.setattr(mod.cpu, "usable", lambda *tensors, **kwargs: None)
    returned, grad_x, grad_w = backward()
    assert returned.shape == x.shape and not returned._is_view()
    logits = x.detach().reshape(-1, 5) @ w.detach().t()
    idx = logits.view(2, 7).topk(3, dim=1).indices.sort(dim=1).values
    expect = torch.zeros(2, 7, 5)
    if 3 in outputs:
        expect += grads_out[3]
    if 0 in outputs:
        expect += grads_out[0].unsqueeze(-1) * w.detach()
    if 2 in outputs:
        expect.scatter_add_(1, idx.unsqueeze(-1).expand(-1, -1, 5), grads_out[2])
    torch.testing.assert_close(grad_x, expect)
    torch.testing.assert_close(grad_x, with_kernels[1])
    if grad_w is not None:
        torch.testing.assert_close(grad_w, with_kernels[2])


@pytest.mark.parametrize("layout", ["sliced", "transposed"])
def test_the_router_node_takes_a_non_contiguous_gradient_of_x(layout):
    """x's incoming gradient may be strided: a sliced one (rows contiguous) is copied for the CPU kernel,
    a transposed one takes the torch ops; either way x's and w's gradients are autograd's of the plain ops."""
    from megaroute.model.routing import mod

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 5, generator=gen, requires_grad=True)
    w = torch.randn(1, 5, generator=gen, requires_grad=True)
    g_logits, g_rows = torch.randn(2, 7, generator=gen), torch.randn(2, 3, 5, generator=gen)
    g_x = (torch.randn(2, 7, 8, generator=gen)[..., :5] if layout == "sliced"
           else torch.randn(2, 5, 7, generator=gen).transpose(1, 2))
    assert not g_x.is_contiguous()
    logits, _, rows, routed = mod._RouteTopkGather.apply(x, w, 3)
    torch.autograd.backward([logits, rows, routed], [g_logits, g_rows, g_x])

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_logits = (xr.reshape(-1, 5) @ wr.t()).view(2, 7)
    idx = ref_logits.detach().topk(3, dim=1).indices.sort(dim=1).values
    ref_rows = xr.gather(1, idx.unsqueeze(-1).expand(-1, -1, 5))
    torch.autograd.backward([ref_logits, ref_rows, xr], [g_logits, g_rows, g_x])
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
