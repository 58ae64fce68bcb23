"""`megaroute compare`: curves against training FLOPs (train/flops_seen) by default, --x step on request."""

from __future__ import annotations

import pytest

from megaroute.cli import main
from megaroute.sweep import compare

from .fake_mlflow import store


def test_steps_map_to_flops_between_and_beyond_logged_steps():
    flops = [(10, 100.0), (20, 200.0)]  # 10 FLOPs per step, logged every 10 steps
    assert compare.steps_to_flops([(5, 1.0), (10, 2.0), (15, 3.0), (25, 4.0)], flops) == [
        (50.0, 1.0), (100.0, 2.0), (150.0, 3.0), (250.0, 4.0)]


def _runs(tmp_path):
    uri, client, exp = store(tmp_path)
    ids = {}
    for name, per_step in (("small", 1e9), ("big", 4e9)):
        run_id = client.create_run(exp, run_name=name).info.run_id
        for step in (10, 20, 30):  # train metrics every log_interval
            client.log_metric(run_id, "train/flops_seen", per_step * step, step=step)
            client.log_metric(run_id, "train/loss", 4.0 - step / 100, step=step)
        for step in (15, 30):  # eval at its own interval and the last step
            client.log_metric(run_id, "eval/loss", 3.0 - step / 100, step=step)
        ids[name] = run_id
    return uri, client, exp, ids


def test_compare_plots_against_flops_by_default_and_step_on_request(tmp_path, monkeypatch, capsys):
    uri, client, exp, ids = _runs(tmp_path)
    seen = {}
    monkeypatch.setattr(compare, "plot", lambda path, runs, metrics, curves, xlabel: seen.update(
        curves=curves, xlabel=xlabel))
    base = ["compare", "--experiment", "exp", "--tracking-uri", uri, "small", "big"]
    assert main(base) == 0
    assert seen["xlabel"] == "training FLOPs (train/flops_seen)"
    assert seen["curves"][ids["big"], "eval/loss"] == [(60e9, pytest.approx(2.85)), (120e9, pytest.approx(2.7))]
    assert seen["curves"][ids["small"], "train/loss"][0] == (10e9, pytest.approx(3.9))
    assert main(base + ["--x", "step"]) == 0
    assert seen["xlabel"] == "optimizer step" and [s for s, _ in seen["curves"][ids["big"], "eval/loss"]] == [15, 30]
    # train/loss is the training forward's: routed runs' top-k sees the future, and the output says so
    assert "train/loss: the training forward" in capsys.readouterr().out


def test_losses_that_are_not_autoregressive_carry_their_caveat_in_titles():
    from megaroute import metric_names as names

    assert names.metric_label("eval/loss") == names.LOSS_LABEL
    assert "sees future tokens" in names.metric_label("val/loss_topk")
    assert "sees future tokens" in names.metric_label("train/loss")
    assert names.metric_label("perf/mfu") == "perf/mfu"


def test_compare_on_flops_refuses_runs_without_flops_history(tmp_path, capsys):
    uri, client, exp, ids = _runs(tmp_path)
    old = client.create_run(exp, run_name="old").info.run_id
    client.log_metric(old, "eval/loss", 3.0, step=5)
    args = ["compare", "--experiment", "exp", "--tracking-uri", uri, "small", "old", "--out", str(tmp_path / "c.png")]
    assert main(args) == 1
    assert "no train/flops_seen history in old" in capsys.readouterr().err and not (tmp_path / "c.png").exists()
    assert main(args + ["--x", "step"]) == 0 and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_a_name_several_runs_share_means_the_latest_started_and_the_output_lists_the_others(tmp_path, monkeypatch,
                                                                                              capsys):
    """`make demo` run twice, or a restart with checkpoint.resume=none, leaves runs of one name."""
    uri, client, exp, ids = _runs(tmp_path)
    start = client.get_run(ids["small"]).info.start_time
    earlier = client.create_run(exp, run_name="small", start_time=start - 60_000).info.run_id
    later = client.create_run(exp, run_name="small", start_time=start + 60_000).info.run_id
    for step in (10, 20):
        client.log_metric(later, "train/flops_seen", 1e9 * step, step=step)
        client.log_metric(later, "eval/loss", 9.0, step=step)
    seen = {}
    monkeypatch.setattr(compare, "plot", lambda path, runs, metrics, curves, xlabel: seen.update(runs=runs))
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "small", "big", "--metric", "eval/loss"]) == 0
    assert seen["runs"] == [(later, "small"), (ids["big"], "big")]
    out, err = capsys.readouterr()
    assert f"small ({later}): eval/loss=9.0000" in out
    assert f"3 runs in 'exp' are named 'small': taking the latest started, {later}" in err
    assert ids["small"] in err and earlier in err
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, earlier, "--x", "step"]) == 0  # an id: that run
    assert seen["runs"] == [(earlier, "small")] and "named" not in capsys.readouterr().err
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "nope"]) == 1
    assert "no run named 'nope'" in capsys.readouterr().err
    quoted = client.create_run(exp, run_name="bob's").info.run_id  # a quote in the name: the search filter holds
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "bob's", "--x", "step"]) == 0
    assert seen["runs"] == [(quoted, "bob's")]
    assert main(["compare", "--experiment", "exp", "--tracking-uri", uri, "a'b\"c", "--x", "step"]) == 1
    assert "no run named 'a\\'b\"c'" in capsys.readouterr().err  # both quotes: no filter can name it
