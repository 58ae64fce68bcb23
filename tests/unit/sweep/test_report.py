"""megaroute.sweep.report against a real (SQLite) MLflow store: every analysis is a new child run
and a new folder, the parent can be ended, the table names what it fitted and refuses to overclaim."""

from __future__ import annotations

import csv
import datetime as dt

import pytest

from megaroute.sweep import report
from megaroute.sweep.mlflow_runs import sweep_runs

from .fake_mlflow import parent_run, point_run, store, sweep

NOW = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def test_two_analyses_with_different_metrics_both_stay(tmp_path):
    uri, client, exp = store(tmp_path)
    parent = sweep(client, exp)
    first = report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), "eval", now=NOW)
    second = report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), "topk", now=NOW)
    again = report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), "eval", now=NOW)  # same second
    assert [a.out_dir for a in (first, second, again)] == [
        str(tmp_path / "out" / d) for d in ("eval-20300102T030405Z", "topk-20300102T030405Z",
                                            "eval-20300102T030405Z-2")]
    assert len({a.run_id for a in (first, second, again)}) == 3
    runs = {r.info.run_id: r for r in client.search_runs([exp], "tags.sweep_role = 'analysis'")}
    assert set(runs) == {first.run_id, second.run_id, again.run_id}
    for a, metric in ((first, "eval"), (second, "topk")):
        r = runs[a.run_id]
        assert r.info.run_name == f"analysis-{metric}-20300102T030405Z" and r.info.status == "FINISHED"
        assert r.data.tags["sweep_id"] == "sw" and r.data.tags["metric"] == metric
        assert r.data.tags["mlflow.parentRunId"] == parent
        assert {x.path for x in client.list_artifacts(a.run_id)} == {
            "isoflop_table.md", "isoflop_table.csv", "isoflop_differences.csv", "isoflop_curves.png",
            "isoflop_frontier.png"}
        assert list(a) == a.files  # iterating gives the files, as the list it used to return
    eval_md = open(f"{first.out_dir}/isoflop_table.md").read()
    topk_md = open(f"{second.out_dir}/isoflop_table.md").read()
    assert "Loss: final eval/loss (autoregressive" in eval_md and f"MLflow analysis run {first.run_id}" in eval_md
    assert "used: val/loss_topk (mod), eval/loss (dense)" in topk_md
    assert "NOT A COMPARISON" in topk_md and "NOT A COMPARISON" not in eval_md  # mixed metrics flatter routing
    assert runs[again.run_id].data.tags["out_dir"] == again.out_dir
    assert client.get_run(parent).info.status == "RUNNING" and not client.list_artifacts(parent)
    # The analysis runs are not mistaken for points.
    assert len(sweep_runs(uri, "exp", "sw")[1]) == 20


def test_finish_marks_the_parent_finished_and_counts_failed_points(tmp_path):
    uri, client, exp = store(tmp_path)
    parent = sweep(client, exp, failed={("mod", "xxl", 1e20, 0)})
    a = report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), finish=True, now=NOW)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert {k: run.data.tags[k] for k in ("points_runs", "points_finished", "points_failed", "points_missing",
                                          "analysis_run")} == {
        "points_runs": "20", "points_finished": "19", "points_failed": "1", "points_missing": "0",
        "analysis_run": a.run_id}
    assert "sw-mod-xxl-C1e+20-s0" in open(f"{a.out_dir}/isoflop_table.md").read()  # listed as left out


def test_failed_analysis_with_finish_marks_the_parent_failed(tmp_path):
    uri, client, exp = store(tmp_path)
    parent = parent_run(client, exp, "sw", points=1)
    point_run(client, exp, "sw", parent, "dense", "s", 1e19, 100, 0, None, "FAILED")
    with pytest.raises(LookupError, match="no finished run"):
        report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), finish=True, now=NOW)
    run = client.get_run(parent)
    assert run.info.status == "FAILED" and run.data.tags["points_failed"] == "1"
    assert "LookupError" in run.data.tags["analysis_error"]
    (analysis,) = client.search_runs([exp], "tags.sweep_role = 'analysis'")
    assert analysis.info.status == "FAILED"


def test_differences_table_and_csv(tmp_path):
    uri, client, exp = store(tmp_path)
    sweep(client, exp, seeds=(0, 1, 2), noise=0.002)
    a = report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), now=NOW)
    rows = list(csv.DictReader(open(f"{a.out_dir}/isoflop_differences.csv")))
    assert [(r["budget"], r["variant"], r["baseline"], r["delta_L_opt_seeds"]) for r in rows] == [
        ("1e+19", "mod", "dense", "3"), ("1e+20", "mod", "dense", "3")]
    for r in rows:
        low, high = (float(x) for x in r["delta_L_opt_ci"].split(" (")[0].strip("[]").split(","))
        assert low < -0.05 < high and float(r["delta_L_opt"]) == pytest.approx(-0.05, abs=0.01)
    md = open(f"{a.out_dir}/isoflop_table.md").read()
    assert "## Routed vs dense" in md and "difference of FITTED OPTIMUM losses" in md
    assert "| 1e+19 | mod − dense | " in md


def test_one_seed_says_no_interval_and_no_dense_variant_says_so(tmp_path):
    uri, client, exp = store(tmp_path)
    sweep(client, exp)
    a = report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), now=NOW)
    assert "n=1, no interval" in open(f"{a.out_dir}/isoflop_table.md").read()

    uri, client, exp = store(tmp_path / "b")
    for size, n, loss in (("s", 1e8, 3.1), ("m", 2e8, 3.0), ("l", 4e8, 3.05)):
        point_run(client, exp, "only", None, "mod", size, 1e19, int(n), 0, loss, routing="mod")
    a = report.analyze_sweep(uri, "exp", "only", str(tmp_path / "b/out"), now=NOW)
    md = open(f"{a.out_dir}/isoflop_table.md").read()
    assert a.parent is None and "No dense variant" in md and "| 1e+19 | mod" not in md.split("## Routed")[1]


def test_learning_rate_sweep_keeps_the_best_multiplier_per_point(tmp_path):
    uri, client, exp = store(tmp_path)
    sweep(client, exp, budgets=(1e19,))  # every run at lr_mult 1 (no tag)
    high = point_run(client, exp, "sw", None, "dense", "m", 1e19, int(2e8), 0, 9.0, name="sw-dense-m-lr2",
                     tags={"lr_mult": "2"})
    low = point_run(client, exp, "sw", None, "mod", "m", 1e19, int(2e8), 0, 1.0, name="sw-mod-m-lr0.5",
                    routing="mod", tags={"lr_mult": "0.5"})
    a = report.analyze_sweep(uri, "exp", "sw", str(tmp_path / "out"), now=NOW)
    md = open(f"{a.out_dir}/isoflop_table.md").read()
    assert "## Learning rate: the lowest-loss multiplier per (variant, size, budget, seed)" in md
    assert "- dense m C=1e+19 seed 0: kept lr_mult 1 (tried 1: " in md
    assert "- mod m C=1e+19 seed 0: kept lr_mult 0.5 (tried 0.5: 1.0000, 1: " in md and "AT THE EDGE" in md
    assert f"sw-dense-m-lr2 ({high}): lr_mult 2, loss 9.0000" in md and f"({low})" not in md.split("Runs not used")[1]
    dense = next(r for r in csv.DictReader(open(f"{a.out_dir}/isoflop_table.csv")) if r["variant"] == "dense")
    assert dense["runs"] == "5" and dense["fit"] == "parabola"


def test_analyze_cli_prints_the_analysis_run_and_finishes_the_parent(tmp_path, capsys, monkeypatch):
    from megaroute.sweep import cli

    uri, client, exp = store(tmp_path)
    parent = sweep(client, exp)
    monkeypatch.setattr(cli, "_load", lambda args: (type("S", (), {"name": "sw"})(), None))
    monkeypatch.setattr(cli, "_tracking", lambda points: (uri, "exp", str(tmp_path / "default")))
    args = cli.argparse.Namespace(spec="x", overrides=[], out=None, metric="eval", finish_parent=True)
    assert cli.run_analyze(args) == 0
    out = capsys.readouterr().out
    assert f"(child of parent run {parent}, now ended)" in out and str(tmp_path / "default" / "eval-") in out
    assert client.get_run(parent).info.status == "FINISHED"
