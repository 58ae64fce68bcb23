"""The audit's expert section (audit/experts.py): statistics against hand computation, and the
recorded per-token routing against the MoE layers' own stats and a per-token reference of the
capacity queue."""

from __future__ import annotations

import math

import pytest
import torch

from megaroute.audit import analysis, experts
from megaroute.audit.report import _markdown, audit_model, auditable_methods, write_report
from megaroute.model import ForwardOptions

MOE = ("routing.method=moe", "routing.moe.num_experts=4")
METHODS = {
    "moe_token_choice": MOE + ("routing.moe.capacity_factor=0.75",),  # C = 6 of 32 per expert: drops
    "moe_expert_choice": MOE + ("routing.moe.router=expert_choice",),
    "mode_staged": ("routing.method=mode_staged", "routing.moe.num_experts=4", "routing.capacity=0.5",
                    "routing.moe.capacity_factor=0.75"),
    "mode_integrated": ("routing.method=mode_integrated", "routing.moe.num_experts=4", "routing.capacity=0.5",
                        "routing.moe.router=expert_choice"),
}


def _batches(n=2, B=2, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 97, (B, T), generator=g),) * 2 for _ in range(n)]


def test_expert_load_by_hand():
    assign = torch.zeros(4, 4, dtype=torch.bool)
    assign[0, 0] = assign[1, 0] = assign[2, 0] = assign[3, 1] = True  # loads [3, 1, 0, 0]
    r = analysis.expert_load(assign)
    assert r["assignments"] == [3, 1, 0, 0] and r["total"] == 4
    assert r["fraction"] == [0.75, 0.25, 0.0, 0.0]
    assert r["max_over_mean"] == pytest.approx(3.0)  # mean load 1
    assert r["cv"] == pytest.approx(math.sqrt((4 + 0 + 1 + 1) / 4))  # population std of [3, 1, 0, 0], mean 1
    assert r["entropy_norm"] == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4))
    balanced = analysis.expert_load(torch.eye(4, dtype=torch.bool))
    assert (balanced["max_over_mean"], balanced["cv"], balanced["entropy_norm"]) == (1.0, 0.0, pytest.approx(1.0))
    assert math.isnan(analysis.expert_load(torch.zeros(3, 4, dtype=torch.bool))["cv"])


def test_expert_drops_by_hand():
    chosen = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 1, 1], [0, 0, 1]], dtype=torch.bool)  # token 2: top-2
    kept = torch.tensor([[1, 0, 0], [0, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    routed = torch.tensor([True, True, True, True])
    r = analysis.expert_drops(chosen, kept, routed)
    assert (r["assignments"], r["assignments_dropped"], r["assignments_dropped_frac"]) == (5, 2, 0.4)
    assert (r["tokens"], r["tokens_without_expert"], r["tokens_without_expert_frac"]) == (4, 1, 0.25)
    assert r["experts_per_token"] == 0.75


def test_decision_expert_association_by_hand():
    # 2 x 2: Cramer's V is |phi| = |ad - bc| / sqrt((a+b)(c+d)(a+c)(b+d)).
    run = torch.tensor([True] * 15 + [False] * 15)
    expert = torch.tensor([0] * 10 + [1] * 5 + [0] * 3 + [1] * 12)
    r = analysis.decision_expert_association(run, expert, 2)
    assert r["table"] == {"run": [10, 5], "skip": [3, 12]} and r["tokens"] == 30
    assert r["cramers_v"] == pytest.approx(abs(10 * 12 - 5 * 3) / math.sqrt(15 * 15 * 13 * 17))
    assert r["p_run_given_expert"] == pytest.approx([10 / 13, 5 / 17])
    assert r["p_expert_given_run"] == pytest.approx([10 / 15, 5 / 15])
    assert r["p_expert_given_skip"] == pytest.approx([3 / 15, 12 / 15])
    # 2 x 3 with an empty expert column (left out of V): chi2 by hand on [[4, 0], [0, 4]] -> V = 1.
    r = analysis.decision_expert_association(torch.tensor([True] * 4 + [False] * 4), torch.tensor([0] * 4 + [2] * 4), 3)
    assert r["table"] == {"run": [4, 0, 0], "skip": [0, 0, 4]} and r["cramers_v"] == pytest.approx(1.0)
    assert math.isnan(r["p_run_given_expert"][1])
    # Independent: the same expert shares in both rows -> 0.
    r = analysis.decision_expert_association(torch.tensor([True, True, False, False]), torch.tensor([0, 1, 0, 1]), 2)
    assert r["cramers_v"] == pytest.approx(0.0, abs=1e-12)
    r = analysis.decision_expert_association(torch.ones(4, dtype=torch.bool), torch.tensor([0, 1, 0, 1]), 2)
    assert math.isnan(r["cramers_v"]) and "every token ran" in r["note"]


def test_skip_shares_by_position_and_token():
    flag = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]], dtype=torch.bool)
    tokens = torch.tensor([[5, 7, 5, 9], [5, 7, 7, 7]])
    assert analysis.share_by_position(flag, 2) == [{"positions": "0-1", "share": 0.75},
                                                   {"positions": "2-3", "share": 0.25}]
    assert analysis.share_by_token(flag, tokens, 2) == [{"token": 7, "count": 4, "share": 0.5},
                                                        {"token": 5, "count": 3, "share": 2 / 3}]


def test_moe_and_mode_methods_are_auditable():
    assert {"moe", "mode_staged", "mode_integrated"} <= set(auditable_methods())
    assert "none" not in auditable_methods()


@pytest.mark.parametrize("mode", ["topk", "causal"])
@pytest.mark.parametrize("variant", list(METHODS))
def test_recorded_assignments_equal_the_layers_own_stats(make_model, variant, mode):
    model = make_model(*METHODS[variant])[0].eval()
    x = _batches(1)[0][0]
    with torch.no_grad(), experts.ExpertRecorder(model) as rec:
        rec.tag = mode
        out = model(x, options=ForwardOptions(mode=mode, record_decisions=True))
    assert set(rec.records[mode]) == {"layer_1", "layer_3"}
    for name, (r,) in rec.records[mode].items():
        stats = out.routing_stats
        load = analysis.expert_load(r["sel"][r["routed"]])
        for e, frac in enumerate(load["fraction"]):
            assert frac == pytest.approx(float(stats[f"{name}/expert_{e}_load"]), abs=1e-6), (name, e)
        if f"{name}/moe_dropped" in stats:  # token choice
            d = analysis.expert_drops(r["chosen"][r["routed"]], r["sel"][r["routed"]], r["routed"][r["routed"]])
            assert d["assignments_dropped"] == int(stats[f"{name}/moe_dropped"])
            assert (d["assignments_dropped"] > 0) == (mode == "topk")  # causal mode never drops
        if "run" in r:  # MoDE: the decision recorded is the layer's, and its experts run only run tokens
            assert torch.equal(r["run"], out.decisions[name])
            assert not (r["sel"].any(-1) & ~r["run"]).any()
            if variant == "mode_staged":
                assert torch.equal(r["routed"], r["run"])


def test_token_choice_drops_follow_the_position_queue(make_model):
    """Per-token reference of the capacity rule: each sequence's tokens, in position order, take their
    top-1 expert until it holds C = ceil(0.75 * 32 / 4) = 6; later ones are dropped."""
    model = make_model(*METHODS["moe_token_choice"])[0].eval()
    x = _batches(1)[0][0]
    with torch.no_grad(), experts.ExpertRecorder(model) as rec:
        rec.tag = "topk"
        model(x, options=ForwardOptions(mode="topk", record_decisions=True))
    (r,) = rec.records["topk"]["layer_1"]
    top1 = r["probs"].argmax(-1)
    kept = torch.zeros_like(r["sel"])
    for b in range(x.shape[0]):
        fill = [0] * 4
        for t in range(x.shape[1]):
            e = int(top1[b, t])
            if fill[e] < 6:
                fill[e] += 1
                kept[b, t, e] = True
    assert torch.equal(r["sel"], kept)
    assert torch.equal(r["chosen"], torch.nn.functional.one_hot(top1, 4).bool())


@pytest.mark.parametrize("variant", ["moe_token_choice", "mode_staged", "mode_integrated"])
def test_audit_reports_experts(make_model, tmp_path, variant):
    model, cfg = make_model(*METHODS[variant])
    model.eval()
    dense = make_model(seed=1)[0].eval() if variant == "moe_token_choice" else None
    r = audit_model(model, cfg, _batches(1), reference=dense, bins=2, buckets=2)
    e = r["experts"]
    assert e["modes"] == ["topk", "causal"] and set(e["layers"]) == {"layer_1", "layer_3"}
    for layer in e["layers"].values():
        assert layer["kind"] == cfg.routing.method and layer["num_experts"] == 4
        for mode, row in layer["modes"].items():
            assert sum(row["load"]["fraction"]) == pytest.approx(1.0)
            if variant == "moe_token_choice":  # every token routed, top-1
                assert row["drops"]["assignments"] == 2 * 32
                assert (row["drops"]["assignments_dropped"] > 0) == (mode == "topk")
            if variant == "mode_staged":
                m = row["mod"]
                assert m["association"]["tokens"] == 2 * 32  # every token has a counterfactual preference
                assert sum(m["association"]["table"]["run"]) == round(m["run_frac"] * 64)
                assert row["drops"]["tokens"] == sum(m["association"]["table"]["run"])  # MoE sees run tokens only
                assert 0 <= m["top1_agreement"] <= 1
            if variant == "mode_integrated":
                m = row["mod"]
                assert sum(m["association"]["table"]["run"]) == round(m["run_frac"] * 64)
                assert row["drops"]["tokens_without_expert"] == sum(m["association"]["table"]["skip"])
        if variant == "mode_staged":
            assert layer["modes"]["topk"]["mod"]["run_frac"] == 0.5  # top-k: exactly the capacity
    if variant == "moe_token_choice":
        assert set(r["losses"]) == {"learned", "causal", "dense"} and "correlation" not in r
    assert not any(m._forward_hooks for m in model.modules())  # the recorder's hooks are gone

    def decode(ids):
        return "".join(chr(65 + i % 26) for i in ids)

    if variant == "moe_token_choice":  # the experts-only report (plots cost seconds: one variant writes them)
        paths = write_report(r, str(tmp_path / "audit"), decode=decode)
        assert {p.rsplit("/", 1)[1] for p in paths} == {"expert_load.png", "audit.json", "audit.md"}
        md = (tmp_path / "audit" / "audit.md").read_text()
    else:
        md = _markdown(r, decode)
    assert "## Experts: load balance and dropped tokens" in md
    assert ("## MoDE: run/skip decision vs expert choice" in md) == (variant != "moe_token_choice")
