"""A sweep's MLflow runs: opening its parent run, and reading back the finished point runs.

Training runs log through megaroute.train.tracking (a child process that never blocks
training). This module is for short-lived CLI commands, so it uses MlflowClient directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .. import metric_names as names
from .plan import ROLE_PARENT, TAG_ROLE, TAG_SWEEP
from .spec import SweepSpecError


def _client(uri: str):
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def require_server_uri(uri: Optional[str], spec_path: str) -> str:
    """Array tasks write concurrently from many nodes: SQLite on a shared filesystem corrupts."""
    if not uri or not uri.startswith(("http://", "https://", "databricks")):
        raise SweepSpecError(spec_path, "overrides", f"tracking.uri is {uri!r}; a Slurm sweep needs an MLflow "
                             "server (start one with slurm/mlflow_server.sh, then add tracking.uri=http://HOST:PORT)")
    return uri


def experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # created meanwhile by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_parent_run(client, exp_id: str, sweep: str) -> Optional[str]:
    runs = client.search_runs([exp_id], f"tags.{TAG_SWEEP} = '{sweep}' and tags.{TAG_ROLE} = '{ROLE_PARENT}'",
                              max_results=1, order_by=["attributes.start_time ASC"])
    return runs[0].info.run_id if runs else None


def open_parent_run(uri: str, experiment: str, sweep: str, params: dict[str, str]) -> str:
    """The sweep's parent run id; created on first submission, reused by resubmissions."""
    client = _client(uri)
    exp_id = experiment_id(client, experiment)
    run_id = find_parent_run(client, exp_id, sweep)
    if run_id is None:
        run = client.create_run(exp_id, run_name=sweep, tags={TAG_SWEEP: sweep, TAG_ROLE: ROLE_PARENT})
        run_id = run.info.run_id
        for k, v in params.items():
            client.log_param(run_id, k, v)
    return run_id


def log_artifacts(uri: str, run_id: str, paths: list[str], artifact_path: str) -> None:
    client = _client(uri)
    for p in paths:
        client.log_artifact(run_id, p, artifact_path)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    name: str
    variant: str
    size: str
    budget: float
    seed: int
    n_params: int
    status: str
    val_loss: Optional[float]


# Loss metrics in order of preference per run (megaroute.metric_names). `sweep analyze` reads eval/loss
# (autoregressive, at the executed compute) unless asked for the training-mode figure: top-k routing
# (sees future tokens), halting's soft gates; dense has only eval/loss.
HONEST_LOSS = (names.LOSS,)
TOPK_LOSS = (names.TOPK_LOSS, "val/loss_soft", names.LOSS)


def sweep_runs(uri: str, experiment: str, sweep: str,
               metrics: tuple[str, ...] = HONEST_LOSS) -> tuple[Optional[str], list[RunResult]]:
    """(parent run id, point runs) of one sweep. Each run's loss is the last logged value of the first
    of `metrics` it has."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"MLflow experiment {experiment!r} not found at {uri}")
    runs, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], f"tags.{TAG_SWEEP} = '{sweep}'", max_results=1000,
                                  page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            break
    parent = next((r.info.run_id for r in runs if r.data.tags.get(TAG_ROLE) == ROLE_PARENT), None)
    results = []
    for r in runs:
        t = r.data.tags
        if t.get(TAG_ROLE) == ROLE_PARENT:
            continue
        results.append(RunResult(r.info.run_id, r.info.run_name, t["variant"], t["size"], float(t["budget"]),
                                 int(t["seed"]), int(t["n_params"]), r.info.status,
                                 next((r.data.metrics[m] for m in metrics if m in r.data.metrics), None)))
    return parent, results


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in _client(uri).get_metric_history(run_id, key))


def find_runs(uri: str, experiment: str, names_or_ids: list[str]) -> list[tuple[str, str]]:
    """(run id, run name) for each requested run name or id, in the order given."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"MLflow experiment {experiment!r} not found at {uri}")
    by_name: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    for r in client.search_runs([exp.experiment_id], max_results=5000):
        by_name.setdefault(r.info.run_name, []).append(r.info.run_id)
        names[r.info.run_id] = r.info.run_name
    out = []
    for key in names_or_ids:
        if key in names:
            out.append((key, names[key]))
        elif len(by_name.get(key, [])) == 1:
            out.append((by_name[key][0], key))
        elif key in by_name:
            raise LookupError(f"run name {key!r} is ambiguous in {experiment!r} ({len(by_name[key])} runs); "
                              f"pass a run id: {', '.join(by_name[key])}")
        else:
            raise LookupError(f"no run named {key!r} (nor with that id) in experiment {experiment!r}")
    return out
