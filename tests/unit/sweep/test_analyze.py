"""megaroute.sweep.analyze: the frontier through interior minima only, routed-vs-dense differences
with seed intervals, the per-budget isoFLOP figure."""

from __future__ import annotations

import numpy as np
import pytest

from megaroute.sweep import analyze as A

PARAMS = [1e8, 2e8, 4e8, 8e8, 1.6e9]


def _losses(n_opt, l_opt, params=PARAMS, curvature=0.3):
    return [l_opt + curvature * (np.log10(n) - np.log10(n_opt)) ** 2 for n in params]


def _rows(variant, budget, n_opt, l_opt, seed=0, shift=0.0):
    return [(variant, budget, int(p), seed, loss + shift) for p, loss in zip(PARAMS, _losses(n_opt, l_opt))]


def test_frontier_uses_interior_minima_only_and_says_how_many():
    # 1e18 and 1e20 have interior optima on N* = 2e8 (C/1e18)^0.3; at 1e21 the vertex is beyond the largest size.
    rows = _rows("dense", 1e18, 2e8, 3.0) + _rows("dense", 1e20, 2e8 * 100 ** 0.3, 2.8)
    rows += _rows("dense", 1e21, 1e10, 2.7)
    fits = A.isoflop_fits(rows)
    edge = next(f for f in fits if f.budget == 1e21)
    assert not edge.interior and edge.n_opt == 1.6e9 and "vertex beyond the largest size" in edge.note
    (front,) = A.frontiers(fits)
    assert front.fitted and (front.interior, front.budgets) == (2, 3)
    assert front.exponent == pytest.approx(0.3, abs=1e-3)  # the grid-edge point would have dragged it down
    assert "fit through 2 of 3 budgets with an interior minimum" in A.markdown("s", fits, [front], [])


def test_frontier_refuses_with_fewer_than_two_interior_minima():
    # The "N* ~ C^-0.00" case: the best size is the grid's largest at every budget.
    rows = [r for b in (1e18, 1e19, 1e20) for r in _rows("mod", b, 1e11, 3.0)]
    rows += _rows("dense", 1e19, 3e8, 3.0) + [("dense", 1e20, int(p), 0, l) for p, l in zip(PARAMS[:2], (3.0, 2.9))]
    fits = A.isoflop_fits(rows)
    fronts = {f.variant: f for f in A.frontiers(fits)}
    assert not fronts["mod"].fitted and (fronts["mod"].interior, fronts["mod"].budgets) == (0, 3)
    assert not fronts["dense"].fitted and (fronts["dense"].interior, fronts["dense"].budgets) == (1, 2)
    table = A.markdown("s", fits, list(fronts.values()), [])
    assert "| mod | — | — | no fit: 0 of 3 budgets with an interior minimum (needs 2" in table
    assert "| dense | — | — | no fit: 1 of 2 budgets" in table
    assert "best measured (2 size(s): a parabola needs 3)" in table
    assert "C^" not in table.split("## Compute-optimal")[1].split("\n", 1)[1]  # no exponent printed


def test_differences_with_seeds_get_student_t_intervals():
    rows6 = []
    rng = np.random.default_rng(0)
    for seed in range(3):
        seed_shift = rng.normal(0, 0.01)  # shared by both variants of a seed: pairing removes it
        for variant, gain in (("dense", 0.0), ("mod", 0.05 + 0.002 * seed)):
            for p, loss in zip(PARAMS, _losses(3e8, 3.0)):
                rows6.append((variant, 1e19, f"n{int(p)}", int(p), seed, loss - gain + seed_shift))
    fits = A.isoflop_fits([(v, b, n, s, l) for v, b, _, n, s, l in rows6])
    (d,) = A.differences(rows6, "dense", fits)
    assert (d.variant, d.baseline, d.budget) == ("mod", "dense", 1e19)
    assert d.optimum["n"] == 3 and d.optimum["mean"] == pytest.approx(-0.052, abs=1e-9)
    assert d.optimum["ci_low"] < -0.052 < d.optimum["ci_high"] < 0  # t with 2 d.o.f.: 4.30 x 0.002/sqrt(3)
    assert d.optimum["ci_high"] - d.optimum["ci_low"] == pytest.approx(2 * 4.303 * 0.002 / np.sqrt(3), rel=1e-3)
    assert d.size == "n400000000" and d.at_size["mean"] == pytest.approx(-0.052)  # nearest dense's N* = 3e8
    (row,) = A.difference_rows([d])
    assert row["delta_L_opt"] == "-0.0520" and row["delta_L_opt_ci"].startswith("[-0.05") and row["note"] == ""


def test_difference_with_one_seed_has_no_interval_and_edge_optima_are_not_differenced():
    rows6 = [("dense", 1e19, f"n{int(p)}", int(p), 0, l) for p, l in zip(PARAMS, _losses(3e8, 3.0))]
    rows6 += [("mod", 1e19, f"n{int(p)}", int(p), 0, l - 0.05) for p, l in zip(PARAMS, _losses(3e8, 3.0))]
    rows6 += [("dense", 1e20, f"n{int(p)}", int(p), 0, l) for p, l in zip(PARAMS, _losses(5e8, 2.8))]
    rows6 += [("mod", 1e20, f"n{int(p)}", int(p), 0, l) for p, l in zip(PARAMS, _losses(1e11, 2.7))]  # at the edge
    fits = A.isoflop_fits([(v, b, n, s, l) for v, b, _, n, s, l in rows6])
    d19, d20 = A.differences(rows6, "dense", fits)
    r19, r20 = A.difference_rows([d19, d20])
    assert r19["delta_L_opt"] == "-0.0500" and r19["delta_L_opt_ci"] == "n=1, no interval"
    assert r19["delta_L_size_ci"] == "n=1, no interval"
    assert d20.optimum is None and r20["delta_L_opt"] == "—"
    assert "no fit: no seed with an interior minimum for both" in r20["note"]
    assert "mod seed 0: vertex beyond the largest size" in r20["note"]
    assert d20.size == "n400000000" and d20.at_size["n"] == 1  # the matched size still compares


def test_differences_pair_seeds_and_list_unpaired_ones():
    rows6 = [("dense", 1e19, f"n{int(p)}", int(p), s, l) for s in (0, 1) for p, l in zip(PARAMS, _losses(3e8, 3.0))]
    rows6 += [("mod", 1e19, f"n{int(p)}", int(p), s, l - 0.05) for s in (1, 2)
              for p, l in zip(PARAMS, _losses(3e8, 3.0))]
    fits = A.isoflop_fits([(v, b, n, s, l) for v, b, _, n, s, l in rows6])
    (d,) = A.differences(rows6, "dense", fits)
    assert d.optimum["n"] == 1 and d.left_out == ["mod seed 2: no dense run with that seed",
                                                   "dense seed 0: no mod run with that seed"]


def test_isoflop_figure_has_a_panel_per_budget_with_every_variant(tmp_path):
    rows = _rows("dense", 1e19, 3e8, 3.0) + _rows("mod", 1e19, 3e8, 3.0, shift=-0.05)
    rows += _rows("dense", 1e20, 5e8, 2.8) + _rows("mod", 1e20, 1e11, 2.7)
    fig = A.plot_isoflops(str(tmp_path / "c.png"), rows, A.isoflop_fits(rows), ylabel="final eval/loss")
    axes = fig.axes
    assert len(axes) == 2 and [ax.get_title() for ax in axes] == ["C = 1e+19 FLOPs", "C = 1e+20 FLOPs"]
    assert axes[0].get_ylabel() == "final eval/loss" and all(ax.get_xscale() == "log" for ax in axes)
    for ax in axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["dense", "mod"]
    assert [ln.get_linestyle() for ln in axes[1].get_lines()] == ["-", "--"]  # mod's 1e20 vertex is off the grid
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
