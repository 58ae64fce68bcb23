"""The demo: its speed figures (medians over the run's logged windows, not its last window) and what
it refuses before deleting or launching anything."""

import math
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from megaroute import demo
from megaroute.demo import _run_median


def test_speed_is_the_median_of_the_logged_windows_after_the_first(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.create_run(client.create_experiment("demo")).info.run_id
    # logged out of step order; step 10's window holds the start-up steps and is left out
    for step, value in ((20, 200.0), (10, 10.0), (40, 250.0), (30, 300.0)):
        client.log_metric(run, "perf/tokens_per_s", value, step=step)
    client.log_metric(run, "perf/mfu", 0.5, step=10)
    assert _run_median(client, run, "perf/tokens_per_s") == 250.0  # median of 200, 300, 250
    assert _run_median(client, run, "perf/mfu") == 0.5  # one window: that one
    assert math.isnan(_run_median(client, run, "perf/missing"))


def test_bad_overrides_stop_before_anything_is_deleted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(demo.__file__.rsplit("/megaroute/", 1)[0])  # the configs/ of this checkout
    mine = tmp_path / "runs" / "mine"
    mine.mkdir(parents=True)
    (mine / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(demo, "_launch", lambda *a: pytest.fail("launched"))
    for argv, message in ((["name=mine", f"runs_dir={tmp_path}/runs"], "drop the name= override"),
                          (["model.d_model=-1", f"runs_dir={tmp_path}/runs"], "config key 'model.d_model'")):
        with pytest.raises(SystemExit) as e:
            demo.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert (mine / "metrics.jsonl").read_text() == "{}\n"


def test_a_failed_run_is_reported_not_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(demo.__file__.rsplit("/megaroute/", 1)[0])

    def fail(config, name, nprocs, overrides):
        raise subprocess.CalledProcessError(2, ["deepspeed", "launcher/pretrain.py"])

    monkeypatch.setattr(demo, "_launch", fail)
    assert demo.main([f"runs_dir={tmp_path}/runs"]) == 2
    assert "the dense run failed (exit 2)" in capsys.readouterr().err
