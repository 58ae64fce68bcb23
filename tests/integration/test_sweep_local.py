"""`megaroute sweep run SPEC --local`: real training processes and a real MLflow SQLite store.

Shrunk versions of configs/sweeps/tiny.yaml (one budget, dense only, 1-2 sizes) keep each run to
a couple of launches of a few seconds on 2 cores.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from megaroute.cli import main

from .conftest import REPO, read_metrics, wait_for

pytestmark = pytest.mark.slow

COMMON = ("[model.n_layers=2, model.max_seq_len=64, data.seq_len=64, train.micro_batch_size=4, "
          "train.global_batch_size=8, train.eval_interval=1000, train.eval_batches=2, train.log_interval=1, "
          "optim.warmup_steps=5, checkpoint.interval=1000]")
D32, D64 = "d32: [model.d_model=32, model.n_heads=2]", "d64: [model.d_model=64, model.n_heads=4]"


def _spec(tmp_path: Path, name: str, budget: str, sizes: list[str], variants: list[str]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text("\n".join([
        f"name: {name}", f"budgets: [{budget}]", "sizes:", *(f"  {s}" for s in sizes), "variants:",
        *(f"  {v}" for v in variants), f"overrides: {COMMON}", "gpu: cpu", ""]).replace("CONFIGS", str(REPO / "configs")))
    return str(path)


def _start(spec: str, runs: Path, char_data: str, *args: str) -> subprocess.Popen:
    # Overrides after the options, as documented: `sweep run SPEC --local [--parallel N] [key=value ...]`.
    cmd = [sys.executable, "-m", "megaroute.cli", "sweep", "run", spec, "--local", *args, f"runs_dir={runs}",
           f"data.output_dir={char_data}"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"sweep run timed out:\n{out[-4000:]}")
    return proc.returncode, out


def _run_here(capsys, monkeypatch, spec: str, runs: Path, char_data: str, *args: str) -> tuple[int, str]:
    """The same command through the CLI's entry point in this process (no interpreter start-up and
    imports) -> (exit code, stdout)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # as _start: the runner sets it per point
    capsys.readouterr()
    rc = main(["sweep", "run", spec, "--local", *args, f"runs_dir={runs}", f"data.output_dir={char_data}"])
    return rc, capsys.readouterr().out


def _runs(runs: Path, experiment: str, role: str | None = None) -> list:
    """The experiment's runs with that sweep_role (None: point runs, which have none)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("sweep_role") == role]


def _table(out: str) -> str:
    """The table of the analysis the output names (sweep analyze writes a new folder each time)."""
    [folder] = re.findall(r"analysis in (\S+) and MLflow run", out)
    return (Path(folder) / "isoflop_table.md").read_text()


def test_local_sweep_stops_resumes_and_skips_finished_points(tmp_path, char_data, capsys, monkeypatch):
    spec = _spec(tmp_path, "loc", "4.0e10", [D32, D64], ["dense: {config: CONFIGS/tiny.yaml}"])
    runs = tmp_path / "runs"
    long_point = runs / "loc-dense-d32-C4e10-s0"   # 289 steps; d64 trains 99

    # 1. SIGTERM mid-training: every running point checkpoints and stops, the runner exits 128 + 15.
    # The short point may finish first (on a loaded machine the long one can start seconds later, or
    # the signal can land in the short one's last step): then it is a finished point that step 2 skips.
    proc = _start(spec, runs, char_data, "--parallel", "2")
    wait_for(lambda: proc.poll() is not None or ((long_point / "metrics.jsonl").exists()
                                                 and len(read_metrics(long_point)) >= 10), timeout=240, interval=0.1)
    ranks = psutil.Process(proc.pid).children()
    assert proc.poll() is None and 1 <= len(ranks) <= 2, _finish(proc)[1]
    proc.send_signal(signal.SIGTERM)
    rc, out = _finish(proc, timeout=120)
    assert rc == 128 + signal.SIGTERM, out
    assert "stopped (exit 75)" in out and "run the same command again to resume" in out, out
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks if psutil.pid_exists(p.pid))
    stopped_at = max(read_metrics(long_point))
    assert 10 <= stopped_at < 289 and (long_point / "checkpoints/latest").exists(), out
    [parent] = _runs(runs, "loc", "parent")
    assert parent.info.status == "KILLED"
    finished = sum(r.info.status == "FINISHED" for r in _runs(runs, "loc"))
    assert finished <= 1  # the long point did not finish

    # 2. The same command resumes the stopped points from their checkpoints and analyzes.
    rc, out = _finish(_start(spec, runs, char_data, "--parallel", "2"))
    assert rc == 0, out
    assert (f"2 points, {finished} already FINISHED, {2 - finished} to run" in out
            and f"parent run {parent.info.run_id} FINISHED" in out), out
    logs = sorted((long_point / "logs").glob("local-*.log"))
    assert len(logs) == 2 and f"resumed from {long_point}/checkpoints/step_{stopped_at:08d}" in logs[-1].read_text()
    assert max(read_metrics(long_point)) == 289
    [again] = _runs(runs, "loc", "parent")  # one parent run per sweep, reused
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED"
    points = _runs(runs, "loc")  # one MLflow run per point, continued after the stop
    assert sorted(r.info.run_name for r in points) == ["loc-dense-d32-C4e10-s0", "loc-dense-d64-C4e10-s0"]
    for r in points:
        t = r.data.tags
        assert r.info.status == "FINISHED" and "eval/loss" in r.data.metrics
        assert t["mlflow.parentRunId"] == parent.info.run_id and t["sweep_id"] == "loc" and t["budget"] == "4e+10"
        assert t["sweep_index"] == {"d32": "0", "d64": "1"}[t["size"]]
    assert "| dense | 4e+10 |" in _table(out)
    [analysis] = _runs(runs, "loc", "analysis")
    assert analysis.data.tags["mlflow.parentRunId"] == parent.info.run_id

    # 3. Nothing left to run: no training process starts, no point run is added; a new analysis is made.
    # In this process (last: a runner holds the sweep's lock file until its process exits).
    rc, out = _run_here(capsys, monkeypatch, spec, runs, char_data, "--parallel", "2")
    assert rc == 0, out
    assert "2 points, 2 already FINISHED, 0 to run" in out and out.count("skipped (FINISHED in MLflow)") == 2, out
    assert len(list((long_point / "logs").glob("local-*.log"))) == 2
    assert sorted(r.info.run_id for r in _runs(runs, "loc")) == sorted(r.info.run_id for r in points)
    assert len(_runs(runs, "loc", "analysis")) == 2 and "| dense | 4e+10 |" in _table(out)
    [parent] = _runs(runs, "loc", "parent")
    assert parent.info.status == "FINISHED"


def test_failing_point_is_reported_and_the_others_run(tmp_path, char_data, capsys):
    # "broken" fails in the training process (exit 2: no such checkpoint to resume), not in the plan.
    broken = "broken: {config: CONFIGS/tiny.yaml, overrides: [checkpoint.resume=step_7]}"
    spec = _spec(tmp_path, "bad", "2.0e10", [D64], [broken, "dense: {config: CONFIGS/tiny.yaml}"])
    runs = tmp_path / "runs"
    rc, out = _finish(_start(spec, runs, char_data))  # one at a time: the failure comes first
    assert rc == 1, out
    log = runs / "bad-broken-d64-C2e10-s0/logs"
    [log] = log.glob("local-*-r0-rank0.log")
    assert f"FAILED point 0 bad-broken-d64-C2e10-s0: exit 2, log {log}" in out, out
    assert "no checkpoint 'step_7'" in log.read_text()
    assert "[1] bad-dense-d64-C2e10-s0: finished" in out and "1 finished, 0 skipped, 1 failed" in out, out
    # The parent ends as the Slurm analysis job ends it: FINISHED (the analysis ran), missing points counted.
    [parent] = _runs(runs, "bad", "parent")
    assert parent.info.status == "FINISHED" and parent.data.tags["points_missing"] == "1", parent.data.tags
    [dense] = _runs(runs, "bad")  # the broken point failed before creating its run
    assert dense.info.run_name == "bad-dense-d64-C2e10-s0" and dense.info.status == "FINISHED"
    assert dense.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert "| dense | 2e+10 |" in _table(out)

    # The launched command is the Slurm array's: `sweep point --index 1` (pretrain.sh adds the precision).
    capsys.readouterr()
    assert main(["sweep", "point", spec, f"runs_dir={runs}", f"data.output_dir={char_data}",
                 f"tracking.uri=sqlite:///{runs}/mlflow.db", "--index", "1", "--parent-run", parent.info.run_id]) == 0
    point_args = shlex.split(capsys.readouterr().out)[2:]  # after --gpu cpu
    [dense_log] = (runs / "bad-dense-d64-C2e10-s0/logs").glob("local-*.log")
    launched = shlex.split(dense_log.read_text().splitlines()[0].split(": ", 2)[2])
    assert launched[1:3] == ["-u", str(REPO / "launcher/pretrain.py")]
    assert launched[3:] == [*point_args, "train.precision=fp32"]
