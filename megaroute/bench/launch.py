"""Training runs for the benchmarks that train through the real launcher (bench.routing, bench.moe,
bench.convert): one `launcher/pretrain.py` subprocess per run, a retrained run's earlier outputs
cleared, and the run's last metrics records."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from ..train.callbacks import METRICS_FILE
from ..train.checkpoint import CHECKPOINTS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_launcher(config: str, overrides: list[str], log: str, threads: int, label: str) -> None:
    """Runs launcher/pretrain.py on `config` with `overrides`, output to `log`, `threads` OpenMP threads;
    exits naming `label` and the log when the run fails."""
    cmd = [sys.executable, os.path.join(REPO, "launcher/pretrain.py"), "--config", config, *overrides]
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)})
    if rc != 0:
        raise SystemExit(f"{label} failed (exit {rc}); see {log}")


def clear_run(run_dir: str) -> None:
    """Removes what an earlier training of this benchmark run left that a fresh one would mix with: its
    metrics.jsonl (a run appends to it) and its checkpoints (a restart, checkpoint.resume=none, would set
    them aside, one copy per rerun). The benchmarks own these run directories."""
    metrics = os.path.join(run_dir, METRICS_FILE)
    if os.path.exists(metrics):
        os.remove(metrics)
    shutil.rmtree(os.path.join(run_dir, CHECKPOINTS), ignore_errors=True)


def last_records(run_dir: str) -> dict[str, dict]:
    """The last record of each kind ("train", "eval", ...) in a run's metrics.jsonl."""
    last = {}
    with open(os.path.join(run_dir, METRICS_FILE)) as f:
        for line in f:
            record = json.loads(line)
            last[record["kind"]] = record
    return last
