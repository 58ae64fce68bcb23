"""The MLflow side of tracking: one run written by a worker thread, with bounded buffering and retries.

`MLflowWriter` runs in the tracking process (see `tracking.py`, which feeds it from rank 0 over
a pipe). It creates the run (or continues a resumed one) and sends params, tags and metrics in
batches, one round per `flush_seconds`, then artifacts. When the tracking server is unreachable or
failing it warns once per outage, keeps the data buffered (bounded: the oldest metric points are
dropped first and counted in `dropped_metrics`) and retries with exponential backoff. Errors the
server will never accept (HTTP 4xx such as a param whose value changed on resume, or a resumed run
id the store does not know) are not retried forever: the offending item is skipped with a warning
and everything else still goes through. `close()` keeps its deadline whatever the server does.

One MLflow run per training run: given `record_path` (<run_dir>/mlflow_run.json), the writer saves
the run's tracking URI, experiment and run id there (atomically) as soon as the run is created or
found, so every later launch of that run directory (resume, requeue, relaunch after kill -9)
continues the same run. A run directory without a record (the store was unreachable all along, or
the file was lost) but with history (`find_existing`) looks its run up by experiment, run name,
`sweep_id` tag and `run_dir` tag. `backfill` (metrics.jsonl, resumed step, log interval, last step)
re-sends the steps up to the resumed checkpoint that the store lacks (points a killed tracking
process never sent), with their original timestamps.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import math
import os
import queue
import threading
import time
import warnings
from typing import Any, Optional

# Our own retry loop owns backoff, so MLflow's must not retry (its default backs off for minutes);
# the timeout is generous for a busy server, as a slow request never holds up training.
_MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
# No usage telemetry from training jobs (clusters are often offline).
_CHILD_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true"}
MAX_BUFFERED_METRICS = 200_000
MAX_RETRY_SECONDS = 60.0
_BATCH = 1000  # MLflow's log_batch limit on metrics per request
# Tags that tell a run directory's MLflow run from other runs of the same name (megaroute.sweep.plan
# names the sweep ones; not imported: the tracking process must not import torch).
TAG_RUN_DIR, TAG_SWEEP, TAG_ROLE, ROLE_PARENT = "run_dir", "sweep_id", "sweep_role", "parent"
# How long a new writer waits for the writer of a killed job on the same run directory to finish
# marking the run (that one exits within its own close timeout, 10 s), so it cannot mark the run
# FAILED after this job set it RUNNING again.
LOCK_WAIT_SECONDS = 15.0


_UNREACHABLE = ("Connection refused", "Failed to establish a new connection", "Name or service not known",
                "No route to host", "Temporary failure in name resolution", "Network is unreachable")


def _is_unreachable(e: BaseException) -> bool:
    """Nothing listens there (as opposed to a server that is slow or answers with an error)."""
    seen = 0
    while e is not None and seen < 8:
        if any(marker in str(e) for marker in _UNREACHABLE):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def preload_client(uri: str) -> None:
    """Imports the MLflow client and the store module for `uri` (seconds of imports; best effort: a
    failure here shows when the writer first uses the client). No store is touched."""
    modules = ["mlflow.tracking", "mlflow.entities", "mlflow.exceptions"]
    if uri.startswith(("http://", "https://", "databricks")):
        modules.append("mlflow.store.tracking.rest_store")
    elif "://" in uri and not uri.startswith("file:"):  # a database URI (sqlite:///..., postgresql://...)
        modules += ["mlflow.store.tracking.sqlalchemy_store", "mlflow.store.db.utils"]
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - e.g. MLflow missing: the writer reports it
            return


def sqlite_file(uri: str) -> Optional[str]:
    """The database file a sqlite:/// tracking URI names; None for other URIs and in-memory databases."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return path if path and path != ":memory:" else None


def filter_literal(value: str) -> Optional[str]:
    """value as a string literal of MLflow's search filter, in whichever quote it does not hold; None
    when it holds both (the filter language has no escape)."""
    if "'" not in value:
        return f"'{value}'"
    return None if '"' in value else f'"{value}"'


def create_sqlite_store(uri: str) -> None:
    """Creates a fresh SQLite store under a temporary name and links it into place when complete.

    MLflow creates and migrates a new SQLite file in place; a process killed meanwhile (a job
    killed in its first seconds, or a tracking process stopped at close()'s deadline) leaves a
    half-migrated file that MLflow can never open again ("table ... already exists"), and so
    breaks tracking for every later run in that directory. Best effort: any problem here falls
    back to MLflow's own creation.
    """
    path = sqlite_file(uri)
    if path is None or os.path.exists(path):
        return
    tmp = f"{path}.init-{os.getpid()}-{threading.get_ident()}"
    try:
        from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine_with_retry

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{tmp}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.link(tmp, path)  # never replaces: if another process won the race, its file stays
    except Exception:  # noqa: BLE001 - e.g. FileExistsError, or a MLflow without these helpers
        pass
    finally:
        for leftover in (tmp, f"{tmp}-journal"):
            try:
                os.remove(leftover)
            except OSError:
                pass


def _is_permanent(e: BaseException) -> bool:
    """True for errors a retry cannot fix (the server rejected the request itself)."""
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:  # pragma: no cover
        return False
    if not isinstance(e, MlflowException):
        return False
    status = e.get_http_status_code()
    return 400 <= status < 500 and status not in (401, 403, 408, 429, 499)


class MLflowWriter:
    """One MLflow run, written by a worker thread that owns the client, the buffer and the retry
    policy. `put` and `close` are called from another thread (in the tracking process, the one
    that reads the pipe from rank 0)."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        params: dict[str, Any],
        tags: dict[str, str],
        artifact_root: str,
        run_id: Optional[str] = None,
        retry_seconds: float = 2.0,
        flush_seconds: float = 5.0,
        record_path: Optional[str] = None,
        find_existing: bool = False,
        backfill: Optional[tuple] = None,
    ):
        for k, v in {**_MLFLOW_ENV, **_CHILD_ENV}.items():
            os.environ.setdefault(k, v)
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.artifact_root = artifact_root
        self.run_id = run_id
        self.record_path = record_path
        self.find_existing = find_existing
        self._backfill = backfill  # (metrics.jsonl path, resumed step, log interval, last step) or None
        self._lock_fd: Optional[int] = None
        self.retry_seconds = retry_seconds
        self.flush_seconds = flush_seconds
        self._params = {k: str(v) for k, v in params.items()}
        self._tags = {k: str(v) for k, v in tags.items()}
        self._metrics: list = []
        self._artifacts: list[tuple[str, Optional[str]]] = []
        self._queue: queue.Queue = queue.Queue()
        self._wake = threading.Event()  # set by close(); puts never wake the worker
        self._close_deadline = float("inf")
        self.close_ok = False  # the run was marked and everything sent
        self._run_ready = False
        self._existing_params: dict[str, str] = {}
        self._warned = False
        # Metric points given up on: oldest points beyond MAX_BUFFERED_METRICS, not numbers, or
        # rejected by the server.
        self.dropped_metrics = 0
        self.failures = 0  # consecutive failed attempts (0 while the server is reachable)
        self.last_error: Optional[str] = None
        self._thread = threading.Thread(target=self._worker, name="mlflow-writer", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """The run exists in the store (created, found or continued) and `run_id` names it."""
        return self._run_ready

    def put(self, kind: str, payload) -> None:
        """Queues one item, never blocking and never waking the worker: ("metrics", (values, step,
        ms timestamp)), ("artifact", (path, artifact_path or None)) or ("tags", {name: value})."""
        self._queue.put((kind, payload))

    def close(self, status: str = "FINISHED", timeout: float = 30.0) -> bool:
        """Flushes within `timeout` seconds and marks the run `status`.

        Returns False (never raises) if the run could not be marked or data was left unsent;
        the worker then gives up, so nothing keeps running after the deadline. If the server was
        unreachable before close() (or was never reached) and the final attempt finds nothing
        listening either, it gives up at once instead of waiting out `timeout`.
        """
        self._close_deadline = time.monotonic() + max(0.0, timeout)
        self._queue.put(("close", status))
        self._wake.set()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive() and self.close_ok

    # ---- worker thread ----
    def _pending(self) -> bool:
        return bool(self._params or self._tags or self._metrics or self._artifacts or not self._run_ready)

    def _worker(self) -> None:
        try:
            self._work()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the run directory's lock
                self._lock_fd = None

    def _wait_for_previous_writer(self) -> None:
        """Takes <record>.lock (best effort, at most LOCK_WAIT_SECONDS): a tracking process of a killed
        job on the same run directory holds it until it has marked the run and exited."""
        if not self.record_path or self._lock_fd is not None:
            return
        try:
            fd = os.open(self.record_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            except OSError:  # a filesystem without flock: go on without it
                break
        os.close(fd)

    def _work(self) -> None:
        client = None
        closing: Optional[str] = None
        outage_at_close = terminated = False
        next_attempt = time.monotonic()
        while True:
            # Wake up only to send (or to retry), to absorb the queue every flush_seconds (so it stays
            # small during an outage), or when close() asks: never once per put, which would make the
            # putting thread wait for the GIL at every item.
            now = time.monotonic()
            items = []
            if closing is not None:
                self._wake.wait(max(0.0, min(next_attempt, self._close_deadline) - now))
            elif self._pending() or not self._queue.empty():
                self._wake.wait(max(0.0, min(next_attempt, now + self.flush_seconds) - now))
            else:
                items.append(self._queue.get())  # idle: the first item logged wakes us
            self._wake.clear()
            try:
                while True:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            for item in items:
                if item[0] == "close":
                    if closing is None:
                        outage_at_close = self.failures > 0
                        next_attempt = time.monotonic()  # final flush now, even during a backoff
                    closing = item[1]
                else:
                    self._absorb(item)
            now = time.monotonic()
            if closing is not None and now >= self._close_deadline:
                return  # close() has given up and returned False: stop here
            if now < next_attempt:
                continue
            try:
                if client is None:
                    from mlflow.tracking import MlflowClient

                    self._wait_for_previous_writer()
                    create_sqlite_store(self.uri)
                    client = MlflowClient(tracking_uri=self.uri)
                self._flush(client)
                if closing is not None and not terminated:
                    # The status before the artifacts: a job that ends before the tracker caught up
                    # (a slow server) should at least leave its run marked.
                    client.set_terminated(self.run_id, status=closing)
                    terminated = True
                self._flush_artifacts(client)
                if closing is not None:
                    self.failures, self.close_ok = 0, True
                    return
            except Exception as e:  # noqa: BLE001 - any tracking failure must stay out of training
                self.failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                down = _is_unreachable(e) and (outage_at_close or not self._run_ready)
                if closing is not None and (down or (self._run_ready and _is_permanent(e))):
                    # Nothing listening, before close() too (or never reached at all), or the run
                    # cannot be marked: waiting out the close timeout would only delay the job's exit.
                    # (A slow or failing server is retried until the deadline.)
                    self._warn(f"MLflow tracking at {self.uri}: giving up on run {self.run_id} ({self.last_error}); "
                               f"{len(self._metrics)} metric points unsent")
                    return
                delay = min(self.retry_seconds * 2 ** (self.failures - 1), max(self.retry_seconds, MAX_RETRY_SECONDS))
                if closing is not None:
                    delay = min(delay, self.retry_seconds)  # within close()'s deadline: no long backoff
                if not self._warned:
                    self._warn(f"MLflow tracking at {self.uri} failed ({self.last_error}); "
                               f"buffering and retrying (every {self.retry_seconds:g}s, backing off)")
                    self._warned = True
                next_attempt = time.monotonic() + delay
                continue
            if self.failures:
                self._warn(f"MLflow tracking at {self.uri} reachable again after {self.failures} failed attempts")
            self.failures, self._warned = 0, False
            next_attempt = time.monotonic() + self.flush_seconds

    @staticmethod
    def _warn(message: str) -> None:
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=1)
        except Exception:  # noqa: BLE001 - e.g. a filter that turns warnings into errors
            pass

    def _absorb(self, item) -> None:
        kind, payload = item
        try:
            if kind == "metrics":
                values, step, ts = payload
                points = []
                for k, v in values.items():
                    try:
                        points.append((str(k), float(v), ts, int(step)))
                    except (TypeError, ValueError):
                        self.dropped_metrics += 1  # not a number: nothing MLflow could store
                self._metrics.extend(points)
                overflow = len(self._metrics) - MAX_BUFFERED_METRICS
                if overflow > 0:  # keep the newest: a long outage loses the oldest points, never memory
                    del self._metrics[:overflow]
                    self.dropped_metrics += overflow
            elif kind == "artifact":
                self._artifacts.append(payload)
            elif kind == "tags":
                self._tags.update({k: str(v) for k, v in payload.items()})
        except Exception as e:  # noqa: BLE001 - a malformed item must not kill the worker
            self._warn(f"MLflow tracker: ignoring malformed {kind!r} item ({type(e).__name__}: {e})")

    def _ensure_run(self, client) -> None:
        if self._run_ready:
            return
        if self.run_id is not None:
            try:
                run = client.get_run(self.run_id)
            except Exception as e:  # noqa: BLE001
                if not _is_permanent(e):
                    raise
                self._warn(f"MLflow run {self.run_id} not found at {self.uri} ({e}); starting a new run")
                run = None
            if run is not None and run.info.lifecycle_stage == "deleted":
                self._warn(f"MLflow run {self.run_id} was deleted; starting a new run")
                run = None
            if run is not None:
                self._continue(client, run)
                return
            self.run_id = None
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            location = None
            if not self.uri.startswith(("http://", "https://", "databricks")):
                location = "file://" + os.path.abspath(self.artifact_root)
            try:
                exp_id = client.create_experiment(self.experiment, artifact_location=location)
            except Exception:  # another process may have created it meanwhile
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
            run = self._find_run(client, exp_id) if self.find_existing else None
            if run is not None:
                self._warn(f"MLflow run {run.info.run_id} ({self.run_name!r}) found by name and tags; continuing it")
                self._continue(client, run)
                return
        # The tags that identify the run go with its creation, so a job killed right after still
        # leaves a run the next launch can find.
        identity = {k: self._tags[k] for k in (TAG_RUN_DIR, TAG_SWEEP) if k in self._tags}
        self.run_id = client.create_run(exp_id, run_name=self.run_name, tags=identity).info.run_id
        self._run_ready = True
        self._save_record(exp_id)

    def _continue(self, client, run) -> None:
        """Continues an existing run: back to RUNNING, its params kept, its id recorded."""
        self.run_id = run.info.run_id
        if run.info.status != "RUNNING":
            client.update_run(self.run_id, status="RUNNING")
        self._existing_params = dict(run.data.params)
        self._run_ready = True
        self._save_record(run.info.experiment_id)

    def _find_run(self, client, exp_id):
        """The newest active run of experiment `exp_id` named `run_name` with this run's `sweep_id` (or
        none, like this one) and this run directory (or no run_dir tag: runs of older versions); None
        if there is none. Sweep parent runs never match."""
        name = filter_literal(self.run_name)
        if name is None:
            return None
        runs = client.search_runs([exp_id], f"attributes.run_name = {name}", max_results=200,
                                  order_by=["attributes.start_time DESC"])
        for run in runs:
            tags = run.data.tags
            if tags.get(TAG_ROLE) == ROLE_PARENT or tags.get(TAG_SWEEP) != self._tags.get(TAG_SWEEP):
                continue
            if tags.get(TAG_RUN_DIR, self._tags.get(TAG_RUN_DIR)) != self._tags.get(TAG_RUN_DIR):
                continue
            return run
        return None

    def _save_record(self, experiment_id) -> None:
        """Writes <run_dir>/mlflow_run.json atomically (never raises: training does not depend on it)."""
        if not self.record_path:
            return
        record = {"tracking_uri": self.uri, "experiment": self.experiment, "experiment_id": str(experiment_id),
                  "run_id": self.run_id, "run_name": self.run_name}
        tmp = f"{self.record_path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.record_path)
        except OSError as e:
            self._warn(f"could not write {self.record_path} ({e}); a restart of this run may start a new MLflow run")
            try:
                os.remove(tmp)
            except OSError:
                pass

    def _backfill_points(self, client) -> None:
        """Queues (ahead of the rest) the points of steps <= the resumed step that metrics.jsonl has and
        the run lacks: what a killed tracking process never sent, or a whole outage's worth."""
        path, until, interval, last = self._backfill
        records: dict[tuple[str, int], dict] = {}
        try:
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        kind, step = rec["kind"], int(rec["step"])
                    except (ValueError, KeyError, TypeError):
                        continue  # e.g. a line cut by a kill
                    if step <= until and kind in ("train", "eval"):
                        records[kind, step] = rec  # a step logged twice (replayed) keeps the last
        except OSError:
            records = {}
        anchors = {"train": "train/loss", "eval": "eval/loss"}
        present = {kind: {m.step for m in client.get_metric_history(self.run_id, key)}
                   for kind, key in anchors.items() if any(k == kind for k, _ in records)}
        points = []
        for (kind, step), rec in sorted(records.items(), key=lambda kv: kv[0][1]):
            if anchors[kind] not in rec or step in present[kind]:
                continue
            if kind == "train" and step % interval and step != last:
                continue  # MLflowLogger logs train metrics every `interval` steps and at the last
            ts = int(float(rec.get("time", time.time())) * 1000)
            for k, v in rec.items():
                if k not in ("kind", "step", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                    points.append((str(k), float(v), ts, step))
        self._backfill = None
        if points:
            self._metrics[:0] = points
            overflow = len(self._metrics) - MAX_BUFFERED_METRICS
            if overflow > 0:
                del self._metrics[:overflow]
                self.dropped_metrics += overflow

    def _flush(self, client) -> None:
        """Sends params, tags and metrics, as few requests as MLflow's limits allow (one for a
        typical flush: up to 100 params, 100 tags and 1000 entities in all per request)."""
        from mlflow.entities import Metric, Param, RunTag

        self._ensure_run(client)
        if self._backfill is not None:
            self._backfill_points(client)
        if self._params:
            changed = {k: (self._existing_params[k], v) for k, v in self._params.items()
                       if k in self._existing_params and self._existing_params[k] != v[:6000]}
            if changed:  # MLflow params are immutable: a resumed run keeps its first values
                self._warn("MLflow params changed since this run was started; keeping the old values for "
                           + ", ".join(f"{k} ({old!r} -> {new!r})" for k, (old, new) in sorted(changed.items())[:20]))
                self._tags.setdefault("params_changed_on_resume", ",".join(sorted(changed))[:5000])
            self._params = {k: v for k, v in self._params.items() if k not in self._existing_params}
        while self._params or self._tags or self._metrics:
            params = [Param(k, v[:6000]) for k, v in list(self._params.items())[:100]]
            tags = [RunTag(k, v) for k, v in list(self._tags.items())[:100]]
            room = _BATCH - len(params) - len(tags)
            metrics = [Metric(k, v, ts, step) for k, v, ts, step in self._metrics[:room]]
            try:
                client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags)
            except Exception as e:  # noqa: BLE001
                if not _is_permanent(e):
                    raise
                # Something in it was rejected: send each kind on its own, skipping what is rejected alone.
                self._send(params, 100, lambda b: client.log_batch(self.run_id, params=b), "param")
                self._send(tags, 100, lambda b: client.log_batch(self.run_id, tags=b), "tag")
                self._send(metrics, _BATCH, lambda b: client.log_batch(self.run_id, metrics=b), "metric")
            for p in params:
                del self._params[p.key]
            for t in tags:
                self._tags.pop(t.key, None)
            del self._metrics[:len(metrics)]

    def _flush_artifacts(self, client) -> None:
        while self._artifacts:
            path, artifact_path = self._artifacts[0]
            try:
                if os.path.isdir(path):
                    client.log_artifacts(self.run_id, path, artifact_path)
                elif os.path.isfile(path):
                    client.log_artifact(self.run_id, path, artifact_path)
                else:
                    self._warn(f"MLflow artifact {path} does not exist; skipped")
            except Exception as e:  # noqa: BLE001
                if not _is_permanent(e):
                    raise
                self._warn(f"MLflow rejected artifact {path}: {e}; skipped")
            self._artifacts.pop(0)

    def _send(self, items: list, size: int, log, what: str) -> None:
        """Sends `items` in batches; a batch the server rejects is retried one item at a time,
        and items rejected alone are skipped (a transient error propagates: retry later)."""
        for i in range(0, len(items), size):
            batch = items[i:i + size]
            try:
                log(batch)
            except Exception as e:  # noqa: BLE001
                if not _is_permanent(e):
                    raise
                for item in batch:
                    try:
                        log([item])
                    except Exception as e1:  # noqa: BLE001
                        if not _is_permanent(e1):
                            raise
                        if what == "metric":
                            self.dropped_metrics += 1
                        self._warn(f"MLflow rejected {what} {item.key!r}: {e1}; skipped")
