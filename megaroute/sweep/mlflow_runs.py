"""A sweep's MLflow runs: opening and ending its parent run, reading back the point runs, and one
child run per analysis.

Layout in the experiment, all tagged sweep_id=<sweep>:
    parent run      sweep_role=parent; RUNNING while the sweep runs, ended by `finish_parent`
    point runs      children of the parent, tagged variant/size/budget/seed/n_params (no sweep_role)
    analysis runs   children of the parent, sweep_role=analysis, metric=<eval|topk>, one per
                    `sweep analyze`, named analysis-<metric>-<UTC time>: results are never overwritten

Training runs log through megaroute.train.tracking (a child process that never blocks
training). This module is for short-lived CLI commands, so it uses MlflowClient directly.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Optional

from .. import metric_names as names
from ..config import ConfigError
from ..train.mlflow_writer import filter_literal, sqlite_file
from .plan import ROLE_PARENT, TAG_ROLE, TAG_SWEEP

ROLE_ANALYSIS = "analysis"
TAG_METRIC = "metric"            # analysis runs: the --metric choice (eval | topk)
TAG_LOSS_KEYS = "loss_metrics"   # analysis runs: the metric keys read, in order of preference
from .spec import SweepSpecError


def _client(uri: str):
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


SQLITE_HEADER = b"SQLite format 3\x00"


def require_store(uri: str) -> str:
    """For commands that only read a store (compare, audit, sweep analyze): a sqlite:/// URI must name an
    existing SQLite file. MLflow would create a missing one (and its directory) and then report the
    experiment missing, or fail deep in SQLAlchemy on a directory or a text file. Raises ConfigError
    naming the path; other URIs pass unchecked. Stores that training or `sweep run` may create are
    opened through `_client` directly."""
    path = sqlite_file(uri)
    if path is None:
        return uri
    if not os.path.exists(path):
        problem = "does not exist"
    elif os.path.isdir(path):
        problem = "is a directory, not an SQLite database"
    else:
        try:
            with open(path, "rb") as f:
                problem = None if f.read(len(SQLITE_HEADER)) == SQLITE_HEADER else "is not an SQLite database"
        except OSError as e:
            problem = f"cannot be read ({e.strerror})"
    if problem:
        raise ConfigError("", f"MLflow tracking store {path} (tracking URI {uri}) {problem}")
    return uri


def _reader(uri: str):
    """A client for a store that must already exist (`require_store`)."""
    return _client(require_store(uri))


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


def sweep_filter(sweep: str) -> str:
    """The search-filter clause that matches the sweep's runs (its tag); LookupError for a name holding
    both quote characters, which no literal of MLflow's filter language can name."""
    literal = filter_literal(sweep)
    if literal is None:
        raise LookupError(f"sweep name {sweep!r} holds both quote characters, which MLflow's search cannot match")
    return f"tags.{TAG_SWEEP} = {literal}"


def find_parent_run(client, exp_id: str, sweep: str) -> Optional[str]:
    runs = client.search_runs([exp_id], f"{sweep_filter(sweep)} and tags.{TAG_ROLE} = '{ROLE_PARENT}'",
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
    elif client.get_run(run_id).info.status != "RUNNING":  # resubmitted after it was finished
        client.update_run(run_id, status="RUNNING")
    return run_id


def start_analysis_run(uri: str, experiment: str, sweep: str, parent: Optional[str], metric: str,
                       loss_keys: tuple[str, ...], stamp: str) -> str:
    """A new child run of the sweep's parent (a top-level run when there is none) for one analysis:
    named analysis-<metric>-<stamp>, tagged sweep_id, sweep_role=analysis, metric, loss_metrics."""
    client = _client(uri)
    exp_id = experiment_id(client, experiment)
    tags = {TAG_SWEEP: sweep, TAG_ROLE: ROLE_ANALYSIS, TAG_METRIC: metric, TAG_LOSS_KEYS: ",".join(loss_keys)}
    if parent is not None:
        tags["mlflow.parentRunId"] = parent
    return client.create_run(exp_id, run_name=f"analysis-{metric}-{stamp}", tags=tags).info.run_id


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    client = _client(uri)
    for k, v in tags.items():
        client.set_tag(run_id, k, v)


def end_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    _client(uri).set_terminated(run_id, status)


def finish_parent(uri: str, experiment: str, sweep: str, status: str = "FINISHED",
                  tags: Optional[dict[str, str]] = None) -> Optional[str]:
    """Ends the sweep's parent run with `status` (FINISHED, FAILED, KILLED) and tags it with the
    points' outcome: points_finished / points_failed (runs in any other state: FAILED, KILLED, or
    still RUNNING when their task died) / points_missing (planned, param `points`, without a run)
    and points_runs. Returns the parent run id, None when the sweep has no parent run.

    The Slurm analysis job calls it (`sweep analyze --finish-parent`) with FINISHED when the
    analysis ran, whatever the points did (their counts are in the tags and the analysis table lists
    every run left out), FAILED when the analysis itself failed. A later resubmission reopens it."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"MLflow experiment {experiment!r} not found at {uri}")
    parent = find_parent_run(client, exp.experiment_id, sweep)
    if parent is None:
        return None
    _, points = sweep_runs(uri, experiment, sweep)
    finished = sum(p.status == "FINISHED" for p in points)
    counts = {"points_runs": len(points), "points_finished": finished, "points_failed": len(points) - finished}
    planned = client.get_run(parent).data.params.get("points")
    if planned is not None and planned.isdigit():
        counts["points_missing"] = max(0, int(planned) - len(points))
    for k, v in {**{k: str(v) for k, v in counts.items()}, **(tags or {})}.items():
        client.set_tag(parent, k, v)
    client.set_terminated(parent, status)
    return parent


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
    n_params: int                    # total parameters; ACTIVE ones in a `hold: active_params` sweep (its axis)
    status: str
    val_loss: Optional[float]
    loss_key: Optional[str] = None   # which of the requested metrics val_loss is
    routing: Optional[str] = None    # the run's routing method (tag "routing"; "none" = dense)
    lr_mult: float = 1.0             # the point's learning-rate multiplier (tag lr_mult; sweeps with lr_sweep)
    hold: str = "flops"              # what the sweep held equal across variants (tag hold; spec key `hold`)


# Loss metrics in order of preference per run (megaroute.metric_names). `sweep analyze` reads eval/loss
# (autoregressive, at the executed compute) unless asked for the training-mode figure: top-k routing
# (sees future tokens), halting's soft gates; dense has only eval/loss.
HONEST_LOSS = (names.LOSS,)
TOPK_LOSS = (names.TOPK_LOSS, "val/loss_soft", names.LOSS)


def sweep_runs(uri: str, experiment: str, sweep: str,
               metrics: tuple[str, ...] = HONEST_LOSS) -> tuple[Optional[str], list[RunResult]]:
    """(parent run id, point runs) of one sweep. Each run's loss is the last logged value of the first
    of `metrics` it has."""
    client = _reader(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"MLflow experiment {experiment!r} not found at {uri}")
    runs = search_all(client, exp.experiment_id, sweep_filter(sweep))
    parents = sorted((r for r in runs if r.data.tags.get(TAG_ROLE) == ROLE_PARENT), key=lambda r: r.info.start_time)
    parent = parents[0].info.run_id if parents else None  # the one find_parent_run opens
    results = []
    for r in runs:
        t = r.data.tags
        if t.get(TAG_ROLE):  # the parent, analysis runs: not points
            continue
        key = next((m for m in metrics if m in r.data.metrics), None)
        hold = t.get("hold", "flops")
        results.append(RunResult(r.info.run_id, r.info.run_name, t["variant"], t["size"], float(t["budget"]),
                                 int(t["seed"]), int(t["active_params" if hold == "active_params" else "n_params"]),
                                 r.info.status, r.data.metrics[key] if key else None, key, t.get("routing"),
                                 float(t.get("lr_mult") or 1.0), hold))
    return parent, results


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """A run's metric history; the run comes from find_runs, which has already checked the store."""
    return sorted((m.step, m.value) for m in _client(uri).get_metric_history(run_id, key))


def find_runs(uri: str, experiment: str, names_or_ids: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(run id, run name) for each requested run name or id, in the order given, and a note for each
    name that several runs share: the latest started of them is taken (a restart with
    checkpoint.resume=none, or `make demo` run again, starts a new run under the same name), and the
    note names it and the others' ids, so that a plot of another is one id away. Each key is looked
    up by itself (the store filters), so an experiment's size sets no limit."""
    client = _reader(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"MLflow experiment {experiment!r} not found at {uri}")
    out, notes = [], []
    for key in names_or_ids:
        by_id = [r.info for r in search_all(client, exp.experiment_id, f"attributes.run_id = '{key}'")] \
            if re.fullmatch(r"[0-9a-f]{32}", key) else []
        if by_id:
            out.append((key, by_id[0].run_name))
            continue
        name = filter_literal(key)  # None: both quotes, which no filter can name
        named = [] if name is None else sorted(
            (r.info for r in search_all(client, exp.experiment_id, f"attributes.run_name = {name}")),
            key=lambda info: info.start_time or 0, reverse=True)
        if not named:
            raise LookupError(f"no run named {key!r} (nor with that id) in experiment {experiment!r}")
        latest, *others = named
        out.append((latest.run_id, key))
        if others:
            notes.append(f"{len(named)} runs in {experiment!r} are named {key!r}: taking the latest started, "
                         f"{latest.run_id} ({_started(latest)}); pass an id for another: "
                         + ", ".join(f"{o.run_id} ({_started(o)})" for o in others))
    return out, notes


def search_all(client, experiment_id: str, filter_string: str = "") -> list:
    """Every run of the experiment that filter_string matches (all of them for ""), page by page."""
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _started(info) -> str:
    return time.strftime("started %Y-%m-%d %H:%M:%S", time.localtime(info.start_time / 1000)) \
        if info.start_time else "start time unknown"
