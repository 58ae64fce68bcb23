"""One MLflow run per training run, across kills, requeues and relaunches (issue 17).

One training run (tiny_mod, one CPU rank, local SQLite store) launched four times in one run
directory: killed with SIGKILL by the rank's PID after a checkpoint and some steps beyond it (its
tracking process outlives it and marks the run FAILED); killed again with SIGKILL together with its
tracking process (points not yet sent are lost: the next launch re-sends the checkpointed ones from
metrics.jsonl); stopped by `train.exit_interval` (exit 75, the run KILLED); relaunched to the end.
The store must then hold exactly one run, FINISHED, whose train/loss history has every step, each
step's latest point equal to the run's own metrics file (steps replayed after a checkpoint appear
twice in the history; the later point is the replay).
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from megaroute.train.run_record import RUN_RECORD
from megaroute.train.signals import EXIT_OK, EXIT_REQUEUE

from .conftest import losses, read_metrics, wait_for

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow")
from mlflow.entities import ViewType  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

CONFIG = "configs/tiny_mod.yaml"
STEPS = 16
COMMON = (f"train.max_steps={STEPS}", "checkpoint.interval=4")


def test_one_mlflow_run_across_kills_exit_75_and_relaunches(launch, tmp_path):
    name = "soak"
    run_dir = tmp_path / "runs" / name
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/runs/mlflow.db")  # conftest's start_job store
    kw = dict(nprocs=1, launcher="python", name=name)

    def checkpoint() -> str:
        latest = run_dir / "checkpoints" / "latest"
        return latest.read_text().strip() if latest.exists() else ""

    def logged() -> int:
        return max(losses(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0

    def recorded() -> str:
        return json.loads((run_dir / RUN_RECORD).read_text())["run_id"]

    def runs() -> list:
        exp = client.get_experiment_by_name("megaroute")
        return client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL)

    # 1. kill -9 of the rank, after checkpoint 4 and steps beyond it.
    job = launch(CONFIG, *COMMON, fault="slow:0.3", **kw)
    wait_for(lambda: checkpoint() >= "step_00000004" and logged() >= 6, timeout=300)
    os.kill(job.proc.pid, signal.SIGKILL)  # launcher="python": the launched process is the rank
    job.proc.wait()
    assert logged() < STEPS, "the run finished before the kill; slow it down further"
    run_id = recorded()
    out = job.output()
    started = re.search(rf"MLflow run {run_id} at ", out)
    first_step = re.search(r"^step +1/", out, re.M)
    assert started and first_step and started.start() < first_step.start(), out[-3000:]  # created before step 1

    # 2. kill -9 of the whole job, its tracking process too, after checkpoint 8 and steps beyond it.
    job = launch(CONFIG, *COMMON, fault="slow:0.3", **kw)
    wait_for(lambda: checkpoint() >= "step_00000008" and logged() >= 10, timeout=300)
    job.kill()
    assert logged() < STEPS, "the run finished before the kill; slow it down further"
    assert "resumed from" in job.output() and f"MLflow run {run_id} at " in job.output()
    assert recorded() == run_id
    # What the killed tracking process had sent: checkpointed steps missing here come from the backfill.
    sent = sorted({m.step for m in client.get_metric_history(run_id, "train/loss")})
    print(f"\ntrain/loss steps in the store after the second kill (at step {logged()}): {sent}")

    # 3. exit_interval: checkpoint at step 12 and exit 75 (requeue me); the run is KILLED until resumed.
    job = launch(CONFIG, *COMMON, "train.exit_interval=12", **kw)
    assert job.wait() == EXIT_REQUEUE, job.output()[-3000:]
    assert [(r.info.run_id, r.info.status) for r in runs()] == [(run_id, "KILLED")]

    # 4. to the end.
    job = launch(CONFIG, *COMMON, **kw)
    assert job.wait() == EXIT_OK, job.output()[-3000:]
    assert recorded() == run_id

    found = runs()
    assert [(r.info.run_id, r.info.status) for r in found] == [(run_id, "FINISHED")]
    history = client.get_metric_history(run_id, "train/loss")
    latest: dict[int, float] = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        latest[m.step] = m.value
    assert sorted(latest) == list(range(1, STEPS + 1))
    assert latest == losses(run_dir)  # each step's last point is the one the finished curve kept
    evals = read_metrics(run_dir, "eval")
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval/loss")} == \
        {s: e["eval/loss"] for s, e in evals.items()}
    counts = {s: sum(m.step == s for m in history) for s in latest}
    print(f"\ntrain/loss points per step (replays > 1): {counts}")
