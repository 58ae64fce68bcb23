"""slurm/pretrain.sh and slurm/isoflop_sweep.sh on a real two-node Slurm cluster (this machine).

The module starts munged, slurmctld and `slurmd -N node1/node2` (tests/integration/slurm_cluster.py)
and a real `mlflow server` on 127.0.0.1, submits jobs with sbatch exactly as a user would, and
stops everything afterwards. Each node offers one CPU, so two array tasks run at a time.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from .conftest import FAST, REPO, read_metrics, wait_for
from .mlflow_server import MlflowServer
from .slurm_cluster import SlurmCluster, ensure_installed, slurm_available

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        if not slurm_available():
            pytest.skip("needs Slurm (slurm-wlm, munge) or root to install it")
        pytest.skip("slurmd must run as root to start job steps")
    ensure_installed()
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def job_env():
    """What a user's shell would have: the interpreter and this checkout, CPU-only DeepSpeed."""
    return {"PYTHON": sys.executable, "PYTHONPATH": str(REPO), "MEGAROUTE_REPO": str(REPO), "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}


def _client(server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(server.uri)


def _pretrain_args(tmp: Path, char_data: str, server, name: str, *overrides: str) -> list[str]:
    return ["slurm/pretrain.sh", "--gpu", "cpu", "--config", "configs/tiny_mod.yaml", f"name={name}",
            f"runs_dir={tmp}/runs", f"data.output_dir={char_data}", f"tracking.uri={server.uri}",
            "tracking.experiment=slurm-tests", *FAST, *overrides]


def _finished(cluster, job_id) -> dict:
    info = cluster.job(job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, cluster.logs())
    return info


def test_two_node_pretrain(cluster, mlflow_server, job_env, char_data, tmp_path):
    args = _pretrain_args(tmp_path, char_data, mlflow_server, "two_nodes", "train.max_steps=6")
    job = cluster.sbatch(["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={tmp_path}/%j.out",
                          *args], cwd=REPO, env=job_env)
    cluster.wait_done([job], timeout=240)
    out = (tmp_path / f"{job}.out").read_text()
    info = cluster.job(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out + cluster.logs()
    assert "master 127.0.0.1:" in out and "node[1-2]" in out, out

    logs = tmp_path / "runs/two_nodes/logs"
    rank_logs = {p.name: p.read_text() for p in logs.glob(f"{job}-r0-rank*.log")}
    assert sorted(rank_logs) == [f"{job}-r0-rank0.log", f"{job}-r0-rank1.log"], (sorted(rank_logs), out)
    assert "step 6" in rank_logs[f"{job}-r0-rank0.log"] or "6/6" in rank_logs[f"{job}-r0-rank0.log"], rank_logs
    assert sorted(read_metrics(tmp_path / "runs/two_nodes")) == list(range(1, 7))

    runs = _client(mlflow_server).search_runs(
        [_client(mlflow_server).get_experiment_by_name("slurm-tests").experiment_id], "attributes.run_name = 'two_nodes'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    tags = runs[0].data.tags
    assert tags["world_size"] == "2" and tags["slurm_job_id"] == str(job), tags


# usr1: what `--signal=B:USR1@300` does five minutes before the time limit (the batch shell only;
# pretrain.sh requeues). requeue: `scontrol requeue` (SIGTERM to everything; Slurm requeues, the
# script must not requeue again).
@pytest.mark.parametrize("stop", ["usr1", "requeue"])
def test_preempted_job_checkpoints_requeues_and_resumes(cluster, mlflow_server, job_env, char_data, tmp_path, stop):
    steps = 100  # ~10 s of training: the signal lands after step 20, the resumed run finishes the rest
    args = _pretrain_args(tmp_path, char_data, mlflow_server, "preempt", f"train.max_steps={steps}",
                          "checkpoint.interval=100000", "train.log_interval=50")
    job = cluster.sbatch(["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={tmp_path}/%j.out",
                          *args], cwd=REPO, env=job_env)
    run_dir = tmp_path / "runs/preempt"
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 20, timeout=180)
    if stop == "usr1":
        cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
    else:
        cluster.run(["scontrol", "requeue", str(job)])
    # slurmctld holds a requeued job back (its begin time moves about two minutes ahead, against
    # requeue loops); release it sooner so the test times our checkpoint/resume, not that hold.
    # Not at once: slurmd revokes the killed run's credentials with one-second resolution, and a
    # relaunch within that second is refused ("Job credential revoked").
    wait_for(lambda: (lambda j: j.get("Restarts") == "1" and j.get("JobState") == "PENDING")(cluster.job(job)),
             timeout=180)
    cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"])
    cluster.wait_done([job], timeout=400)

    out = (tmp_path / f"{job}.out").read_text()
    info = cluster.job(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out + cluster.logs()
    assert info["Restarts"] == "1", info
    assert "forwarding to the ranks" in out, out
    if stop == "usr1":
        assert "got SIGUSR1" in out and f"requeueing job {job}" in out, out
    else:
        assert "got SIGTERM" in out and "not requeueing" in out and f"requeueing job {job}" not in out, out

    first = (run_dir / "logs" / f"{job}-r0-rank0.log").read_text()
    second = (run_dir / "logs" / f"{job}-r1-rank0.log").read_text()
    m = re.search(r"training stopped at step (\d+): signal", first)
    assert m and 20 <= int(m.group(1)) < steps, first
    stopped_at = int(m.group(1))
    assert (run_dir / "checkpoints" / f"step_{stopped_at:08d}").is_dir()
    assert "resumed from" in second and f"at step {stopped_at}" in second, second
    assert (run_dir / "logs" / f"{job}-r1-rank1.log").exists()
    # Every step is logged once: the stop checkpointed the last completed step, so none is lost or redone.
    assert sorted(read_metrics(run_dir)) == list(range(1, steps + 1))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([x for x in lines if x["kind"] == "train"]) == steps


def test_scancel_checkpoints_and_cancels_without_requeue(cluster, mlflow_server, job_env, char_data, tmp_path):
    """A plain `scancel` (SIGTERM to the steps and the batch shell, SIGKILL after KillWait) ends the
    job: the ranks checkpoint the step they are at, and nothing requeues it."""
    args = _pretrain_args(tmp_path, char_data, mlflow_server, "cancel", "train.max_steps=100000",
                          "checkpoint.interval=100000", "train.log_interval=50")
    job = cluster.sbatch(["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={tmp_path}/%j.out",
                          *args], cwd=REPO, env=job_env)
    run_dir = tmp_path / "runs/cancel"
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 10, timeout=180)
    cluster.run(["scancel", str(job)])
    # Done means out of squeue; a requeued job would come back PENDING with Restarts=1 instead.
    wait_for(lambda: cluster.job(job).get("Restarts") != "0" or not any(
        line.split()[0] == str(job) for line in cluster.squeue()), timeout=120, interval=0.5)
    time.sleep(3)  # a late `scontrol requeue` from the batch script would land within this

    out = (tmp_path / f"{job}.out").read_text()
    info = cluster.job(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, out, cluster.logs())
    assert "got SIGTERM" in out and "not requeueing" in out and f"requeueing job {job}" not in out, out
    assert not (run_dir / "logs" / f"{job}-r1-rank0.log").exists()
    first = (run_dir / "logs" / f"{job}-r0-rank0.log").read_text()
    m = re.search(r"training stopped at step (\d+): signal", first)
    assert m and int(m.group(1)) >= 10, first
    stopped_at = int(m.group(1))
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{stopped_at:08d}"
    runs = _client(mlflow_server).search_runs(
        [_client(mlflow_server).get_experiment_by_name("slurm-tests").experiment_id], "attributes.run_name = 'cancel'")
    assert len(runs) == 1 and runs[0].info.status == "KILLED", runs


def test_sweep_plan_budgets_within_one_percent():
    from megaroute.sweep.plan import plan
    from megaroute.sweep.spec import load_spec

    for name in ("isoflop.yaml", "tiny.yaml"):
        points = plan(load_spec(str(REPO / "configs/sweeps" / name)))
        assert points
        for p in points:
            assert abs(p.tokens * p.flops_per_token / p.budget - 1) <= 0.01, p


def test_isoflop_sweep_array(cluster, mlflow_server, job_env, char_data, tmp_path):
    from megaroute.sweep.plan import plan
    from megaroute.sweep.spec import load_spec

    # The shipped tiny spec at its smaller budget only (5 sizes x dense/MoD, one seed): the whole
    # pipeline at a fifth of the compute; `sweep run --local` runs the full spec (README).
    text = (REPO / "configs/sweeps/tiny.yaml").read_text()
    assert "budgets: [5.0e10, 2.0e11]" in text
    spec = tmp_path / "tiny_one_budget.yaml"
    spec.write_text(text.replace("budgets: [5.0e10, 2.0e11]", "budgets: [5.0e10]")
                    .replace("config: ../tiny", f"config: {REPO}/configs/tiny"))
    spec = str(spec)
    overrides = [f"runs_dir={tmp_path}/runs", f"data.output_dir={char_data}", f"tracking.uri={mlflow_server.uri}"]
    points = plan(load_spec(spec), tuple(overrides))
    n = len(points)
    t0 = time.time()
    submitter = cluster.sbatch([f"--output={tmp_path}/submit-%j.out", "slurm/isoflop_sweep.sh", spec, *overrides],
                               cwd=REPO, env=job_env)
    cluster.wait_done([submitter], timeout=120)
    out = (tmp_path / f"submit-{submitter}.out").read_text()
    m = re.search(rf"{n} points as array job (\d+), analysis job (\d+), MLflow parent run (\w+)", out)
    assert m, out + cluster.logs()
    array_id, analysis_id, parent = m.groups()
    try:
        cluster.wait_done([int(array_id), int(analysis_id)], timeout=900)  # ~5M tokens on 2 one-CPU nodes
    finally:  # the array's batch logs land in the submit directory (the checkout), like a user's would
        for f in REPO.glob(f"slurm-tiny-isoflop-{array_id}_*.out"):
            f.unlink()
    wall = time.time() - t0

    tasks = cluster.jobs(array_id)
    assert sorted(int(t["ArrayTaskId"]) for t in tasks) == list(range(n))
    assert all(t["JobState"] == "COMPLETED" and t["ExitCode"] == "0:0" for t in tasks), (tasks, cluster.logs())
    analysis = cluster.job(analysis_id)
    analysis_dir = tmp_path / "runs/analysis"
    assert analysis["JobState"] == "COMPLETED", (sorted(analysis_dir.glob("*")), cluster.logs())

    client = _client(mlflow_server)
    exp = client.get_experiment_by_name("tiny-isoflop")
    runs = client.search_runs([exp.experiment_id], "tags.sweep_id = 'tiny-isoflop'")
    children = [r for r in runs if r.info.run_id != parent and r.data.tags.get("sweep_role") != "analysis"]
    assert len(children) == n and all(r.info.status == "FINISHED" for r in children)
    by_name = {p.run_name: p for p in points}
    for r in children:
        t, p = r.data.tags, by_name[r.info.run_name]
        assert t["mlflow.parentRunId"] == parent and t["slurm_array_job_id"] == array_id
        assert (t["variant"], t["size"], t["seed"], t["lr_mult"]) == (p.variant, p.size, "0", "1")
        assert t["budget"] == f"{p.budget:.6g}" and "eval/loss" in r.data.metrics
        assert r.data.params["optim.warmup_steps"] == str(p.warmup_steps)  # the design's per-run warm-up
    assert len({(r.data.tags["variant"], r.data.tags["size"], r.data.tags["budget"]) for r in children}) == n

    # The analysis job wrote its own folder and child run, then ended the parent.
    (out,) = analysis_dir.glob("eval-*")
    table = (out / "isoflop_table.md").read_text()
    budgets = "|".join(re.escape(f"{b:.3g}") for b in {p.budget for p in points})
    for variant in ("dense", "mod"):
        assert len(re.findall(rf"^\| {variant} \| ({budgets}) \|", table, re.M)) == 1, table
    assert "Compute-optimal frontier" in table
    assert (out / "isoflop_table.csv").read_text().count("\n") == 3
    for png in ("isoflop_curves.png", "isoflop_frontier.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    (analysis_run,) = [r for r in runs if r.data.tags.get("sweep_role") == "analysis"]
    assert analysis_run.data.tags["mlflow.parentRunId"] == parent and analysis_run.info.status == "FINISHED"
    logged = {a.path for a in client.list_artifacts(analysis_run.info.run_id)}
    assert {"isoflop_table.md", "isoflop_curves.png", "isoflop_frontier.png"} <= logged
    parent_run = client.get_run(parent)
    assert parent_run.info.status == "FINISHED" and parent_run.data.tags["points_failed"] == "0"

    _report_benchmark(tasks, tmp_path / "runs", wall, tmp_path)


def _report_benchmark(tasks: list[dict], runs: Path, wall: float, tmp_path: Path) -> None:
    """Sweep wall time, and per task: Slurm's dispatch gap and the time outside the training loop."""
    from datetime import datetime

    def ts(s: str) -> float:
        return datetime.fromisoformat(s).timestamp()

    by_node: dict[str, list[tuple[float, float]]] = {}
    for t in tasks:
        by_node.setdefault(t["NodeList"], []).append((ts(t["StartTime"]), ts(t["EndTime"])))
    gaps = [b[0] - a[1] for spans in by_node.values() for a, b in zip(sorted(spans), sorted(spans)[1:])]
    train_times = []
    for metrics in runs.glob("tiny-isoflop-*/metrics.jsonl"):
        times = [json.loads(x)["time"] for x in metrics.read_text().splitlines()]
        train_times.append(max(times) - min(times))
    task_times = [e - s for spans in by_node.values() for s, e in spans]
    figures = {
        "sweep_wall_s": round(wall, 1),
        "tasks": len(tasks),
        "mean_task_wall_s": round(sum(task_times) / len(task_times), 1),
        "mean_training_loop_s": round(sum(train_times) / len(train_times), 1),
        "mean_dispatch_gap_s": round(sum(gaps) / len(gaps), 2) if gaps else None,
        "per_task_overhead_s": round(sum(task_times) / len(task_times) - sum(train_times) / len(train_times), 1),
    }
    (tmp_path / "benchmark.json").write_text(json.dumps(figures))
    print(f"\nisoFLOP tiny sweep benchmark: {figures}")
