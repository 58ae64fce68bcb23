"""Sweep spec validation, planning (budgets, order, overrides), isoFLOP fits and the analyze command."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

import numpy as np
import pytest

from megaroute.cli import main
from megaroute.config import load_config
from megaroute.sweep import analyze as A
from megaroute.sweep.plan import plan
from megaroute.sweep.spec import SweepSpecError, load_spec

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs/sweeps/tiny.yaml"


def _spec(tmp_path, text: str) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(text.replace("CONFIGS", str(REPO / "configs")))
    return str(path)


GOOD = """
name: s
budgets: [2.0e+10]
sizes: {a: [model.d_model=32, model.n_heads=2]}
variants: {dense: {config: "CONFIGS/tiny.yaml"}}
overrides: [train.global_batch_size=8, train.micro_batch_size=4, data.seq_len=64]
gpu: cpu
"""


@pytest.mark.parametrize("change, key", [
    (("name: s", "nme: s"), "nme"),
    (("budgets: [2.0e+10]", "budgets: [0]"), "budgets[0]"),
    (("budgets: [2.0e+10]", "budgets: [lots]"), "budgets[0]"),
    (("CONFIGS/tiny.yaml", "CONFIGS/missing_{size}.yaml"), "variants.dense.config"),
    (("gpu: cpu", "gpu: k80"), "gpu"),
    (("data.seq_len=64]", "data.seq_len]"), "overrides[2]"),
])
def test_spec_errors_name_the_key(tmp_path, change, key):
    with pytest.raises(SweepSpecError) as e:
        load_spec(_spec(tmp_path, GOOD.replace(*change)))
    assert f"sweep key '{key}'" in str(e.value) and "spec.yaml" in str(e.value)


def test_budget_too_small_for_whole_steps_is_refused(tmp_path):
    spec = load_spec(_spec(tmp_path, GOOD.replace("2.0e+10", "1.0e+9")))
    with pytest.raises(SweepSpecError, match=r"4 steps of 512 tokens miss budget 1e\+09 by \+5.70% \(tolerance 1%\)"):
        plan(spec)


@pytest.mark.parametrize("spec_file", ["tiny.yaml", "isoflop.yaml"])
def test_plan_meets_every_budget_within_one_percent(spec_file):
    spec = load_spec(str(REPO / "configs/sweeps" / spec_file))
    points = plan(spec)
    assert len(points) == len(spec.budgets) * spec.design.sizes * len(spec.variants) * len(spec.seeds)
    assert [p.index for p in points] == list(range(len(points)))
    for p in points:
        assert abs(p.tokens * p.flops_per_token - p.budget) <= 0.01 * p.budget, p
        assert p.gpu_hours > 0 and p.n_params > 0


def test_point_config_carries_steps_tags_and_parent():
    points = plan(load_spec(str(TINY)), ("train.log_interval=5",), parent_run_id="abc123")
    p = points[15]  # budget -> size rank -> variant -> seed: 2nd budget, 3rd size, mod
    cfg = load_config(p.config_path, p.overrides)
    assert (p.budget, p.variant) == (2e11, "mod")
    assert p.size == f"d{cfg.model.d_model}l{cfg.model.n_layers}f{cfg.model.d_ff}"  # the design's shape
    assert cfg.name == p.run_name == f"tiny-isoflop-mod-{p.size}-C2e11-s0"
    assert cfg.train.max_steps == p.steps and cfg.train.max_flops is None and cfg.train.log_interval == 5
    assert cfg.routing.method == "mod" and cfg.optim.lr == p.lr and cfg.optim.warmup_steps == p.warmup_steps
    assert cfg.train.global_batch_size == p.global_batch_size
    assert cfg.tracking.parent_run_id == "abc123"
    assert cfg.tracking.tags == {"sweep_id": "tiny-isoflop", "budget": "2e+11", "size": p.size, "variant": "mod",
                                 "seed": "0", "sweep_index": "15", "n_params": str(p.n_params), "lr_mult": "1",
                                 "prior_n_opt": str(round(p.prior_params))}


def test_point_command_prints_pretrain_sh_arguments(capsys):
    points = plan(load_spec(str(TINY)))
    assert main(["sweep", "point", str(TINY), "--index", "2"]) == 0
    args = shlex.split(capsys.readouterr().out)
    assert args[:4] == ["--gpu", "cpu", "--config", "configs/tiny.yaml"]
    assert f"name={points[2].run_name}" in args and points[2].variant == "dense"
    assert main(["sweep", "point", str(TINY), "--index", str(len(points))]) == 2


def test_plan_dry_run_shows_array_and_commands(capsys):
    assert main(["sweep", "plan", str(TINY), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--array=0-19" in out and "20 points" in out
    assert out.count("slurm/pretrain.sh --gpu cpu --config configs/tiny") == 20


# ---- fits ----

def _parabola_losses(params, n_opt, l_opt, curvature=0.3):
    return [l_opt + curvature * (np.log10(n) - np.log10(n_opt)) ** 2 for n in params]


def test_parabola_vertex_recovers_the_optimum():
    params = [1e8, 2e8, 4e8, 8e8, 1.6e9]
    n, loss, how, coeffs = A.fit_optimum(params, _parabola_losses(params, 3e8, 2.5))
    assert how == "parabola" and n == pytest.approx(3e8, rel=1e-6) and loss == pytest.approx(2.5)


def test_edge_minimum_or_two_sizes_fall_back_to_best_measured():
    params = [1e8, 2e8, 4e8]
    n, _, how, _ = A.fit_optimum(params, _parabola_losses(params, 1e9, 2.5))  # vertex beyond the largest size
    assert (n, how) == (4e8, "best measured")
    n, loss, how, coeffs = A.fit_optimum([1e8, 2e8], [3.0, 2.9])
    assert (n, loss, how, coeffs) == (2e8, 2.9, "best measured", None)


def test_bootstrap_interval_across_seeds_brackets_the_fit_and_widens_with_noise():
    params = [1e8, 2e8, 4e8, 8e8, 1.6e9]

    def fit(noise: float):
        rng = np.random.default_rng(1)
        rows = [("dense", 1e19, int(p), seed, loss + rng.normal(0, noise))
                for seed in range(4) for p, loss in zip(params, _parabola_losses(params, 3e8, 2.5))]
        (f,) = A.isoflop_fits(rows)
        assert f.points == 20 and f.n_interval[0] <= f.n_opt <= f.n_interval[1]
        return f

    exact, small, large = fit(0.0), fit(0.01), fit(0.05)
    assert exact.n_interval == pytest.approx((3e8, 3e8)) and exact.loss_interval == pytest.approx((2.5, 2.5))
    width = lambda f: np.log(f.n_interval[1] / f.n_interval[0])  # noqa: E731
    assert 0 < width(small) < width(large)
    assert 1e8 < small.n_opt < 1e9 and small.loss_interval[0] < 2.5 + 0.02


def test_no_bootstrap_interval_under_three_seeds_at_a_size():
    """A percentile bootstrap over two seeds never leaves their range: it would claim a precision the
    runs do not have. Under MIN_BOOTSTRAP_SEEDS at any size there is no interval, and the table says why."""
    params = [1e8, 2e8, 4e8, 8e8]
    rng = np.random.default_rng(0)
    rows = [("dense", 1e19, int(p), seed, loss + rng.normal(0, 0.02))
            for seed in range(3) for p, loss in zip(params, _parabola_losses(params, 3e8, 2.5))]
    (three,) = A.isoflop_fits(rows)
    (two,) = A.isoflop_fits([r for r in rows if r[3] < 2])
    (uneven,) = A.isoflop_fits([r for r in rows if r[3] < 2 or r[2] != int(4e8)])  # 2 seeds at one size
    assert three.seeds == 3 and three.n_interval is not None and three.loss_interval is not None
    for f in (two, uneven):
        assert f.seeds == 2 and f.n_interval is None and f.loss_interval is None
    row = A.table_rows([two])[0]
    assert row["n_opt_90ci"] == row["loss_opt_90ci"] == "2 seeds at a size: no interval"
    assert A.table_rows([A.isoflop_fits([r for r in rows if r[3] == 0])[0]])[0]["n_opt_90ci"].startswith("1 seed ")
    assert "at least 3 seeds at every size" in A.markdown("s", [two], [], [])


def test_frontier_recovers_the_scaling_exponent():
    params = np.geomspace(1e7, 1e10, 9)
    rows = []
    for budget in (1e18, 1e19, 1e20):
        n_opt = 0.1 * budget ** 0.5
        rows += [("mod", budget, int(p), 0, loss) for p, loss in zip(params, _parabola_losses(params, n_opt, 3.0))]
    fits = A.isoflop_fits(rows)
    (front,) = A.frontiers(fits)
    assert front.exponent == pytest.approx(0.5, abs=1e-3) and front.n_opt(1e19) == pytest.approx(0.1 * 1e19 ** 0.5,
                                                                                                 rel=1e-2)


# ---- analyze against a real (SQLite) MLflow store ----

def test_analyze_reads_runs_and_writes_table_plots_and_artifacts(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("tiny-isoflop", artifact_location=f"file://{tmp_path}/artifacts")
    parent = client.create_run(exp, tags={"sweep_id": "tiny-isoflop", "sweep_role": "parent"}).info.run_id
    points = plan(load_spec(str(TINY)))
    failed = points[7]
    largest = {(q.variant, q.budget): max(r.n_params for r in points if (r.variant, r.budget) == (q.variant, q.budget))
               for q in points}
    for p in points:
        run = client.create_run(exp, run_name=p.run_name, tags={**load_config(p.config_path, p.overrides).tracking.tags,
                                                                 "mlflow.parentRunId": parent})
        # Lowest at each slice's largest size: a grid-edge "best measured" optimum, never a fitted one.
        loss = 3.0 - 0.1 * (p.n_params == largest[p.variant, p.budget]) - 0.05 * (p.variant == "mod")
        client.log_metric(run.info.run_id, "eval/loss", loss)
        if p.variant == "mod":  # routed runs also log the training-mode (top-k) loss, which flatters
            client.log_metric(run.info.run_id, "val/loss_topk", loss - 0.2)
        client.set_terminated(run.info.run_id, "FINISHED" if p is not failed else "FAILED")

    assert main(["sweep", "analyze", str(TINY), f"tracking.uri={uri}", "--out", str(tmp_path / "out")]) == 0
    (out,) = (tmp_path / "out").glob("eval-*")  # each analysis writes a new <out>/<metric>-<UTC time>/
    table = (out / "isoflop_table.md").read_text()
    assert f"| mod | {points[-1].budget:.3g} |" in table and "best measured" in table and "Runs left out" in table
    assert f"{failed.run_name} (" in table.split("## Runs left out")[1]  # the FAILED one
    assert f"no fit: 0 of {len({p.budget for p in points})} budgets with an interior minimum" in table
    assert (out / "isoflop_curves.png").read_bytes()[:4] == b"\x89PNG"
    (analysis,) = client.search_runs([exp], "tags.sweep_role = 'analysis'")  # artifacts: its own child run
    assert analysis.data.tags["mlflow.parentRunId"] == parent and analysis.info.status == "FINISHED"
    logged = {a.path for a in client.list_artifacts(analysis.info.run_id)}
    assert "isoflop_frontier.png" in logged and "isoflop_table.csv" in logged
    assert not client.list_artifacts(parent) and client.get_run(parent).info.status == "RUNNING"

    # Default: eval/loss (no future information); --metric topk: the training-mode figure where a run has one.
    assert main(["sweep", "analyze", str(TINY), f"tracking.uri={uri}", "--out", str(tmp_path / "topk"),
                 "--metric", "topk"]) == 0
    assert "Loss: final eval/loss (autoregressive" in table
    (topk,) = (tmp_path / "topk").glob("topk-*")
    assert "Loss: final val/loss_topk or val/loss_soft or eval/loss (training-mode routing: not comparable" in (
        topk / "isoflop_table.md").read_text()

    def optimum(out, variant):
        (folder,) = (tmp_path / out).glob("*-*")
        rows = list(csv.DictReader(open(folder / "isoflop_table.csv")))
        return [float(r["loss_opt"]) for r in rows if r["variant"] == variant]

    assert optimum("out", "mod") == pytest.approx([x + 0.2 for x in optimum("topk", "mod")])
    assert optimum("out", "dense") == optimum("topk", "dense")

    capsys.readouterr()
    for p in points[:2]:  # compare's FLOPs axis reads train/flops_seen
        (run,) = client.search_runs([exp], f"attributes.run_name = '{p.run_name}'")
        client.log_metric(run.info.run_id, "train/flops_seen", p.flops, step=p.steps)
    assert main(["compare", "--experiment", "tiny-isoflop", "--tracking-uri", uri, "--metric", "eval/loss",
                 "--out", str(tmp_path / "cmp.png"), points[0].run_name, points[1].run_name]) == 0
    assert (tmp_path / "cmp.png").exists() and "eval/loss=3.0000" in capsys.readouterr().out
    assert main(["compare", "--experiment", "tiny-isoflop", "--tracking-uri", uri, "no-such-run"]) == 1
