"""The planner with rule-based designs: the shipped specs' grids, per-point schedule, LR and batch,
refusals with reasons (exit 2 before anything is submitted), the learning-rate sweep and `sweep plan`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from megaroute.cli import main
from megaroute.config import load_config
from megaroute.sweep.design import BatchRule, LrRule
from megaroute.sweep.plan import plan
from megaroute.sweep.spec import SweepSpecError, load_spec

REPO = Path(__file__).resolve().parents[3]
SPECS = REPO / "configs/sweeps"
TINY = SPECS / "tiny.yaml"


@pytest.fixture(scope="module", params=["tiny.yaml", "isoflop.yaml"])
def shipped(request):
    spec = load_spec(str(SPECS / request.param))
    return spec, plan(spec)


def _groups(points):
    groups = {}
    for p in points:
        groups.setdefault((p.budget, p.variant), []).append(p)
    return groups


def test_shipped_grids_bracket_the_prior_optimum_at_every_budget(shipped):
    spec, points = shipped
    assert spec.design is not None and spec.design.sizes >= 5
    groups = _groups(points)
    assert len(groups) == len(spec.budgets) * len(spec.variants)
    for (budget, variant), ps in groups.items():
        sizes = sorted({p.n_params for p in ps})
        n_star = ps[0].prior_params
        assert len(sizes) == spec.design.sizes, (budget, variant, sizes)
        # N* interior, with at least two sizes on each side (not at an edge)
        assert sizes[1] < n_star < sizes[-2], (budget, variant, n_star, sizes)
        targets = sorted({p.target_params for p in ps})
        assert np.diff(np.log(targets)) == pytest.approx(np.full(len(targets) - 1, math.log(spec.design.span) /
                                                                 (spec.design.sizes - 1)))
        assert math.sqrt(targets[0] * targets[-1]) == pytest.approx(n_star)
        # the prior: the centre size trains ~tokens_per_param tokens per parameter
        centre = min(ps, key=lambda p: abs(math.log(p.n_params / n_star)))
        assert centre.tokens_per_param == pytest.approx(spec.design.tokens_per_param, rel=0.1)


def test_shipped_shapes_are_within_tolerance_of_their_targets(shipped):
    spec, points = shipped
    for p in points:
        assert abs(p.n_params / p.target_params - 1) <= spec.design.shape.tolerance <= 0.03, p.run_name


def test_isoflop_grid_lies_in_157m_to_1b():
    points = plan(load_spec(str(SPECS / "isoflop.yaml")))
    sizes = [p.n_params for p in points]
    assert 150e6 < min(sizes) and max(sizes) < 1.1e9
    assert {p.budget for p in points} == {1e19, 1.7e19, 3e19}


def test_no_point_ends_inside_warm_up_and_schedules_scale_with_each_run(shipped):
    spec, points = shipped
    for p in points:
        assert 0 < p.warmup_steps < p.steps and p.warmup_steps == round(spec.schedule.warmup_fraction * p.steps)
        assert p.decay_steps == p.steps - p.warmup_steps  # cosine to min_lr at the run's own end
        assert p.tokens_per_param >= spec.min_tokens_per_param
    p = points[-1]
    cfg = load_config(p.config_path, p.overrides)
    assert (cfg.optim.warmup_steps, cfg.train.max_steps) == (p.warmup_steps, p.steps)


def test_learning_rate_and_batch_follow_the_rules(shipped):
    spec, points = shipped
    for p in points:
        cfg = load_config(p.config_path, p.overrides)
        assert p.lr == cfg.optim.lr == pytest.approx(spec.lr.lr(cfg.model.d_model, p.budget), rel=1e-3)
        assert cfg.optim.min_lr == pytest.approx(0.1 * p.lr, rel=1e-3)
        layout = cfg.train.micro_batch_size * (8 if spec.gpu == "a100" else 1)
        assert cfg.train.global_batch_size == p.global_batch_size and p.global_batch_size % layout == 0
        assert abs(p.tokens_per_step - spec.batch.tokens(p.budget)) <= layout * cfg.data.seq_len / 2
    assert {p.global_batch_size for p in points if p.budget == spec.budgets[-1]} == {
        BatchRule().sequences(spec.budgets[-1], cfg.data.seq_len, layout)}


def test_isoflop_known_case():
    """The 1e19 dense grid's middle point: documented rules by hand."""
    points = plan(load_spec(str(SPECS / "isoflop.yaml")))
    p = next(p for p in points if (p.budget, p.variant) == (1e19, "dense") and p.size == "d896l21")
    assert p.lr == pytest.approx(6e-4 * 768 / 896, rel=1e-3) and p.global_batch_size == 224
    assert p.steps == round(1e19 / (p.flops_per_token * 224 * 2048)) and p.warmup_steps == round(0.05 * p.steps)
    assert LrRule().lr(896, 1e19) == pytest.approx(5.1429e-4, rel=1e-4)


def _spec(tmp_path, text: str, name: str = "spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(text.replace("CONFIGS", str(REPO / "configs")))
    return str(path)


TINY_DESIGN = (TINY.read_text().replace("../tiny", "CONFIGS/tiny"))
FIXED = """
name: s
budgets: [2.0e+10]
sizes: {a: [model.d_model=32, model.n_heads=2]}
variants: {dense: {config: "CONFIGS/tiny.yaml"}}
overrides: [train.global_batch_size=8, train.micro_batch_size=4, data.seq_len=64, model.max_seq_len=64]
gpu: cpu
"""


@pytest.mark.parametrize("text, where, key, reason", [
    # a fixed 50-step warm-up (tiny.yaml's optim.warmup_steps) longer than the run
    (FIXED.replace("2.0e+10", "1.0e+10"), "s-dense-a-C1e10-s0 (index 0)", "schedule",
     "ends inside its warm-up: 38 steps, warm-up 50 steps"),
    (FIXED + "schedule: {warmup_fraction: 0.05, min_warmup_steps: 100}\n", "s-dense-a-C2e10-s0", "schedule",
     "ends inside its warm-up: 76 steps, warm-up 100 steps"),
    (FIXED.replace("2.0e+10", "1.0e+11") + "min_tokens_per_param: 20\n", "s-dense-a-C1e11-s0", "min_tokens_per_param",
     "tokens per parameter"),
    (TINY_DESIGN.replace("tolerance: 0.03,\n          ffn_ratio: [2.0, 4.0]}", "tolerance: 0.01}"),
     "tiny-isoflop-", "design.shape.tolerance", "off the grid's target"),
    (TINY_DESIGN.replace("span: 4.0", "span: 1.05"), "variant dense, budget 5e+10", "design.span", "not 5 distinct"),
    (TINY_DESIGN.replace("budgets: [5.0e10, 2.0e11]", "budgets: [1.0e6]"), "variant dense, budget 1e+06", "budgets",
     "below the shape rule's smallest model"),
])
def test_unsound_points_are_refused_with_a_reason(tmp_path, capsys, text, where, key, reason):
    path = _spec(tmp_path, text)
    with pytest.raises(SweepSpecError) as e:
        plan(load_spec(path))
    assert f"sweep key '{key}'" in str(e.value) and where in str(e.value) and reason in str(e.value), str(e.value)
    assert main(["sweep", "plan", path]) == 2  # before anything is submitted
    assert reason in capsys.readouterr().err


def test_fixed_sizes_plan_with_the_configs_values(tmp_path):
    spec = load_spec(_spec(tmp_path, FIXED.replace("2.0e+10", "1.0e+11") + "lr_sweep: [0.5, 1]\n"))
    assert spec.design is None and spec.lr is None and spec.min_tokens_per_param is None
    low, one = plan(spec)
    assert (one.lr, one.global_batch_size, one.warmup_steps, one.target_params) == (1e-3, 8, 50, None)
    assert low.lr == 5e-4 and low.run_name.endswith("-lr0.5") and "optim.min_lr=5e-05" in low.overrides


@pytest.mark.parametrize("override, key", [
    ("optim.lr=0.01", "lr"), ("train.global_batch_size=64", "batch"), ("optim.warmup_steps=3", "schedule"),
    ("model.d_model=64", "design"), ("model.d_ff=64", "design"),
])
def test_overriding_a_key_a_rule_sets_is_refused(override, key):
    with pytest.raises(SweepSpecError, match=rf"sweep key '{key}'.*set per point by the spec's `{key}:` rule"):
        plan(load_spec(str(TINY)), (override,))


@pytest.mark.parametrize("change, key", [
    (("sizes: 5", "sizes: 3"), "design.sizes"),
    (("span: 4.0", "span: 1.0"), "design.span"),
    (("aspect: 8,", "aspekt: 8,"), "design.shape.aspekt"),
    (("head_dim: 8,", "head_dim: 3,"), "design.shape.head_dim"),
    (("ffn_ratio: [2.0, 4.0]", "ffn_ratio: [4.0, 2.0]"), "design.shape.ffn_ratio"),
    (("{rule: width, base: 1.0e-3, d_ref: 128}", "{rule: compute, base: 1.0e-3}"), "lr.base"),
    (("{rule: width,", "{rule: muP,"), "lr.rule"),
    (("exponent: 0.3271}", "exponent: 0.3271, data_parallel: 0}"), "batch.data_parallel"),
    (("{warmup_fraction: 0.05}", "{warmup_fraction: 0.5, decay_fraction: 0.6}"), "schedule.decay_fraction"),
    (("{warmup_fraction: 0.05}", "{warmup_fraction: 1.0}"), "schedule.warmup_fraction"),
    (("seeds: [0]", "seeds: [0]\nlr_sweep: [1, 1]"), "lr_sweep"),
    (("seeds: [0]", "seeds: [0]\nsizes: {a: []}"), "design"),
    (("{config: CONFIGS/tiny.yaml}", '{config: "CONFIGS/tiny_{size}.yaml"}'), "variants.dense.config"),
])
def test_design_spec_errors_name_the_key(tmp_path, change, key):
    assert change[0] in TINY_DESIGN
    with pytest.raises(SweepSpecError) as e:
        load_spec(_spec(tmp_path, TINY_DESIGN.replace(*change)))
    assert f"sweep key '{key}'" in str(e.value)


def test_lr_sweep_expands_each_point_into_tagged_multipliers(tmp_path):
    base = plan(load_spec(str(TINY)))
    points = plan(load_spec(_spec(tmp_path, TINY_DESIGN.replace("seeds: [0]", "seeds: [0]\nlr_sweep: [0.5, 1, 2]"))))
    assert len(points) == 3 * len(base) and [p.index for p in points] == list(range(len(points)))
    assert len({p.run_name for p in points}) == len(points)
    for i, b in enumerate(base):
        trio = points[3 * i: 3 * i + 3]  # the multiplier is the innermost loop
        assert [p.lr_mult for p in trio] == [0.5, 1.0, 2.0]
        assert [p.run_name for p in trio] == [f"{b.run_name}-lr{m}" for m in ("0.5", "1", "2")]
        assert [p.lr for p in trio] == pytest.approx([0.5 * b.lr, b.lr, 2 * b.lr], rel=1e-3)
        assert {(p.size, p.steps, p.global_batch_size) for p in trio} == {(b.size, b.steps, b.global_batch_size)}
    cfg = load_config(points[0].config_path, points[0].overrides)
    assert cfg.tracking.tags["lr_mult"] == "0.5" and cfg.optim.lr == points[0].lr


def test_plan_prints_tokens_per_param_schedule_lr_and_batch(capsys):
    assert main(["sweep", "plan", str(TINY)]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0].split()
    for column in ("params", "vs", "target", "tok/param", "steps", "warm-up", "decay", "LR", "batch", "GPU-h"):
        assert column in head
    summary = [line for line in out.splitlines() if line.startswith("  C=")]
    assert len(summary) == 4 and summary[0].startswith("  C=5e+10 dense: N*=")
    assert all("(2 below N*, 3 above)" in line or "(3 below N*, 2 above)" in line for line in summary)
    assert "20 points" in out
