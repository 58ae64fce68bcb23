"""One MLflow run per training run: the run directory's record (<run_dir>/mlflow_run.json), the
look-up by name and tags of a run whose record was never written, the points re-sent on resume,
the lock that orders a killed job's tracking process before the relaunched one, and which run a
launch continues (`run_record.tracked_run`).

The writer runs in this process (`MLflowWriter`, what the tracking process runs), against one
SQLite store per module; `MLflowTracker.wait_for_run` is tested against a port nobody listens on.
The end-to-end case (kill -9, exit 75, relaunches, one FINISHED run) is
tests/integration/test_mlflow_resume.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

import pytest

import megaroute.train.mlflow_writer as mlflow_writer
from megaroute.config import load_config
from megaroute.train.mlflow_writer import MLflowWriter
from megaroute.train.run_record import RUN_RECORD, tracked_run as _tracked_run
from megaroute.train.tracking import MLflowTracker

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_record")
    uri = f"sqlite:///{root}/mlflow.db"
    mlflow_writer.create_sqlite_store(uri)
    return uri, root


def writer(uri, root, name, tags=None, **kw) -> MLflowWriter:
    return MLflowWriter(uri, "record", name, {"model.d_model": 64}, tags or {}, str(root / "artifacts"), **kw)


def finish(w: MLflowWriter, status: str = "FINISHED") -> str:
    assert w.close(status, timeout=60) is True, w.last_error
    return w.run_id


def test_new_run_is_recorded_with_its_identity_tags(store, tmp_path):
    uri, root = store
    record = tmp_path / RUN_RECORD
    tags = {"run_dir": str(tmp_path), "sweep_id": "sw1", "variant": "mod"}
    w = writer(uri, root, "rec", tags, record_path=str(record))
    run_id = finish(w)
    assert json.loads(record.read_text()) == {"tracking_uri": uri, "experiment": "record",
                                              "experiment_id": MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id,
                                              "run_id": run_id, "run_name": "rec"}
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []  # written aside, then renamed
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.data.tags["run_dir"] == str(tmp_path) and run.data.tags["sweep_id"] == "sw1"


def test_continued_run_goes_back_to_running_and_is_recorded(store, tmp_path):
    uri, root = store
    first = finish(writer(uri, root, "cont"), "KILLED")
    w = writer(uri, root, "cont", run_id=first, record_path=str(tmp_path / RUN_RECORD))
    deadline = time.monotonic() + 60
    while not w.ready:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert MlflowClient(tracking_uri=uri).get_run(first).info.status == "RUNNING"
    assert json.loads((tmp_path / RUN_RECORD).read_text())["run_id"] == first
    assert finish(w) == first


def test_lost_record_finds_the_run_by_name_and_tags(store, tmp_path):
    uri, root = store
    client = MlflowClient(tracking_uri=uri)
    here, elsewhere = str(tmp_path / "a"), str(tmp_path / "b")
    older = finish(writer(uri, root, "lost", {"run_dir": here, "sweep_id": "s"}), "KILLED")
    mine = finish(writer(uri, root, "lost", {"run_dir": here, "sweep_id": "s"}), "KILLED")  # newest wins
    finish(writer(uri, root, "lost", {"run_dir": elsewhere, "sweep_id": "s"}))   # another run directory
    finish(writer(uri, root, "lost", {"run_dir": here, "sweep_id": "other"}))   # another sweep
    finish(writer(uri, root, "lost", {"run_dir": here}))                        # not a sweep point
    finish(writer(uri, root, "lost", {"run_dir": here, "sweep_id": "s", "sweep_role": "parent"}))
    assert older != mine

    w = writer(uri, root, "lost", {"run_dir": here, "sweep_id": "s"}, find_existing=True,
               record_path=str(tmp_path / RUN_RECORD))
    assert finish(w) == mine
    assert client.get_run(mine).info.status == "FINISHED"
    assert json.loads((tmp_path / RUN_RECORD).read_text())["run_id"] == mine

    # Without find_existing (a fresh run directory), or nothing matching: a new run.
    assert finish(writer(uri, root, "lost", {"run_dir": here, "sweep_id": "s"})) != mine
    assert finish(writer(uri, root, "lost", {"run_dir": str(tmp_path / "c")}, find_existing=True)) != mine


def test_backfill_sends_the_checkpointed_steps_the_run_lacks(store, tmp_path):
    """Steps 1-2 reached the store, 3-8 were logged to metrics.jsonl only (the tracking process was
    killed with them), the job resumed at step 6: steps 3-6 are re-sent (train every 2 steps: 4, 6),
    with their timestamps; 7-8 are left to the replay. A replayed step keeps its last record."""
    uri, root = store
    client = MlflowClient(tracking_uri=uri)
    first = writer(uri, root, "backfill")
    for step in (2,):
        first.put("metrics", ({"train/loss": 10.0 + step}, step, 1000))
    run_id = finish(first, "KILLED")
    lines = []
    for step in range(1, 9):
        lines.append({"kind": "train", "step": step, "time": 100.0 + step, "train/loss": 10.0 + step,
                      "train/lr": 0.1, "perf/mfu": float("nan")})
    lines.insert(3, {"kind": "train", "step": 4, "time": 50.0, "train/loss": -1.0})  # replaced by the later one
    lines.append({"kind": "eval", "step": 6, "time": 106.5, "eval/loss": 3.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "st')  # a cut last line

    w = writer(uri, root, "backfill", run_id=run_id, backfill=(str(path), 6, 2, 8))
    finish(w)
    history = {m.step: (m.value, m.timestamp) for m in client.get_metric_history(run_id, "train/loss")}
    assert history == {2: (12.0, 1000), 4: (14.0, 104000), 6: (16.0, 106000)}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/loss")] == [(6, 3.0)]
    assert "perf/mfu" not in client.get_run(run_id).data.metrics  # non-finite: never logged


def test_writer_waits_for_a_killed_jobs_tracking_process(store, tmp_path, monkeypatch):
    """The tracking process of a killed job holds <record>.lock until it has marked the run FAILED: a
    relaunched job's writer touches the run only after that (or after LOCK_WAIT_SECONDS)."""
    uri, root = store
    record = tmp_path / RUN_RECORD
    fd = os.open(str(record) + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        w = writer(uri, root, "locked", record_path=str(record))
        time.sleep(1.0)
        assert not w.ready and not record.exists()
    finally:
        os.close(fd)
    finish(w)
    assert record.exists()

    monkeypatch.setattr(mlflow_writer, "LOCK_WAIT_SECONDS", 0.3)  # a holder that never lets go
    fd = os.open(str(record) + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        finish(writer(uri, root, "locked", record_path=str(record)))
    finally:
        os.close(fd)


def test_wait_for_run_returns_at_once_when_the_store_is_unreachable(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    tracker = MLflowTracker(uri, "record", "down", {}, {}, str(tmp_path), record_path=str(tmp_path / RUN_RECORD),
                            retry_seconds=30.0)
    try:
        t0 = time.monotonic()
        assert tracker.wait_for_run(300) is False
        assert time.monotonic() - t0 < 120  # the first failed attempt, not the timeout
        assert tracker.failures >= 1 and not tracker.ready
    finally:
        assert tracker.close(timeout=5) is False
    assert not (tmp_path / RUN_RECORD).exists()


def _cfg(tmp_path, *overrides):
    return load_config(os.path.join(REPO, "configs/tiny.yaml"), [f"runs_dir={tmp_path}", "name=r", *overrides])


def test_which_run_a_launch_continues(tmp_path):
    cfg = _cfg(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    os.makedirs(cfg.run_dir)
    # A fresh run directory: a new run, no look-up; a resumed checkpoint's id (older run directories).
    assert _tracked_run(cfg, uri, 0, None) == (None, False)
    assert _tracked_run(cfg, uri, 8, "ckpt") == ("ckpt", False)
    # History but no record (the store was never reached): look the run up.
    assert _tracked_run(cfg, uri, 8, None) == (None, True)
    open(os.path.join(cfg.run_dir, "metrics.jsonl"), "w").close()
    assert _tracked_run(cfg, uri, 0, None) == (None, True)
    # The record wins over the checkpoint; for another store or experiment it is not used.
    record = {"tracking_uri": uri, "experiment": cfg.tracking.experiment, "experiment_id": "1", "run_id": "rec"}
    with open(os.path.join(cfg.run_dir, RUN_RECORD), "w") as f:
        json.dump(record, f)
    assert _tracked_run(cfg, uri, 8, "ckpt") == ("rec", False)
    assert _tracked_run(cfg, "http://elsewhere:5000", 8, "ckpt") == (None, False)
    assert _tracked_run(_cfg(tmp_path, "tracking.experiment=other"), uri, 8, "ckpt") == (None, False)
    # checkpoint.resume=none: a fresh training run in a reused directory is a new MLflow run.
    assert _tracked_run(_cfg(tmp_path, "checkpoint.resume=none"), uri, 0, None) == (None, False)
    with open(os.path.join(cfg.run_dir, RUN_RECORD), "w") as f:
        f.write("{not json")
    assert _tracked_run(cfg, uri, 8, "ckpt") == ("ckpt", False)
