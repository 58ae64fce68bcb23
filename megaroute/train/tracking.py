"""MLflow tracking from rank 0, on a background thread.

Training only enqueues; a worker thread creates the run and sends batches. When the
tracking server is unreachable or failing, the worker warns once, keeps the data buffered
(bounded) and retries with backoff; training never waits on it except for a bounded flush
at the end.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
from typing import Any, Optional

# Fail fast inside the worker thread: our own retry loop owns backoff, so each attempt must be short.
_MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
MAX_BUFFERED_METRICS = 200_000


def default_uri(runs_dir: str) -> str:
    return f"sqlite:///{os.path.abspath(os.path.join(runs_dir, 'mlflow.db'))}"


class MLflowTracker:
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
    ):
        for k, v in _MLFLOW_ENV.items():
            os.environ.setdefault(k, v)
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.artifact_root = artifact_root
        self.run_id = run_id
        self.retry_seconds = retry_seconds
        self._params = {k: str(v) for k, v in params.items()}
        self._tags = dict(tags)
        self._metrics: list = []
        self._artifacts: list[tuple[str, Optional[str]]] = []
        self._queue: queue.Queue = queue.Queue()
        self._warned = False
        self.dropped_metrics = 0
        self._thread = threading.Thread(target=self._worker, name="mlflow-tracker", daemon=True)
        self._thread.start()

    # ---- called from the training loop (cheap, never raises) ----
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._queue.put(("metrics", (dict(metrics), step, int(time.time() * 1000))))

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        self._queue.put(("artifact", (path, artifact_path)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._queue.put(("tags", dict(tags)))

    def close(self, status: str = "FINISHED", timeout: float = 30.0) -> bool:
        """Flushes within `timeout` seconds and marks the run; returns False if data was left unsent."""
        self._queue.put(("close", status))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- worker thread ----
    def _worker(self) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        closing: Optional[str] = None
        while True:
            try:
                item = self._queue.get(timeout=0.5)
                self._absorb(item, Metric)
                if item[0] == "close":
                    closing = item[1]
                # Drain whatever else is waiting so a flush sends one batch.
                while True:
                    item = self._queue.get_nowait()
                    self._absorb(item, Metric)
                    if item[0] == "close":
                        closing = item[1]
            except queue.Empty:
                pass
            try:
                self._flush(client)
                if closing:
                    client.set_terminated(self.run_id, status=closing)
                    return
                self._warned = False
            except Exception as e:  # noqa: BLE001 - any tracking failure must stay out of training
                if not self._warned:
                    warnings.warn(f"MLflow tracking at {self.uri} failed ({type(e).__name__}: {e}); "
                                  f"buffering and retrying every {self.retry_seconds:.0f}s", stacklevel=1)
                    self._warned = True
                time.sleep(self.retry_seconds)

    def _absorb(self, item, Metric) -> None:
        kind, payload = item
        if kind == "metrics":
            values, step, ts = payload
            self._metrics.extend(Metric(k, float(v), ts, step) for k, v in values.items())
            overflow = len(self._metrics) - MAX_BUFFERED_METRICS
            if overflow > 0:  # keep the newest: a long outage loses the oldest points, never memory
                del self._metrics[:overflow]
                self.dropped_metrics += overflow
        elif kind == "artifact":
            self._artifacts.append(payload)
        elif kind == "tags":
            self._tags.update(payload)

    def _ensure_run(self, client) -> None:
        if self.run_id is not None:
            if client.get_run(self.run_id).info.status != "RUNNING":
                client.update_run(self.run_id, status="RUNNING")
            return
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            location = None
            if not self.uri.startswith(("http://", "https://", "databricks")):
                location = "file://" + os.path.abspath(self.artifact_root)
            exp_id = client.create_experiment(self.experiment, artifact_location=location)
        else:
            exp_id = exp.experiment_id
        self.run_id = client.create_run(exp_id, run_name=self.run_name).info.run_id

    def _flush(self, client) -> None:
        from mlflow.entities import Param, RunTag

        self._ensure_run(client)
        if self._params:
            items = list(self._params.items())
            for i in range(0, len(items), 100):
                client.log_batch(self.run_id, params=[Param(k, v[:6000]) for k, v in items[i:i + 100]])
            self._params = {}
        if self._tags:
            client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in self._tags.items()])
            self._tags = {}
        while self._metrics:
            client.log_batch(self.run_id, metrics=self._metrics[:1000])
            del self._metrics[:1000]
        while self._artifacts:
            path, artifact_path = self._artifacts[0]
            if os.path.isfile(path):
                client.log_artifact(self.run_id, path, artifact_path)
            self._artifacts.pop(0)
