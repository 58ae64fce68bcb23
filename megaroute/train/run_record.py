"""<run_dir>/mlflow_run.json: which MLflow run a run directory's launches continue.

Rank 0's tracking process writes the record as soon as the run exists; every later launch of the
directory (a resume, a requeue) logs into the same run, so one training run is one MLflow run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from ..config import Config
from .callbacks import METRICS_FILE
from .tracking import MLflowTracker

# The record: {"tracking_uri", "experiment", "run_id"}.
RUN_RECORD = "mlflow_run.json"
# How long rank 0 waits before step 1 for the MLflow run to be created or found (a store that cannot be
# reached ends the wait at its first failed attempt: training proceeds, the run follows when it can).
RUN_START_TIMEOUT = 120.0


def read_run_record(path: str) -> dict:
    try:
        with open(path) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def tracked_run(cfg: Config, uri: str, resumed_step: int, checkpoint_run_id: Optional[str]) -> tuple[Optional[str], bool]:
    """The MLflow run this launch continues -> (run id or None, whether to look it up by name and tags).

    `checkpoint.resume=none` is a fresh training run: a new MLflow run, whose id replaces the record.
    Otherwise the run directory's record (when made for the same tracking URI and experiment), else the
    id saved in the resumed checkpoint (run directories from before the record), else, if the directory
    has history (a checkpoint resumed, or metrics logged by an earlier launch), the tracking process
    looks for the run by name and tags (the record was never written: a store unreachable all along)."""
    if cfg.checkpoint.resume == "none":
        return None, False
    path = os.path.join(cfg.run_dir, RUN_RECORD)
    record = read_run_record(path)
    if record.get("run_id"):
        if record.get("tracking_uri") == uri and record.get("experiment") == cfg.tracking.experiment:
            return str(record["run_id"]), False
        print(f"note: {path} names MLflow run {record['run_id']} of experiment {record.get('experiment')!r} at "
              f"{record.get('tracking_uri')}; this launch logs to experiment {cfg.tracking.experiment!r} at {uri}, "
              "in a new run", flush=True)
        return None, False
    if checkpoint_run_id:
        return checkpoint_run_id, False
    return None, resumed_step > 0 or os.path.exists(os.path.join(cfg.run_dir, METRICS_FILE))


def await_run(cfg: Config, tracker: MLflowTracker) -> None:
    """Before step 1: the MLflow run exists and its id is in <run_dir>/mlflow_run.json, or a warning says
    why not (training proceeds either way)."""
    if tracker.wait_for_run(RUN_START_TIMEOUT):
        print(f"MLflow run {tracker.run_id} at {tracker.uri} (experiment {cfg.tracking.experiment!r})", flush=True)
    else:
        why = tracker.last_error or f"no answer within {RUN_START_TIMEOUT:g}s"
        print(f"warning: MLflow run not opened before training ({why}); training proceeds, and "
              f"{os.path.join(cfg.run_dir, RUN_RECORD)} is written when it is", file=sys.stderr, flush=True)
