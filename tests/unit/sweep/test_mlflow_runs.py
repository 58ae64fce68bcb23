"""megaroute.sweep.mlflow_runs against a real (SQLite) MLflow store: ending and reopening the parent,
analysis runs apart from points."""

from __future__ import annotations

import pytest

from megaroute.sweep.local import finished_run_names
from megaroute.sweep.mlflow_runs import (finish_parent, open_parent_run, start_analysis_run, sweep_runs)

from .fake_mlflow import point_run, store


def test_parent_ends_finished_with_point_counts_and_reopens_on_resubmission(tmp_path):
    uri, client, exp = store(tmp_path)
    parent = open_parent_run(uri, "exp", "sw", {"points": "4"})
    point_run(client, exp, "sw", parent, "dense", "s", 1e19, 100, 0, 3.0)
    point_run(client, exp, "sw", parent, "mod", "s", 1e19, 100, 0, None, "FAILED", routing="mod")
    point_run(client, exp, "sw", parent, "mod", "m", 1e19, 200, 0, None, "RUNNING", routing="mod")  # task died
    assert finish_parent(uri, "exp", "sw", "FINISHED") == parent
    run = client.get_run(parent)
    assert run.info.status == "FINISHED"
    assert {k: v for k, v in run.data.tags.items() if k.startswith("points_")} == {
        "points_runs": "3", "points_finished": "1", "points_failed": "2", "points_missing": "1"}
    # Resubmitting the same sweep reuses the parent and sets it RUNNING again.
    assert open_parent_run(uri, "exp", "sw", {}) == parent and client.get_run(parent).info.status == "RUNNING"
    assert finish_parent(uri, "exp", "other-sweep") is None


def test_analysis_runs_are_children_and_never_points(tmp_path):
    uri, client, exp = store(tmp_path)
    parent = open_parent_run(uri, "exp", "sw", {})
    point_run(client, exp, "sw", parent, "dense", "s", 1e19, 100, 0, 3.0, metrics={"val/loss_topk": 2.5})
    run_id = start_analysis_run(uri, "exp", "sw", parent, "topk", ("val/loss_topk", "eval/loss"), "20300101T000000Z")
    run = client.get_run(run_id)
    assert run.info.run_name == "analysis-topk-20300101T000000Z"
    assert {k: run.data.tags[k] for k in ("sweep_id", "sweep_role", "metric", "loss_metrics", "mlflow.parentRunId")} \
        == {"sweep_id": "sw", "sweep_role": "analysis", "metric": "topk", "loss_metrics": "val/loss_topk,eval/loss",
            "mlflow.parentRunId": parent}
    found_parent, points = sweep_runs(uri, "exp", "sw", ("val/loss_topk", "eval/loss"))
    assert found_parent == parent and [(p.variant, p.val_loss, p.loss_key, p.routing) for p in points] == [
        ("dense", 2.5, "val/loss_topk", "none")]


def test_sweep_names_with_a_quote_find_their_runs_and_both_quotes_are_refused(tmp_path):
    """One filter clause (sweep_filter) for every search of a sweep's runs: the parent's lookup, the
    points and the local runner's finished points; a name with a quote is quoted with the other one."""
    uri, client, exp = store(tmp_path)
    sweep = "bob's sweep"
    parent = open_parent_run(uri, "exp", sweep, {})
    assert open_parent_run(uri, "exp", sweep, {}) == parent  # found again, not a second parent
    point_run(client, exp, sweep, parent, "dense", "s", 1e19, 100, 0, 3.0, name="dense-s")
    point_run(client, exp, sweep, parent, "mod", "s", 1e19, 100, 0, None, "FAILED", routing="mod", name="mod-s")
    point_run(client, exp, "other", None, "dense", "s", 1e19, 100, 0, 2.0, name="other-s")
    found, points = sweep_runs(uri, "exp", sweep)
    assert found == parent and sorted(p.variant for p in points) == ["dense", "mod"]
    assert finished_run_names(uri, "exp", sweep) == {"dense-s"}
    for search in (lambda: sweep_runs(uri, "exp", "a'b\"c"), lambda: finished_run_names(uri, "exp", "a'b\"c")):
        with pytest.raises(LookupError, match="both quote characters"):
            search()
