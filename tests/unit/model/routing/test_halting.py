"""Token-selective halting gates: soft p-scaled updates, the depth penalty, hard skipping at tau, TLOps."""

from __future__ import annotations

import math

import pytest
import torch

from megaroute.model import ForwardOptions
from megaroute.model.rope import Positions
from megaroute.model.routing import DenseLayer, HaltingLayer, RoutingContext, freeze_base

from .routing_checks import assert_causal, op_counts, record_updates, rows, tokens_for

HALT = ("routing.method=halting", "routing.every=2", "routing.offset=1")  # layers 1 and 3 of 4


def halting_layers(model) -> list[HaltingLayer]:
    return [layer for layer in model.layers if isinstance(layer, HaltingLayer)]


@torch.no_grad()
def spread_gates(model, attn: float = 5.0) -> None:
    """At init p ~ sigmoid(init_bias) for every token; make p vary across tokens around 0.5."""
    for layer in halting_layers(model):
        layer.halt.net[0].weight.mul_(60.0)
        layer.halt.net[2].weight.mul_(300.0)
        layer.halt.bias.zero_()
    for layer in model.layers:
        layer.block.attn.qkv.weight.mul_(attn)


def capture_p(model) -> dict[int, torch.Tensor]:
    captured = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer, HaltingLayer):
            layer.halt.register_forward_hook(lambda m, inp, out, i=i: captured.__setitem__(i, out))
    return captured


def run_layer(layer, rope, x, mode):
    ctx = RoutingContext(mode=mode)
    B, T, _ = x.shape
    return layer(x, Positions(rope, torch.arange(T).expand(B, T)), ctx, "l"), ctx


# ----------------------------------------------------------------------------- structure and init


def test_gated_blocks_and_initial_p_survives_model_init(make_model):
    model, cfg = make_model(*HALT, "routing.halting.init_bias=1.5", "routing.halting.hidden=8")
    assert [type(layer) for layer in model.layers] == [DenseLayer, HaltingLayer, DenseLayer, HaltingLayer]
    for layer in halting_layers(model):
        assert layer.halt.net[0].out_features == 8
        assert layer.halt.bias.item() == 1.5  # not zeroed by Transformer.reset_parameters
    out = model(tokens_for(cfg, 2, 16))
    for name in ("layer_1", "layer_3"):
        assert out.routing_stats[f"{name}/p_mean"].item() == pytest.approx(1 / (1 + math.exp(-1.5)), abs=0.01)
    # controller-only training trains exactly the gates
    trainable = freeze_base(model)
    assert trainable and all(".halt." in name for name in trainable)
    assert len(trainable) == 2 * 4  # net.0.weight, net.0.bias, net.2.weight, bias per gated layer


# ----------------------------------------------------------------------------- soft mode


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_soft_update_is_p_times_block_update(make_model, mode):
    model, cfg = make_model(*HALT)
    spread_gates(model)
    layer = model.layers[1]
    B, T = 2, 11
    x = torch.randn(B, T, cfg.model.d_model)
    out, ctx = run_layer(layer, model.rope, x, mode)
    p = layer.halt(x)
    assert 0.05 < (p >= 0.5).float().mean() < 0.95, "test needs p on both sides of tau"
    expected = x + p.unsqueeze(-1) * layer.block.update(x, Positions(model.rope, torch.arange(T).expand(B, T)))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert ctx.stats["l/p_mean"].item() == pytest.approx(p.mean().item(), abs=1e-6)
    assert ctx.stats["l/exec_frac"].item() == pytest.approx((p >= 0.5).float().mean().item())


def test_gates_and_base_get_gradients_from_the_lm_loss(make_model):
    model, cfg = make_model(*HALT)
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    assert out.aux_losses == {}  # penalty 0 by default
    out.lm_loss.backward()
    for layer in halting_layers(model):
        for name, p in layer.halt.named_parameters():
            assert p.grad is not None and p.grad.abs().max() > 0, name
        assert layer.block.mlp.down.weight.grad.abs().max() > 0
    assert model.embed.weight.grad.abs().max() > 0


@pytest.mark.parametrize("penalty", [0.0, 0.3])
def test_depth_penalty(make_model, penalty):
    model, cfg = make_model(*HALT, f"routing.halting.penalty={penalty}")
    p = capture_p(model)
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    if penalty == 0:
        assert out.aux_losses == {} and out.loss is out.lm_loss
        return
    assert set(out.aux_losses) == {"layer_1/depth_penalty", "layer_3/depth_penalty"}
    for i in (1, 3):
        torch.testing.assert_close(out.aux_losses[f"layer_{i}/depth_penalty"], penalty * p[i].mean())
    torch.testing.assert_close(out.loss, out.lm_loss + sum(out.aux_losses.values()))
    # the penalty alone pushes every gate's p down (d loss / d bias > 0)
    grads = torch.autograd.grad(sum(out.aux_losses.values()), [layer.halt.bias for layer in halting_layers(model)])
    assert all(g > 0 for g in grads)
    assert model(tokens, tokens, options=ForwardOptions(mode="hard")).aux_losses == {}  # inference: no penalty


# ----------------------------------------------------------------------------- hard mode


def test_hard_tau_zero_equals_soft_with_p_one(make_model, monkeypatch):
    model, cfg = make_model(*HALT, "routing.halting.tau=0.0")
    spread_gates(model)
    tokens = tokens_for(cfg, 3, 13)
    hard = model(tokens, options=ForwardOptions(mode="hard"))
    assert hard.routing_stats["tlops_frac"].item() == 1.0
    soft_real = model(tokens).logits
    assert (soft_real - hard.logits).abs().max() > 1e-4  # p < 1 really scales the soft update
    for layer in halting_layers(model):
        monkeypatch.setattr(layer.halt, "forward", lambda x: x.new_ones(x.shape[:-1]))
    soft_one = model(tokens).logits
    torch.testing.assert_close(hard.logits, soft_one, rtol=0, atol=1e-6)


def test_hard_mode_runs_only_tokens_with_p_at_least_tau(make_model):
    model, cfg = make_model(*HALT, "routing.halting.tau=0.5")
    spread_gates(model)
    layer = model.layers[1]
    B, T = 3, 12
    x = torch.randn(B, T, cfg.model.d_model)
    out, ctx = run_layer(layer, model.rope, x, "hard")
    runs = layer.halt(x) >= 0.5
    assert 0 < runs.sum() < runs.numel()
    assert torch.equal(out[~runs], x[~runs])  # skipped tokens: bit-identical
    for b in range(B):  # brute force: the executing tokens alone, at their original positions, weight 1
        sel = runs[b].nonzero().squeeze(-1)
        x_sel = x[b: b + 1, sel]
        expected = x_sel + layer.block.update(x_sel, Positions(model.rope, sel.unsqueeze(0)))
        torch.testing.assert_close(out[b: b + 1, sel], expected, rtol=1e-5, atol=1e-6)
    assert ctx.aux_losses == {}


def test_hard_mode_with_every_token_skipping(make_model):
    model, cfg = make_model(*HALT, "routing.halting.tau=1.0")  # sigmoid < 1: nobody runs a gated block
    tokens = tokens_for(cfg, 2, 9)
    out = model(tokens, tokens, options=ForwardOptions(mode="hard"))
    assert out.routing_stats["layer_1/exec_frac"].item() == 0.0
    assert out.routing_stats["tlops_frac"].item() == pytest.approx(0.5)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("mode", ["topk", "causal", "hard"])
def test_tlops_counts_are_exact(make_model, monkeypatch, mode):
    model, cfg = make_model(*HALT, "routing.halting.tau=0.5")
    spread_gates(model)
    calls = record_updates(monkeypatch, model)
    p = capture_p(model)
    T = 16
    out = model(tokens_for(cfg, 1, T),
                options=ForwardOptions(mode=mode))  # B = 1: no padding rows in the ragged dispatch
    n_layers = cfg.model.n_layers
    executed = 0
    for i in range(n_layers):
        if i in p:
            at_tau = int((p[i] >= 0.5).sum())
            assert 0 < at_tau < T
            assert out.routing_stats[f"layer_{i}/exec_frac"].item() == pytest.approx(at_tau / T)
            assert rows(calls, i) == (at_tau if mode == "hard" else T)  # soft runs every token
            if mode == "hard":
                assert torch.equal(calls[i][0][0], (p[i][0] >= 0.5).nonzero().squeeze(-1))
            executed += at_tau
        else:
            assert rows(calls, i) == T
            executed += T
    assert out.routing_stats["tlops_frac"].item() == pytest.approx(executed / (n_layers * T))


def test_hard_mode_batch_equals_per_sample(make_model):
    model, cfg = make_model(*HALT)
    spread_gates(model)
    tokens = tokens_for(cfg, 4, 11)
    batched = model(tokens, options=ForwardOptions(mode="hard")).logits
    single = torch.cat([model(tokens[b: b + 1], options=ForwardOptions(mode="hard")).logits for b in range(4)])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)
    # no per-sample Python loop: torch calls do not grow with B (tau = 0: every layer dispatches)
    model, cfg = make_model(*HALT, "routing.halting.tau=0.0")
    counts = op_counts(lambda B: model(tokens_for(cfg, B, 12), options=ForwardOptions(mode="hard")))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("mode", ["causal", "hard"])
def test_evaluation_modes_are_causal(make_model, mode):
    model, cfg = make_model(*HALT)
    spread_gates(model)
    tokens = tokens_for(cfg, 2, 16)
    stats = model(tokens, options=ForwardOptions(mode=mode)).routing_stats
    assert all(0 < stats[f"layer_{i}/exec_frac"].item() < 1 for i in (1, 3))
    assert_causal(lambda t: model(t, options=ForwardOptions(mode=mode)).logits, tokens, cfg.model.vocab_size)


# ----------------------------------------------------------------------------- hard training forward

HARD_TRAIN = (*HALT, "routing.halting.train_forward=hard")


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_hard_training_forward_equals_hard_inference(make_model, mode):
    model, cfg = make_model(*HARD_TRAIN)
    spread_gates(model)
    tokens = tokens_for(cfg, 3, 13)
    hard = model(tokens, options=ForwardOptions(mode="hard"))
    train = model(tokens, options=ForwardOptions(mode=mode))
    assert torch.equal(train.logits, hard.logits)  # the straight-through weight's value is exactly 1
    assert 0 < train.routing_stats["tlops_frac"].item() < 1
    assert train.routing_stats["tlops_frac"].item() == hard.routing_stats["tlops_frac"].item()


def test_hard_training_straight_through_gradient(make_model):
    """d out / d p = the block's update (on the kept tokens alone) for kept tokens; skipped: 0."""
    model, cfg = make_model(*HARD_TRAIN)
    spread_gates(model)
    layer = model.layers[1]
    B, T = 2, 12
    x = torch.randn(B, T, cfg.model.d_model)
    p = layer.halt(x).detach().requires_grad_()
    layer.halt.forward = lambda _: p  # the instance attribute shadows the module's forward
    out, ctx = run_layer(layer, model.rope, x, "topk")
    runs = p >= 0.5
    assert 0 < runs.sum() < runs.numel()
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * g).sum(), p)
    assert torch.equal(grad[~runs], torch.zeros_like(grad[~runs]))
    for b in range(B):
        sel = runs[b].nonzero().squeeze(-1)
        u = layer.block.update(x[b: b + 1, sel], Positions(model.rope, sel.unsqueeze(0)))[0]
        torch.testing.assert_close(grad[b, sel], (u * g[b, sel]).sum(-1), rtol=1e-4, atol=1e-5)
    assert ctx.aux_losses == {}  # penalty 0


@pytest.mark.parametrize("train_forward", ["soft", "hard"])
def test_target_skip_penalty(make_model, train_forward):
    """lambda * (f - (1 - s))^2, f = fraction with p >= tau; its gradient 2 lambda (f - (1 - s)) d mean(p)."""
    lam, s = 0.7, 0.25
    model, cfg = make_model(*HALT, f"routing.halting.train_forward={train_forward}",
                            f"routing.halting.penalty={lam}", f"routing.halting.target_skip={s}")
    spread_gates(model)
    layer = model.layers[1]
    x = torch.randn(2, 12, cfg.model.d_model, requires_grad=True)
    p = layer.halt(x)
    f = (p >= 0.5).float().mean()
    assert 0 < f < 1
    _, ctx = run_layer(layer, model.rope, x, "topk")
    penalty = ctx.aux_losses["l/depth_penalty"]
    torch.testing.assert_close(penalty, lam * (f - (1 - s)) ** 2)
    grad, grad_x = torch.autograd.grad(penalty, [layer.halt.bias, x], allow_unused=True)
    (dmean,) = torch.autograd.grad(p.mean(), layer.halt.bias)
    torch.testing.assert_close(grad, 2 * lam * (f - (1 - s)) * dmean)
    # the hard training forward's gate reads a stop-gradient copy of x; the soft one's gradient is exact
    assert (grad_x is None) == (train_forward == "hard")


@pytest.mark.parametrize("init_bias, push", [(3.0, "down"), (-3.0, "up")])
def test_target_skip_pushes_toward_the_target_from_both_sides(make_model, init_bias, push):
    model, cfg = make_model(*HALT, "routing.halting.penalty=1.0", "routing.halting.target_skip=0.2",
                            f"routing.halting.init_bias={init_bias}")  # executes all (3) or none (-3)
    out = model(tokens_for(cfg, 2, 16), tokens_for(cfg, 2, 16))
    grads = torch.autograd.grad(sum(out.aux_losses.values()), [layer.halt.bias for layer in halting_layers(model)])
    assert all((g > 0) if push == "down" else (g < 0) for g in grads)


def test_new_keys_validated_and_old_configs_keep_their_meaning(make_config):
    from megaroute.config import ConfigError

    cfg = make_config(*HALT)
    assert cfg.routing.halting.train_forward == "soft" and cfg.routing.halting.target_skip is None
    with pytest.raises(ConfigError, match="routing.halting.target_skip"):
        make_config(*HALT, "routing.halting.penalty=1.0", "routing.halting.target_skip=1.0")
    with pytest.raises(ConfigError, match="routing.halting.penalty"):
        make_config(*HALT, "routing.halting.target_skip=0.2")  # penalty 0: the target would do nothing
    with pytest.raises(ConfigError, match="routing.halting.train_forward"):
        make_config(*HALT, "routing.halting.train_forward=straight")
