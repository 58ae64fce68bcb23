"""MLflow tracking of real 2-rank DeepSpeed jobs, read back through the MLflow client.

Three jobs in all (tiny_mod, 6 steps, same seed), each shared by the assertions that need it:
the local SQLite store (the embedded default), a real `mlflow server` on 127.0.0.1, and a
tracking URI whose port nobody listens on. The server boots in the background while the
SQLite and closed-port jobs run. Jobs are started by conftest's `start_job` (its default
launcher), with conftest's FAST overrides.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from megaroute.config import flatten, load_config
from megaroute.flops import config_flops, training_proxy
from megaroute.train.run import data_fingerprint

from .conftest import Job, losses, read_metrics, start_job, wait_for
from .mlflow_server import MARKER, MlflowServer
from .ports import free_port

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

CONFIG = "configs/tiny_mod.yaml"
STEPS = 6
COMMON = (f"train.max_steps={STEPS}", "checkpoint.interval=1000")


@dataclass
class Run:
    name: str
    dir: Path
    job: Job
    seconds: float


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow_jobs")


@pytest.fixture(scope="module")
def run_job(workdir, char_data):
    """Module-scoped variant of `launch`: run_job(name, *overrides) -> Run, after the job exited 0."""
    jobs: list[Job] = []

    def run(name: str, *overrides: str, nice: int = 0) -> Run:
        t0 = time.monotonic()
        job = start_job(workdir, char_data, CONFIG, *COMMON, *overrides, name=name)
        jobs.append(job)
        if nice:  # the launcher and whatever it started already; ranks started later inherit it
            launcher = psutil.Process(job.proc.pid)
            for p in [launcher, *launcher.children(recursive=True)]:
                try:
                    p.nice(nice)
                except psutil.NoSuchProcess:
                    pass
        rc = job.wait(timeout=900)
        seconds = time.monotonic() - t0
        print(f"\njob {name}: exit {rc} in {seconds:.1f}s")
        assert rc == 0, job.output()[-4000:]
        return Run(name, workdir / "runs" / name, job, seconds)

    yield run
    for job in jobs:
        if job.proc.poll() is None:
            job.kill()


@pytest.fixture(scope="module", autouse=True)
def _server(request, tmp_path_factory):
    """Starts the server early (without waiting) if any selected test needs it; stops it at the end."""
    if not any("mlflow_server" in item.fixturenames for item in request.session.items
               if item.module is request.module):
        yield None
        return
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server")).start()
    server.started = time.monotonic()
    try:
        yield server
    finally:
        server.stop()
        assert server.processes() == []


@pytest.fixture(scope="module")
def mlflow_server(_server) -> MlflowServer:
    _server.wait_ready(timeout=600)
    MlflowClient(tracking_uri=_server.uri).search_experiments()  # warm up: the first request can take seconds
    print(f"\nmlflow server healthy at {_server.uri} after {time.monotonic() - _server.started:.1f}s")
    return _server


@pytest.fixture(scope="module")
def sqlite_run(run_job) -> Run:
    return run_job("sqlite")  # start_job's default: tracking.uri=sqlite:///<runs>/mlflow.db


@pytest.fixture(scope="module")
def server_run(run_job, mlflow_server) -> Run:
    # On a real cluster the server has its own machine; here it shares 2 cores with the job (and with
    # whatever else runs), so the job yields to it: the run must be complete within close()'s 30 s.
    return run_job("server", f"tracking.uri={mlflow_server.uri}", nice=5)


def _check_run(client: MlflowClient, run: Run) -> None:
    """Everything issue 4 asks to be tracked, read back through the client."""
    exp = client.get_experiment_by_name("megaroute")
    found = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run.name}'")
    assert len(found) == 1
    r = found[0]
    run_id = r.info.run_id
    assert r.info.status == "FINISHED"

    # Params: the flattened resolved config, every key, and the run's FLOPs accounting.
    cfg = load_config(str(run.dir / "config.yaml"), [])
    flops = config_flops(cfg)
    assert r.data.params == {**{k: str(v) for k, v in flatten(cfg).items()},
                             "flops.train_per_token": str(flops.per_token(training=True)),
                             "flops.inference_per_token": str(flops.per_token(training=False)),
                             "flops.train_proxy_vs_full": str(round(training_proxy(cfg.model, cfg.routing,
                                                                                   cfg.data.seq_len), 4)),
                             "data.prepared_sha256": data_fingerprint(cfg.data.output_dir)}
    assert r.data.params["model.d_model"] == "64" and r.data.params["routing.method"] == "mod"
    assert r.data.params["train.max_steps"] == str(STEPS)

    # Metrics: every logged step, values identical to the run's own metrics file.
    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    train = read_metrics(run.dir)
    assert history("train/loss") == losses(run.dir) and sorted(train) == list(range(1, STEPS + 1))
    for key in ("perf/tokens_per_s", "perf/mfu", "routing/layer_1/selected_frac", "aux/layer_1/router_bce",
                "train/lr", "train/grad_norm", "train/tokens_seen", "train/flops_seen"):
        assert history(key) == {s: m[key] for s, m in train.items()}, key
    assert all(v > 0 for v in history("perf/tokens_per_s").values())
    assert set(history("routing/layer_1/selected_frac").values()) == {0.125}  # k = 8 of 64 tokens
    evals = read_metrics(run.dir, "eval")
    assert history("eval/loss") == {STEPS: evals[STEPS]["eval/loss"]}
    assert "val/loss_topk" in r.data.metrics and "eval/exec_frac" in r.data.metrics
    assert "eval/loss" in r.data.tags["mlflow.note.content"]  # the run description says what it is

    # Tags.
    from megaroute.train.run import _git_commit

    tags = r.data.tags
    assert tags["variant"] == "mod" and tags["size"] == "tiny" and tags["routing"] == "mod"
    assert tags["seed"] == str(cfg.train.seed) and tags["world_size"] == "2"
    assert tags["git_commit"] == _git_commit() and tags["host"] == socket.gethostname()

    # Artifacts: resolved config, DeepSpeed config, tokenizer.
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "ds_config.json", "tokenizer"} <= top, top
    tokenizer = [a.path for a in client.list_artifacts(run_id, "tokenizer")]
    assert tokenizer and all(p.startswith("tokenizer/") for p in tokenizer)
    local = client.download_artifacts(run_id, "config.yaml", str(run.dir / "downloaded"))
    assert Path(local).read_bytes() == (run.dir / "config.yaml").read_bytes()


def test_local_sqlite_store(sqlite_run):
    _check_run(MlflowClient(tracking_uri=f"sqlite:///{sqlite_run.dir.parent}/mlflow.db"), sqlite_run)


def test_unreachable_server_does_not_change_training(run_job, sqlite_run):
    port = free_port()  # bound and released: nothing listens there
    offline = run_job("offline", f"tracking.uri=http://127.0.0.1:{port}")
    assert losses(offline.dir) == losses(sqlite_run.dir)  # exact, every step
    assert sorted(losses(offline.dir)) == list(range(1, STEPS + 1))
    out = offline.job.output()
    assert f"MLflow tracking at http://127.0.0.1:{port} failed" in out
    assert "giving up" in out  # close() did not sit out its timeout at the end
    print(f"\nwall time: sqlite job {sqlite_run.seconds:.1f}s, server-down job {offline.seconds:.1f}s")


def test_real_mlflow_server(server_run, mlflow_server, sqlite_run):
    _check_run(MlflowClient(tracking_uri=mlflow_server.uri), server_run)
    # Artifacts went through the server's proxy into --artifacts-destination.
    assert list(mlflow_server.artifacts.rglob("ds_config.json"))
    assert losses(server_run.dir) == losses(sqlite_run.dir)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_server_stop_leaves_no_process(mlflow_server):
    """Runs last: the teardown kills the group and what escaped it (here a stand-in for a job
    subprocess, started in a session of its own as mlflow's job executor does)."""
    escaped = subprocess.Popen(["sleep", "600"], env={MARKER: mlflow_server.token}, start_new_session=True)
    # Until the child has exec'd, /proc shows the parent's environment, without the marker.
    wait_for(lambda: escaped.pid in [p.pid for p in mlflow_server.processes()], timeout=30)
    pids = [p.pid for p in mlflow_server.processes()]
    assert escaped.pid in pids and len(pids) >= 3  # server, uvicorn, job runner (+ consumers)
    shm = set(mlflow_server._shm_dirs)
    mlflow_server.stop()
    escaped.wait(timeout=10)
    assert mlflow_server.processes() == []
    assert not [pid for pid in pids if _alive(pid)]
    assert not any(Path(d).exists() for d in shm)
    assert not mlflow_server.healthy()
