"""Sweep design rules (megaroute/sweep/design.py): parameter counts, shapes, the prior optimum, LR, batch
and schedule rules, and the learning-rate sweep selection the analysis uses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from megaroute.config import load_config
from megaroute.model import build_model
from megaroute.sweep.design import (BatchRule, Design, LrRule, Schedule, ShapeRule, best_lr_points, decay_steps,
                                    dense_params, design_grid, grid_targets, nearest_shape, sbatch_ranks)

REPO = Path(__file__).resolve().parents[3]
BASE = str(REPO / "configs/base_sweep.yaml")
TINY = str(REPO / "configs/tiny.yaml")
TINY_SHAPES = ShapeRule(d_multiple=8, head_dim=8, aspect=8, aspect_range=(2, 32), min_layers=2, ffn_ratio=(2.0, 4.0))
TINY_OVERRIDES = ["model.max_seq_len=64", "data.seq_len=64", "model.ffn_multiple_of=8"]


@pytest.mark.parametrize("config, overrides", [
    (BASE, ["model.d_model=768", "model.n_layers=16", "model.n_heads=12"]),      # untied, FFN rounded to 256
    (BASE, ["model.d_model=1408", "model.n_layers=29", "model.n_heads=22"]),
    (TINY, ["model.d_model=24", "model.n_layers=5", "model.n_heads=3", "model.d_ff=80"]),  # tied, explicit d_ff
])
def test_dense_parameter_count_matches_the_model(config, overrides):
    cfg = load_config(config, overrides)
    assert dense_params(cfg.model) == build_model(cfg.model, cfg.routing, device="meta").num_params()


@pytest.mark.parametrize("config, rule, overrides, targets", [
    (BASE, ShapeRule(), [], np.geomspace(1.2e8, 1.5e9, 25)),
    (TINY, TINY_SHAPES, TINY_OVERRIDES, np.geomspace(1e4, 1e5, 25)),
])
def test_nearest_shape_is_a_shape_of_the_rule_within_tolerance(config, rule, overrides, targets):
    base = load_config(config, overrides).model
    for target in targets:
        s = nearest_shape(base, rule, target)
        assert abs(s.n_params / target - 1) <= rule.tolerance, (target, s)
        assert s.d_model % rule.d_multiple == 0 and s.n_heads * rule.head_dim == s.d_model
        assert s.n_layers >= rule.min_layers and rule.aspect_range[0] <= s.aspect <= rule.aspect_range[1]
        assert s.n_params == dense_params(s.model(base))
        if rule.ffn_ratio is not None:
            assert rule.ffn_ratio[0] <= s.d_ff / s.d_model <= rule.ffn_ratio[1] and s.d_ff % base.ffn_multiple_of == 0


def test_nearest_shape_prefers_the_rule_aspect_ratio():
    # 162M: configs/dense_157m.yaml's d 768 x 16 layers (aspect 48) is within tolerance/2 of it.
    s = nearest_shape(load_config(BASE).model, ShapeRule(), 162_423_552)
    assert (s.d_model, s.n_layers, s.n_heads, s.name) == (768, 16, 12, "d768l16")


def test_prior_optimum_spends_the_budget_at_the_prior_tokens_per_parameter():
    for overrides in ([], ["routing.method=mod"]):
        cfg = load_config(BASE, overrides)
        for budget in (1e19, 3e19):
            g = design_grid(budget, Design(), cfg.model, cfg.routing, cfg.data.seq_len)
            mid = g.points[2].shape  # the centre of 5 sizes: the target N*
            # C = F(N*) x 20 x N*, F carried over from the nearest shape per parameter
            assert budget == pytest.approx(20 * g.n_star ** 2 * g.flops_per_token(mid) / mid.n_params, rel=1e-4)
    dense = load_config(BASE)
    mod = load_config(BASE, ["routing.method=mod"])
    n_dense = design_grid(1e19, Design(), dense.model, dense.routing, 2048).n_star
    n_mod = design_grid(1e19, Design(), mod.model, mod.routing, 2048).n_star
    assert 250e6 < n_dense < 280e6 and 1.2 < n_mod / n_dense < 1.45  # routing-aware: MoD is cheaper per token


def test_grid_targets_are_log_even_and_centred():
    t = grid_targets(1e8, Design(sizes=5, span=4.0))
    assert t == pytest.approx([5e7, 1e8 / math.sqrt(2), 1e8, 1e8 * math.sqrt(2), 2e8])
    assert grid_targets(1e8, Design(sizes=6, span=4.0))[0] == pytest.approx(5e7)
    ratios = np.diff(np.log(grid_targets(3e8, Design(sizes=7, span=3.0))))
    assert ratios == pytest.approx(np.full(6, math.log(3) / 6))


def test_learning_rate_rules_give_the_documented_values():
    width = LrRule()  # muP-like: 6e-4 at d 768, x 768 / d_model
    assert width.lr(768, 1e19) == pytest.approx(6e-4) and width.lr(1536, 3e19) == pytest.approx(3e-4)
    assert LrRule(power=0.5).lr(3072, 1e19) == pytest.approx(3e-4)
    compute = LrRule(rule="compute")  # DeepSeek LLM: 0.3118 C^-0.125
    assert compute.lr(768, 1e19) == pytest.approx(0.3118 * 10 ** (-19 / 8)) == pytest.approx(1.3149e-3, rel=1e-4)
    assert compute.lr(2048, 1e19) == compute.lr(768, 1e19)  # one LR per budget


def test_batch_rule_gives_the_documented_values_in_whole_micro_batch_layouts():
    rule = BatchRule()  # DeepSeek LLM: 0.292 C^0.3271 tokens
    assert rule.tokens(1e19) == pytest.approx(4.789e5, rel=1e-3)
    # 4.789e5 / 2048 = 233.8 sequences -> nearest multiple of micro 4 x 8 ranks = 224
    assert rule.sequences(1e19, 2048, 32) == 224 and rule.sequences(3e19, 2048, 32) == 320
    assert rule.sequences(1e15, 2048, 32) == 32  # at least one layout


def test_schedule_rules():
    s = Schedule(warmup_fraction=0.05)
    assert s.warmup_steps(20418) == 1021 and Schedule(0.05, min_warmup_steps=100).warmup_steps(1000) == 100
    assert decay_steps("cosine", 0.2, 50, 1000) == 950
    assert decay_steps("wsd", 0.2, 50, 1000) == 200 and decay_steps("wsd", 0.99, 50, 1000) == 950
    assert decay_steps("constant", 0.2, 50, 1000) == 0


def test_sbatch_ranks():
    assert sbatch_ranks(["--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8"]) == 16
    assert sbatch_ranks(["--nodes=1", "--ntasks=1", "--cpus-per-task=1"]) == 1
    assert sbatch_ranks(["--time=1:00:00"]) is None


@dataclass(frozen=True)
class Run:  # like megaroute.sweep.mlflow_runs.RunResult
    name: str
    variant: str
    size: str
    budget: float
    seed: int
    val_loss: float | None
    lr_mult: float = 1.0


def test_best_lr_points_keeps_the_lowest_loss_per_point_and_records_the_choice():
    runs = [Run("a0.5", "dense", "d768l16", 1e19, 0, 3.10, 0.5), Run("a1", "dense", "d768l16", 1e19, 0, 3.00, 1.0),
            Run("a2", "dense", "d768l16", 1e19, 0, 3.05, 2.0),
            Run("b0.5", "mod", "d768l16", 1e19, 0, 2.90, 0.5), Run("b1", "mod", "d768l16", 1e19, 0, 2.95, 1.0),
            Run("b2", "mod", "d768l16", 1e19, 0, None, 2.0),          # failed: dropped
            Run("c1", "dense", "d768l16", 1e19, 1, 3.01, 1.0),        # another seed: its own group
            Run("d", "dense", "d896l21", 1e19, 0, 2.99)]              # no lr sweep
    kept, choices = best_lr_points(runs)
    assert [r.name for r in kept] == ["a1", "b0.5", "c1", "d"]
    by = {(c.variant, c.seed, c.size): c for c in choices}
    a, b = by["dense", 0, "d768l16"], by["mod", 0, "d768l16"]
    assert a.lr_mult == 1.0 and not a.at_edge and a.losses == ((0.5, 3.10), (1.0, 3.00), (2.0, 3.05))
    assert b.lr_mult == 0.5 and b.at_edge and b.losses == ((0.5, 2.90), (1.0, 2.95))
    assert not by["dense", 0, "d896l21"].at_edge and by["dense", 0, "d896l21"].as_row()["tried"] == "1:2.9900"


def test_best_lr_points_reads_dicts_and_breaks_ties_toward_one():
    rows = [{"variant": "v", "size": "s", "budget": "1e+19", "seed": "0", "lr_mult": "2", "loss": 1.0},
            {"variant": "v", "size": "s", "budget": 1e19, "seed": 0, "lr_mult": "1", "loss": 1.0},
            {"variant": "v", "size": "s", "budget": 1e19, "seed": 0, "lr_mult": None, "loss": float("nan")}]
    kept, (choice,) = best_lr_points(rows, loss="loss")
    assert kept == [rows[1]] and choice.lr_mult == 1.0 and choice.budget == 1e19
