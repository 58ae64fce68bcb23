"""Per-token early exit: consistency-trained confidence heads; exited tokens stop computing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaroute.model import ForwardOptions, lm_loss, transformer
from megaroute.model.rope import Positions
from megaroute.model.routing import EarlyExitLayer, RoutingContext, freeze_base

from .routing_checks import assert_causal, op_counts, record_updates, rows, tokens_for

EXIT = ("routing.method=early_exit", "routing.every=2", "routing.offset=1")  # heads after blocks 1 and 3
EVERY = ("routing.method=early_exit", "routing.every=1", "routing.offset=0")  # a head after every block


def heads(model) -> dict[int, EarlyExitLayer]:
    return {i: layer for i, layer in enumerate(model.layers) if layer.exit_head is not None}


def forward(model, tokens: torch.Tensor, mode: str = "topk") -> tuple[torch.Tensor, RoutingContext]:
    """Transformer.forward written out, with ctx.predict (h -> argmax token ids) that exit training needs."""
    B, T = tokens.shape
    ctx = RoutingContext(mode=mode)
    ctx.predict = lambda h: model.lm_head(model.norm(h)).argmax(-1)
    pos = Positions(model.rope, torch.arange(T).expand(B, T))
    x = model.embed(tokens)
    for i, layer in enumerate(model.layers):
        x = layer(x, pos, ctx, f"layer_{i}")
    logits = model.lm_head(model.norm(x))
    for fn in ctx.deferred:
        fn(logits.argmax(-1))
    return logits, ctx


def capture_outputs(model) -> dict[int, torch.Tensor]:
    captured = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, inp, out, i=i: captured.__setitem__(i, out.detach()))
    return captured


def fix_exits(monkeypatch, model, layer: int, exits: torch.Tensor) -> None:
    """Pins the head after `layer`: tokens where exits [B, T] is True are confident (logit 10)."""
    logits = torch.where(exits, 10.0, -10.0).unsqueeze(-1)
    monkeypatch.setattr(model.layers[layer].exit_head, "forward", lambda h: logits[: h.shape[0]])


@torch.no_grad()
def spread_exits(model, attn: float = 5.0) -> None:
    """Content-dependent confidences on both sides of 0.5."""
    for layer in heads(model).values():
        layer.exit_head.weight.normal_(std=20.0)
    for layer in model.layers:
        layer.block.attn.qkv.weight.mul_(attn)


# ----------------------------------------------------------------------------- structure


def test_every_block_can_skip_and_routed_blocks_own_heads(make_model):
    model, cfg = make_model(*EXIT)
    assert all(isinstance(layer, EarlyExitLayer) for layer in model.layers)
    assert sorted(heads(model)) == [1, 3]
    trainable = freeze_base(model)
    assert sorted(trainable) == [f"layers.{i}.exit_head.{p}" for i in (1, 3) for p in ("bias", "weight")]


@pytest.mark.parametrize("mode", ["topk", "causal", "hard"])
def test_threshold_one_equals_dense(make_model, mode):
    dense, cfg = make_model(seed=7)
    model, _ = make_model(*EXIT, "routing.early_exit.threshold=1.0", seed=11)
    result = model.load_state_dict(dense.state_dict(), strict=False)
    assert result.unexpected_keys == [] and all("exit_head" in k for k in result.missing_keys)
    with torch.no_grad():
        for layer in heads(model).values():
            layer.exit_head.bias.fill_(100.0)  # sigmoid is exactly 1.0 in float32, still not > 1.0
    tokens = tokens_for(cfg, 3, 13)
    logits, ctx = forward(model, tokens, mode)
    torch.testing.assert_close(logits, dense(tokens).logits, rtol=0, atol=1e-6)
    assert all(ctx.stats[f"layer_{i}/exit_frac"].item() == 0.0 for i in (1, 3))


# ----------------------------------------------------------------------------- inference: exits


@pytest.mark.parametrize("mode", ["causal", "hard"])
def test_exited_tokens_are_frozen_and_skip_later_blocks(make_model, monkeypatch, mode):
    model, cfg = make_model(*EVERY, "routing.early_exit.threshold=0.5")
    spread_exits(model)
    T = 12
    exit0 = torch.zeros(1, T, dtype=torch.bool)
    exit0[0, [2, 5]] = True
    exit1 = torch.zeros(1, T, dtype=torch.bool)
    exit1[0, [5, 7]] = True  # 5 already left after block 0: it cannot exit twice
    fix_exits(monkeypatch, model, 0, exit0)
    fix_exits(monkeypatch, model, 1, exit1)
    for i in (2, 3):
        fix_exits(monkeypatch, model, i, torch.zeros(1, T, dtype=torch.bool))
    calls = record_updates(monkeypatch, model)
    outputs = capture_outputs(model)
    tokens = tokens_for(cfg, 1, T)
    out = model(tokens, options=ForwardOptions(mode=mode))

    active = torch.ones(T, dtype=torch.bool)
    active[[2, 5, 7]] = False
    sel = active.nonzero().squeeze(-1)
    assert [rows(calls, i) for i in range(4)] == [T, T - 2, T - 3, T - 3]
    assert calls[2][0][0].tolist() == calls[3][0][0].tolist() == sel.tolist()  # original positions
    assert out.routing_stats["layer_0/exit_frac"].item() == pytest.approx(2 / T)
    assert out.routing_stats["layer_1/exit_frac"].item() == pytest.approx(1 / T)
    assert out.routing_stats["tlops_frac"].item() == pytest.approx((4 * T - 2 - 3 - 3) / (4 * T))
    # frozen: the hidden state a token had when it exited is its final hidden state
    assert torch.equal(outputs[3][0, [2, 5]], outputs[0][0, [2, 5]])
    assert torch.equal(outputs[3][0, 7], outputs[1][0, 7])
    # brute force for the rest: blocks 2 and 3 on the active tokens alone, at their original positions
    h = outputs[1][:, sel]
    for i in (2, 3):
        h = model.layers[i].block(h, Positions(model.rope, sel.unsqueeze(0)))
    torch.testing.assert_close(outputs[3][:, sel], h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits, model.lm_head(model.norm(outputs[3])))


def test_ragged_exits_batch_equals_per_sample(make_model, monkeypatch):
    model, cfg = make_model(*EXIT)
    spread_exits(model)
    B, T = 3, 10
    exits = torch.zeros(B, T, dtype=torch.bool)
    exits[1, [0, 3, 4, 8]] = True
    exits[2] = True  # sequence 0: nobody exits; 1: some; 2: everyone
    fix_exits(monkeypatch, model, 1, exits)
    tokens = tokens_for(cfg, B, T)
    batched = model(tokens, options=ForwardOptions(mode="causal"))
    assert batched.routing_stats["layer_1/exit_frac"].item() == pytest.approx(14 / 30)
    for b in range(B):
        fix_exits(monkeypatch, model, 1, exits[b: b + 1])
        single = model(tokens[b: b + 1], options=ForwardOptions(mode="causal")).logits
        torch.testing.assert_close(batched.logits[b: b + 1], single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["causal", "hard"])
def test_evaluation_modes_are_causal(make_model, mode):
    model, cfg = make_model(*EVERY, "routing.early_exit.threshold=0.5")
    spread_exits(model)
    tokens = tokens_for(cfg, 2, 16)
    stats = model(tokens, options=ForwardOptions(mode=mode)).routing_stats
    assert 0 < stats["layer_0/exit_frac"].item() < 1 and stats["tlops_frac"].item() < 1
    assert_causal(lambda t: model(t, options=ForwardOptions(mode=mode)).logits, tokens, cfg.model.vocab_size)


def test_no_per_sample_python_loop(make_model):
    model, cfg = make_model(*EXIT)
    counts = op_counts(lambda B: model(tokens_for(cfg, B, 12), options=ForwardOptions(mode="causal")))
    assert counts[0] == counts[1]


# ----------------------------------------------------------------------------- training: consistency heads


def test_training_runs_every_block_and_trains_heads_toward_consistency(make_model, monkeypatch):
    model, cfg = make_model(*EXIT, "routing.early_exit.loss_weight=0.5")
    spread_exits(model)
    calls = record_updates(monkeypatch, model)
    outputs = capture_outputs(model)
    B, T = 2, 16
    logits, ctx = forward(model, tokens_for(cfg, B, T))
    assert all(rows(calls, i) == B * T for i in range(4))
    assert all(frac.item() == 1.0 for frac in ctx.exec_frac.values())
    assert set(ctx.aux_losses) == {"layer_1/exit_bce", "layer_3/exit_bce"}
    final = logits.argmax(-1)
    for i, layer in heads(model).items():
        label = (model.lm_head(model.norm(outputs[i])).argmax(-1) == final).float()
        expected = 0.5 * F.binary_cross_entropy_with_logits(layer.exit_head(outputs[i]).squeeze(-1), label)
        torch.testing.assert_close(ctx.aux_losses[f"layer_{i}/exit_bce"], expected)
        assert ctx.stats[f"layer_{i}/exit_label_frac"].item() == pytest.approx(label.mean().item())
    assert 0 < ctx.stats["layer_1/exit_label_frac"].item() < 1
    assert ctx.stats["layer_3/exit_label_frac"].item() == 1.0  # the last layer's readout is the final prediction

    # the BCE trains the heads only (they read a stop-gradient copy); the LM loss never reaches the heads
    named = dict(model.named_parameters())
    grads = dict(zip(named, torch.autograd.grad(sum(ctx.aux_losses.values()), list(named.values()),
                                                retain_graph=True, allow_unused=True)))
    for name, grad in grads.items():
        if "exit_head" in name:
            assert grad is not None and grad.abs().max() > 0, name
        else:
            assert grad is None or not grad.any(), name
    lm = F.cross_entropy(logits.flatten(0, 1), tokens_for(cfg, B, T).flatten())
    head_params = [p for n, p in named.items() if "exit_head" in n]
    assert all(g is None for g in torch.autograd.grad(lm, head_params, allow_unused=True))


@pytest.mark.parametrize("fused", [True, False], ids=["head-in-loss", "materialized-logits"])
def test_model_forward_labels_against_its_final_prediction_once(make_model, monkeypatch, fused):
    """The model's own training forward gives the written-out consistency losses (labels against
    torch.argmax of the final logits). The final prediction is taken once for every head: by the
    fused loss, which runs the head inside it and reports each row's argmax, or (the caller reads the
    logits) once from them; the only other argmaxes are the heads' own readouts, each a chunk of
    rows at a time (lm_loss.linear_argmax), with no [N, V] logits of their own."""
    model, cfg = make_model(*EVERY, "routing.early_exit.loss_weight=0.5")
    spread_exits(model)
    tokens = tokens_for(cfg, 2, 16)
    _, ref = forward(model, tokens)
    calls = []

    def counted_argmax(logits, group=None):
        calls.append(logits.shape)
        return logits.argmax(-1)

    for module in (transformer, lm_loss):  # the final prediction's, and the heads' readouts' (lm_loss.linear_argmax)
        monkeypatch.setattr(module, "parallel_argmax", counted_argmax)
    monkeypatch.setattr(lm_loss, "CE_CHUNK_ELEMENTS", 8 * cfg.model.vocab_size)  # chunks of 8 of the 32 rows
    monkeypatch.setattr(lm_loss, "CE_CHUNK_MIN_ROWS", 1)
    out = model(tokens, tokens, options=ForwardOptions(return_logits=not fused))
    assert (type(out.lm_loss.grad_fn).__name__ == "_LinearCrossEntropyBackward") == fused
    V = cfg.model.vocab_size
    readouts = [shape for shape in calls if len(shape) == 2]
    assert readouts == [(8, V)] * 4 * len(heads(model))  # each head's readout: 4 chunks of 8 rows
    assert len(calls) - len(readouts) == (not fused)  # the final prediction from the logits, once
    assert set(out.aux_losses) == set(ref.aux_losses) == {f"layer_{i}/exit_bce" for i in heads(model)}
    for name, loss in ref.aux_losses.items():
        torch.testing.assert_close(out.aux_losses[name], loss, rtol=0, atol=0)


def test_loss_weight_zero_adds_no_loss_and_no_readout(make_model):
    model, cfg = make_model(*EXIT, "routing.early_exit.loss_weight=0")
    _, ctx = forward(model, tokens_for(cfg, 2, 8))
    assert ctx.aux_losses == {} and ctx.deferred == []


def test_model_trains_exit_heads(make_model):
    model, cfg = make_model(*EXIT)
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    assert set(out.aux_losses) == {"layer_1/exit_bce", "layer_3/exit_bce"}
    torch.testing.assert_close(out.loss, out.lm_loss + sum(out.aux_losses.values()))
    out.loss.backward()
    assert all(layer.exit_head.weight.grad.abs().max() > 0 for layer in heads(model).values())
