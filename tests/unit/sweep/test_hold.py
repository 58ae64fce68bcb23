"""`hold:` in a sweep spec: training FLOPs (the default) or active parameters held equal across variants."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megaroute.config import load_config
from megaroute.flops import flops_per_token
from megaroute.sweep.mlflow_runs import sweep_runs
from megaroute.sweep.plan import format_table, plan
from megaroute.sweep.spec import SweepSpecError, load_spec

from .fake_mlflow import point_run, store

REPO = Path(__file__).resolve().parents[3]
EXPERIMENTS = REPO / "configs/experiments"
STEPS = 100


def _dense_step_flops() -> float:
    cfg = load_config(str(EXPERIMENTS / "char_dense.yaml"))
    return flops_per_token(cfg.model, cfg.routing, cfg.data.seq_len, training=True) * cfg.train.global_batch_size \
        * cfg.data.seq_len


def _spec(tmp_path, **changes) -> str:
    raw = {"name": "hold", "budgets": [STEPS * _dense_step_flops()], "sizes": {"char": []},
           "variants": {v: {"config": str(EXPERIMENTS / f"char_{v}.yaml")} for v in ("dense", "mod", "moe")},
           "overrides": ["optim.warmup_steps=1"], "gpu": "cpu", "hold": "active_params", **changes}
    raw = {k: v for k, v in raw.items() if v is not None}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("change, key", [
    ({"hold": "tokens"}, "hold"),
    ({"hold": "active_params", "active_tolerance": 0.7}, "active_tolerance"),
    ({"hold": None, "active_tolerance": 0.05}, "active_tolerance"),   # only with hold: active_params
    ({"variants": {"dense": {"config": str(EXPERIMENTS / "char_dense.yaml")}}}, "hold"),  # nothing to match
])
def test_hold_spec_errors_name_the_key(tmp_path, change, key):
    with pytest.raises(SweepSpecError, match=f"sweep key '{key}'"):
        load_spec(_spec(tmp_path, **change))


def test_default_hold_is_flops(tmp_path):
    spec = load_spec(_spec(tmp_path, hold=None))
    assert spec.hold == "flops"
    points = plan(spec)
    steps = {p.variant: p.steps for p in points}
    assert steps["dense"] == STEPS and steps["mod"] > 1.5 * STEPS   # MoD: cheaper tokens, more of them
    assert all(abs(p.budget_error) < 0.01 for p in points) and "hold" not in dict(points[0].tags)


def test_active_params_hold_matches_tokens_and_active_size(tmp_path):
    spec = load_spec(_spec(tmp_path))
    points = {p.variant: p for p in plan(spec)}
    dense, mod, moe = points["dense"], points["mod"], points["moe"]
    assert {p.steps for p in points.values()} == {STEPS} and {p.tokens for p in points.values()} == {dense.tokens}
    assert dense.active_params == dense.n_params and moe.n_params > 2 * moe.active_params
    for p in (mod, moe):
        assert abs(p.active_params / dense.active_params - 1) <= spec.active_tolerance
    assert abs(dense.budget_error) < 0.01 and mod.budget_error < -0.3   # MoD spends fewer FLOPs on the tokens
    tags = dict(moe.tags)
    assert tags["hold"] == "active_params" and tags["active_params"] == str(moe.active_params)
    table = format_table(list(points.values()))
    assert "active" in table.splitlines()[0] and "hold: active_params" in table


def test_active_params_hold_refuses_a_different_active_size(tmp_path):
    spec = load_spec(_spec(tmp_path, variants={
        "dense": {"config": str(EXPERIMENTS / "char_dense.yaml")},
        "moe_top2": {"config": str(EXPERIMENTS / "char_moe.yaml"), "overrides": ["routing.moe.top_k=2"]}}))
    with pytest.raises(SweepSpecError, match="sweep key 'active_tolerance'.*moe_top2.*active parameters"):
        plan(spec)


def test_active_params_hold_refuses_tokens_it_cannot_match(tmp_path):
    spec = load_spec(_spec(tmp_path, budgets=[10 * _dense_step_flops()], variants={
        "dense": {"config": str(EXPERIMENTS / "char_dense.yaml")},
        "moe": {"config": str(EXPERIMENTS / "char_moe.yaml"), "overrides": ["train.global_batch_size=48"]}}))
    with pytest.raises(SweepSpecError, match="sweep key 'hold'.*miss dense's 20480 tokens"):
        plan(spec)


def test_design_with_active_params_hold_shares_the_reference_grid(tmp_path):
    raw = yaml.safe_load((REPO / "configs/sweeps/tiny.yaml").read_text())
    raw["variants"] = {"dense": {"config": str(REPO / "configs/tiny.yaml")},
                       "mod": {"config": str(REPO / "configs/tiny_mod.yaml")}}
    raw["budgets"] = raw["budgets"][:1]
    raw["hold"] = "active_params"
    path = tmp_path / "design.yaml"
    path.write_text(yaml.safe_dump(raw))
    points = plan(load_spec(str(path)))
    by_variant = {v: [(p.size, p.steps, p.tokens) for p in points if p.variant == v] for v in ("dense", "mod")}
    assert by_variant["dense"] == by_variant["mod"] and len(by_variant["dense"]) == 5


def test_analysis_reads_active_parameters_of_a_hold_active_params_sweep(tmp_path):
    uri, client, exp = store(tmp_path)
    point_run(client, exp, "sw", None, "dense", "s", 1e12, 100, 0, 3.0,
              tags={"hold": "active_params", "active_params": "100"})
    point_run(client, exp, "sw", None, "moe", "s", 1e12, 300, 0, 2.9, routing="moe",
              tags={"hold": "active_params", "active_params": "101"})
    point_run(client, exp, "other", None, "moe", "s", 1e12, 300, 0, 2.9, routing="moe")   # hold: flops
    _, runs = sweep_runs(uri, "exp", "sw")
    assert sorted((r.variant, r.n_params, r.hold) for r in runs) == [("dense", 100, "active_params"),
                                                                    ("moe", 101, "active_params")]
    _, (flops_run,) = sweep_runs(uri, "exp", "other")
    assert (flops_run.n_params, flops_run.hold) == (300, "flops")


def test_shipped_active_params_spec_loads():
    spec = load_spec(str(REPO / "configs/sweeps/tiny_active.yaml"))
    assert spec.hold == "active_params" and [v.name for v in spec.variants][0] == "dense"
    assert {v.name for v in spec.variants} == {"dense", "mod", "moe", "mode_staged", "mode_integrated"}
