"""Cheap/full conditional depth: budgets, single-path inference, gradients, oracle labels, causality."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from megaroute.model import ForwardOptions
from megaroute.model.routing import DepthGateLayer, freeze_base, is_controller_param
from megaroute.model.routing.depth_gate import pairwise_rank_loss

GATED = ("routing.method=depth_gate", "routing.every=1", "routing.offset=0")  # all 4 blocks gated
G1 = (*GATED, "routing.depth_gate.gate=mlp")
G3 = (*GATED, "routing.depth_gate.gate=jepa")
ORACLE = ("routing.depth_gate.utility_weight=1.0", "routing.depth_gate.rank_weight=1.0")


def tokens_for(cfg, B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)


def gated_layers(model) -> list[DepthGateLayer]:
    return [layer for layer in model.layers if isinstance(layer, DepthGateLayer)]


def count_rows(model) -> dict[str, list[int]]:
    """Token rows (over the whole batch) each FFN path processes, per call."""
    rows = collections.defaultdict(list)
    for i, layer in enumerate(gated_layers(model)):
        for path, module in (("full", layer.block.mlp), ("cheap", layer.cheap)):
            module.register_forward_hook(
                lambda m, inp, out, key=f"{i}/{path}": rows[key].append(inp[0].shape[:-1].numel()))
    return rows


def per_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


@pytest.mark.parametrize("gate", [G1, G3])
@pytest.mark.parametrize("cheap", ["low_rank", "narrow"])
def test_training_math_equals_single_path_inference_for_the_same_decisions(make_model, gate, cheap):
    model, cfg = make_model(*gate, f"routing.depth_gate.cheap={cheap}")
    tokens = tokens_for(cfg, 3, 21)
    train_out = model(tokens, tokens)  # both paths, straight-through weights exactly 0/1
    model.eval()
    with torch.no_grad():
        eval_out = model(tokens, tokens)  # dispatch: one path per token
    torch.testing.assert_close(eval_out.logits, train_out.logits.detach(), atol=2e-5, rtol=1e-5)
    for name, value in train_out.routing_stats.items():
        if name.endswith("full_frac"):
            assert eval_out.routing_stats[name] == value


@pytest.mark.parametrize("T, budget", [(21, 0.5), (16, 0.25), (7, 0.01), (9, 1.0)])
def test_budget_is_exact_per_sequence_and_inference_runs_one_path(make_model, T, budget):
    model, cfg = make_model(*G1, f"routing.depth_gate.budget={budget}")
    k = max(1, round(budget * T))
    rows = count_rows(model)
    model.eval()
    with torch.no_grad():
        out = model(tokens_for(cfg, 2, T))
    for i in range(len(gated_layers(model))):
        # Every token once, on one path (the two path buffers are flat over the batch of 2; an empty
        # path still calls its FFN on no rows, which keeps ZeRO-3's gathers in step across ranks).
        assert rows[f"{i}/full"] == [2 * k] and rows[f"{i}/cheap"] == [2 * (T - k)]
        assert out.routing_stats[f"layer_{i}/full_frac"].item() == pytest.approx(k / T)


def test_training_computes_both_paths_for_every_token(make_model):
    model, cfg = make_model(*G1)
    rows = count_rows(model)
    model(tokens_for(cfg, 2, 12))
    assert rows["0/full"] == [24] and rows["0/cheap"] == [24]


def test_each_full_set_is_the_top_scores_of_its_sequence(make_model):
    model, cfg = make_model(*G1)
    layer = gated_layers(model)[2]
    seen = {}
    layer.scorer.register_forward_hook(lambda m, inp, out: seen.__setitem__("scores", out[0].detach()))
    layer.block.mlp_norm.register_forward_hook(lambda m, inp, out: seen.__setitem__("u", out))
    layer.block.mlp.register_forward_hook(lambda m, inp, out: seen.__setitem__("full_in", inp[0]))
    model.eval()
    with torch.no_grad():
        model(tokens_for(cfg, 3, 10))
    expected = seen["scores"].topk(5, dim=1).indices.sort(dim=1).values
    # The full FFN received exactly those tokens' normalized hidden states, sequence by sequence
    # in causal order (one flat buffer over the batch).
    gathered = seen["u"].gather(1, expected.unsqueeze(-1).expand(-1, -1, 32))
    torch.testing.assert_close(seen["full_in"], gathered.reshape(-1, 32))


@pytest.mark.parametrize("gate", [G1, G3])
def test_gradients_reach_scorer_and_cheap_path_from_the_lm_loss_alone(make_model, gate):
    model, cfg = make_model(*gate)
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    out.lm_loss.backward()  # no auxiliary loss: the straight-through weight alone trains the gate
    for layer in gated_layers(model):
        for name, p in layer.scorer.named_parameters():
            if name == "forecast.1.bias":  # cancels in z_full - z_cheap; only the alignment trains it
                continue
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert all(p.grad.abs().sum() > 0 for p in layer.cheap.parameters())
        assert all(p.grad.abs().sum() > 0 for p in layer.block.mlp.parameters())


def test_jepa_alignment_trains_the_predictor_against_a_frozen_target_head(make_model):
    model, cfg = make_model(*G3, "routing.depth_gate.align_weight=1.0")
    layer = gated_layers(model)[0]
    assert "target_head" in dict(layer.scorer.named_buffers())
    assert not any("target_head" in n for n, _ in model.named_parameters())
    tokens = tokens_for(cfg, 2, 16)
    out = model(tokens, tokens)
    assert set(k for k in out.aux_losses) == {f"layer_{i}/jepa_align" for i in range(4)}
    before = layer.scorer.target_head.clone()
    out.aux_losses["layer_0/jepa_align"].backward()
    s = layer.scorer
    for p in (s.context.weight, s.action.weight, s.forecast[1].weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert s.readout.weight.grad is None  # alignment is on the forecasts, not the score
    assert torch.equal(layer.scorer.target_head, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_jepa_gate_trains_with_16_bit_parameters_and_float32_buffers(make_model, dtype):
    """DeepSpeed's bf16/fp16 engines cast parameters only: the frozen target head stays float32."""
    model, cfg = make_model(*G3, *ORACLE)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    assert gated_layers(model)[0].scorer.target_head.dtype == torch.float32
    x = tokens_for(cfg, 2, 16)
    out = model(x, x)
    assert torch.isfinite(out.loss) and "layer_0/jepa_align" in out.aux_losses
    out.loss.backward()


@pytest.mark.parametrize("kind", ["mse", "cosine", "smooth_l1"])
def test_alignment_loss_kinds(make_model, kind):
    model, cfg = make_model(*G3, f"routing.depth_gate.align_loss={kind}")
    tokens = tokens_for(cfg, 2, 8)
    out = model(tokens, tokens)
    value = out.aux_losses["layer_1/jepa_align"]
    assert torch.isfinite(value) and value >= 0


def test_controller_only_training_leaves_the_base_without_gradients(make_model):
    model, cfg = make_model(*G3, *ORACLE)
    trainable = freeze_base(model)
    assert trainable and all(is_controller_param(n) for n in trainable)
    assert any(".scorer." in n for n in trainable) and any(".cheap." in n for n in trainable)
    tokens = tokens_for(cfg, 2, 16)
    model(tokens, tokens).loss.backward()
    for name, p in model.named_parameters():
        if is_controller_param(name):
            continue
        assert p.grad is None, name
    assert gated_layers(model)[0].scorer.readout.weight.grad.abs().sum() > 0


def _recorded_labels(model, monkeypatch) -> dict[int, torch.Tensor]:
    labels = {}
    for i, layer in enumerate(gated_layers(model)):
        original = layer.oracle_labels

        def record(*args, i=i, original=original):
            labels[i] = original(*args)
            return labels[i]

        monkeypatch.setattr(layer, "oracle_labels", record)
    return labels


def test_off_policy_label_equals_brute_force_recomputation(make_model, monkeypatch):
    model, cfg = make_model(*G1, *ORACLE, "routing.depth_gate.oracle=off_policy")
    labels = _recorded_labels(model, monkeypatch)
    tokens, targets = tokens_for(cfg, 2, 12), tokens_for(cfg, 2, 12, seed=1)
    model(tokens, targets)
    model.eval()
    n = len(model.layers)
    with torch.no_grad():
        for layer in range(n):
            # Earlier blocks decide as in training; this block all full / all cheap; later all full.
            later = {f"layer_{j}": "full" for j in range(layer + 1, n)}
            full, cheap = (per_token_loss(model(tokens, options=ForwardOptions(force={f"layer_{layer}": path, **later}))
                                          .logits, targets) for path in ("full", "cheap"))
            torch.testing.assert_close(labels[layer], cheap - full, atol=2e-5, rtol=1e-4)


def test_on_policy_label_follows_later_gates_and_differs_from_off_policy(make_model, monkeypatch):
    labels = {}
    for policy in ("off_policy", "on_policy"):
        model, cfg = make_model(*G1, *ORACLE, f"routing.depth_gate.oracle={policy}", "routing.depth_gate.budget=0.5")
        labels[policy] = _recorded_labels(model, monkeypatch)
        tokens = tokens_for(cfg, 2, 12)
        model(tokens, tokens)
    # The last gated block has no later gates: both labels agree there.
    torch.testing.assert_close(labels["on_policy"][3], labels["off_policy"][3])
    # Earlier blocks: later gates send half the tokens cheap on-policy, so the labels differ.
    assert not torch.allclose(labels["on_policy"][0], labels["off_policy"][0], atol=1e-4)

    # And the on-policy label is the brute-force loss with later gates deciding for themselves.
    model.eval()
    with torch.no_grad():
        full = per_token_loss(model(tokens, options=ForwardOptions(force={"layer_2": "full"})).logits, tokens)
        cheap = per_token_loss(model(tokens, options=ForwardOptions(force={"layer_2": "cheap"})).logits, tokens)
    torch.testing.assert_close(labels["on_policy"][2], cheap - full, atol=2e-5, rtol=1e-4)


def test_utility_and_rank_losses_train_the_score(make_model):
    model, cfg = make_model(*G1, "routing.depth_gate.utility_weight=0.5", "routing.depth_gate.rank_weight=0.0")
    tokens = tokens_for(cfg, 2, 12)
    out = model(tokens, tokens)
    assert {k.split("/")[1] for k in out.aux_losses} == {"utility"}
    model.zero_grad()
    out.aux_losses["layer_0/utility"].backward()
    assert gated_layers(model)[0].scorer.net[0].weight.grad.abs().sum() > 0
    assert gated_layers(model)[0].block.mlp.gate_up.weight.grad is None  # labels carry no gradient


def test_pairwise_rank_loss_prefers_the_label_order():
    torch.manual_seed(0)
    labels = torch.randn(4, 30)
    good = pairwise_rank_loss(labels * 5, labels, pairs=200)
    bad = pairwise_rank_loss(-labels * 5, labels, pairs=200)
    assert good < 0.1 < 2.0 < bad
    assert pairwise_rank_loss(torch.zeros(1, 5, requires_grad=True), torch.ones(1, 5), pairs=10) == 0


@pytest.mark.parametrize("gate", [G1, G3])
def test_causal_mode_is_causal_and_uses_the_learned_threshold(make_model, gate):
    model, cfg = make_model(*gate)
    tokens = tokens_for(cfg, 2, 20)
    model(tokens, tokens)  # one training forward sets the running top-k cut
    layer = gated_layers(model)[1]
    assert layer.cut.updates.item() == 1 and layer.cut.threshold.item() != 0
    model.eval()
    t = 11
    other = tokens.clone()
    other[:, t + 1:] = tokens_for(cfg, 2, 20, seed=7)[:, t + 1:]
    with torch.no_grad():
        a = model(tokens, options=ForwardOptions(mode="causal"))
        b = model(other, options=ForwardOptions(mode="causal"))
        topk = model(other, options=ForwardOptions(mode="topk"))
    torch.testing.assert_close(a.logits[:, : t + 1], b.logits[:, : t + 1], atol=1e-5, rtol=0)
    assert not torch.allclose(a.logits[:, t + 1:], b.logits[:, t + 1:])
    # Top-k is sequence-wide (not causal); causal decisions are per token against the threshold.
    assert topk.routing_stats["layer_1/full_frac"].item() == pytest.approx(10 / 20)


def test_no_oracle_work_without_targets_or_weights(make_model, monkeypatch):
    model, cfg = make_model(*G1, *ORACLE)
    calls = []
    monkeypatch.setattr(type(model), "_suffix_loss", lambda self, *a: calls.append(a))
    model(tokens_for(cfg, 2, 8))  # no targets: no labels
    assert calls == []
    plain, _ = make_model(*G1)
    monkeypatch.setattr(type(plain), "_suffix_loss", lambda self, *a: calls.append(a))
    plain(tokens_for(cfg, 2, 8), tokens_for(cfg, 2, 8))
    assert calls == []


def test_oracle_layers_labels_a_random_subset_per_step(make_model):
    model, cfg = make_model(*G1, *ORACLE, "routing.depth_gate.oracle_layers=1")
    assert all(layer.label_prob == 0.25 for layer in gated_layers(model))
    tokens = tokens_for(cfg, 1, 8)
    counts = [sum(k.endswith("/utility") for k in model(tokens, tokens).aux_losses) for _ in range(40)]
    assert 0.5 < sum(counts) / len(counts) < 1.6 and max(counts) <= 4


@pytest.mark.parametrize("gate", [G1, G3])
def test_activation_checkpointing_recomputes_the_paths_not_the_router(make_config, gate):
    from megaroute.model import build_model

    cfg = make_config(*gate, *ORACLE)
    tokens, targets = tokens_for(cfg, 2, 16, seed=1), tokens_for(cfg, 2, 16, seed=2)
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg.model, cfg.routing, activation_checkpointing=ckpt)
        torch.manual_seed(7)
        out = model(tokens, targets)
        out.loss.backward()
        runs.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                     [int(layer.cut.updates) for layer in gated_layers(model)]))
    (loss0, grads0, updates0), (loss1, grads1, updates1) = runs
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], atol=1e-6, rtol=1e-5)
    assert updates0 == updates1 == [1] * len(updates0)  # the router ran once per block, not again in backward
