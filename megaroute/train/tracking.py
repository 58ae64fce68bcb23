"""MLflow tracking from rank 0, in a helper process.

The MLflow client (`_Engine`) runs in a child process. The training process runs no thread for
it: a log call appends to a list (microseconds; never blocks, never raises), and every
`feed_seconds` one of them pickles the list and writes it to the child's pipe without blocking.
Keeping MLflow out of the training process matters: importing it takes seconds, and its
SQLAlchemy store spends ~0.3-0.7 ms of Python per metric point; in a thread of the training
process all of that would compete with the training loop for the GIL (and for the GIL holder's
core: a descheduled holder stalls the training thread for a whole time slice).

The engine creates the run and sends batches (one round per `flush_seconds`). When the tracking
server is unreachable or failing it warns once per outage, keeps the data buffered (bounded: the
oldest metric points are dropped first and counted in `dropped_metrics`) and retries with
exponential backoff; training never waits on it except for a bounded flush in `close()`.
Errors the server will never accept (HTTP 4xx such as a param whose value changed on resume,
or a resumed run id the store does not know) are not retried forever: the offending item is
skipped with a warning and everything else still goes through.

If the training process dies without close(), the child sees its pipe close and marks the run
FAILED. It ignores SIGTERM/SIGINT (a scheduler signals every process of the job: the training
process then stops gracefully and closes the run KILLED), but after one it gives up quickly
once the training process is gone.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Optional

# Our own retry loop owns backoff, so MLflow's must not retry (its default backs off for minutes);
# the timeout is generous for a busy server, as a slow request never holds up training.
_MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
MAX_BUFFERED_METRICS = 200_000
# Items (one per log call) waiting for the worker; only reached if the worker is stuck in a request.
MAX_QUEUED_ITEMS = 10_000
MAX_RETRY_SECONDS = 60.0
_BATCH = 1000  # MLflow's log_batch limit on metrics per request
# Only for the tracking process: no usage telemetry from training jobs (clusters are often offline).
_CHILD_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true"}


def default_uri(runs_dir: str) -> str:
    return f"sqlite:///{os.path.abspath(os.path.join(runs_dir, 'mlflow.db'))}"


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


def _create_sqlite_store(uri: str) -> None:
    """Creates a fresh SQLite store under a temporary name and links it into place when complete.

    MLflow creates and migrates a new SQLite file in place; a process killed meanwhile (a job
    killed in its first seconds, or a tracking process stopped at close()'s deadline) leaves a
    half-migrated file that MLflow can never open again ("table ... already exists"), and so
    breaks tracking for every later run in that directory. Best effort: any problem here falls
    back to MLflow's own creation.
    """
    if not uri.startswith("sqlite:///"):
        return
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    if not path or path == ":memory:" or os.path.exists(path):
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


class _Engine:
    """The MLflow side: a worker thread that owns the client, the buffer and the retry policy."""

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
    ):
        for k, v in {**_MLFLOW_ENV, **_CHILD_ENV}.items():
            os.environ.setdefault(k, v)
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.artifact_root = artifact_root
        self.run_id = run_id
        self.retry_seconds = retry_seconds
        self.flush_seconds = flush_seconds
        self._params = {k: str(v) for k, v in params.items()}
        self._tags = {k: str(v) for k, v in tags.items()}
        self._metrics: list = []
        self._artifacts: list[tuple[str, Optional[str]]] = []
        self._queue: queue.Queue = queue.Queue()
        self._wake = threading.Event()  # set by close(); log calls never wake the worker
        self._accepting = True
        self._close_deadline = float("inf")
        self._close_ok = False
        self._run_ready = False
        self._existing_params: dict[str, str] = {}
        self._warned = False
        self._dropped_in_buffer = 0
        self._dropped_at_enqueue = 0
        self.failures = 0  # consecutive failed attempts (0 while the server is reachable)
        self.last_error: Optional[str] = None
        self._thread = threading.Thread(target=self._worker, name="mlflow-tracker", daemon=True)
        self._thread.start()

    @property
    def dropped_metrics(self) -> int:
        """Metric points given up on: oldest points beyond MAX_BUFFERED_METRICS, or rejected by the server."""
        return self._dropped_in_buffer + self._dropped_at_enqueue

    # ---- called from the training loop (cheap, never raises, never blocks) ----
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._accepting:
            return
        if self._queue.qsize() >= MAX_QUEUED_ITEMS:
            self._dropped_at_enqueue += len(metrics)
            return
        self._queue.put(("metrics", (dict(metrics), step, int(time.time() * 1000))))

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        if self._accepting:
            self._queue.put(("artifact", (path, artifact_path)))

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._accepting:
            self._queue.put(("tags", dict(tags)))

    def close(self, status: str = "FINISHED", timeout: float = 30.0) -> bool:
        """Flushes within `timeout` seconds and marks the run `status`.

        Returns False (never raises) if the run could not be marked or data was left unsent;
        the worker then gives up, so nothing keeps running after the deadline. If the server was
        unreachable before close() (or was never reached) and the final attempt finds nothing
        listening either, it gives up at once instead of waiting out `timeout`.
        """
        self._accepting = False
        self._close_deadline = time.monotonic() + max(0.0, timeout)
        self._queue.put(("close", status))
        self._wake.set()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive() and self._close_ok

    # ---- worker thread ----
    def _pending(self) -> bool:
        return bool(self._params or self._tags or self._metrics or self._artifacts or not self._run_ready)

    def _worker(self) -> None:
        client = None
        closing: Optional[str] = None
        outage_at_close = terminated = False
        next_attempt = time.monotonic()
        while True:
            # Wake up only to send (or to retry), to absorb the queue every flush_seconds (so it stays
            # small during an outage), or when close() asks: never once per log call, which would
            # make the training thread wait for the GIL at every step.
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

                    _create_sqlite_store(self.uri)
                    client = MlflowClient(tracking_uri=self.uri)
                self._flush(client)
                if closing is not None and not terminated:
                    # The status before the artifacts: a job that ends before the tracker caught up
                    # (a slow server) should at least leave its run marked.
                    client.set_terminated(self.run_id, status=closing)
                    terminated = True
                self._flush_artifacts(client)
                if closing is not None:
                    self.failures, self._close_ok = 0, True
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
                        self._dropped_in_buffer += 1  # not a number: nothing MLflow could store
                self._metrics.extend(points)
                overflow = len(self._metrics) - MAX_BUFFERED_METRICS
                if overflow > 0:  # keep the newest: a long outage loses the oldest points, never memory
                    del self._metrics[:overflow]
                    self._dropped_in_buffer += overflow
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
                if run.info.status != "RUNNING":
                    client.update_run(self.run_id, status="RUNNING")
                self._existing_params = dict(run.data.params)
                self._run_ready = True
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
        self.run_id = client.create_run(exp_id, run_name=self.run_name).info.run_id
        self._run_ready = True

    def _flush(self, client) -> None:
        """Sends params, tags and metrics, as few requests as MLflow's limits allow (one for a
        typical flush: up to 100 params, 100 tags and 1000 entities in all per request)."""
        from mlflow.entities import Metric, Param, RunTag

        self._ensure_run(client)
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
                            self._dropped_in_buffer += 1
                        self._warn(f"MLflow rejected {what} {item.key!r}: {e1}; skipped")


# ---------------------------------------------------------------- the process boundary

_LEN = struct.Struct("!I")


def _write_frame(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class _FrameReader:
    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()

    def read(self, timeout: Optional[float]) -> Optional[list]:
        """Complete frames available within `timeout` ([] if none); None at end of file."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            return None
        self.buf += chunk
        out = []
        while len(self.buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self.buf)
            if len(self.buf) < _LEN.size + n:
                break
            out.append(pickle.loads(bytes(self.buf[_LEN.size:_LEN.size + n])))
            del self.buf[:_LEN.size + n]
        return out


def _child_main(status_fd: int) -> None:
    """The tracking process: frames of [(kind, payload), ...] on stdin, status frames on `status_fd`."""
    signaled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signaled.append(signum))
    os.set_blocking(status_fd, False)  # the training process reads it only now and then
    reader = _FrameReader(sys.stdin.fileno())
    engine: Optional[_Engine] = None
    sent: dict = {}

    def report(final: bool = False) -> None:
        nonlocal sent
        if engine is None:
            return
        status = {"run_id": engine.run_id, "failures": engine.failures, "last_error": engine.last_error,
                  "dropped": engine.dropped_metrics, "close_ok": engine._close_ok}
        if status == sent and not final:
            return
        try:
            if final:
                os.set_blocking(status_fd, True)  # close() is reading it now
            _write_frame(status_fd, status)
            sent = status
        except BlockingIOError:
            pass  # pipe full: the next report carries the then-current state
        except OSError:
            pass

    def finish(status: str, timeout: float) -> None:
        if engine is not None:
            engine.close(status, timeout=max(0.0, timeout))
        report(final=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # not interpreter shutdown: no atexit hooks, no waiting on a stuck request

    while True:
        frames = reader.read(timeout=1.0)
        if frames is None:  # the training process is gone without close(): it crashed or was killed
            finish("FAILED", 2.0 if signaled else 10.0)
        for items in frames:
            for kind, payload in items:
                if kind == "init":
                    engine = _Engine(**payload)
                elif engine is None:
                    continue
                elif kind == "metrics":
                    engine._queue.put(("metrics", payload))
                elif kind == "artifact":
                    engine.log_artifact(*payload)
                elif kind == "tags":
                    engine.set_tags(payload)
                elif kind == "close":
                    status, deadline = payload
                    finish(status, deadline - time.monotonic())
        report()


class MLflowTracker:
    """Rank 0's MLflow run. Log calls are cheap, never block and never raise; `close()` is bounded.

    By default the MLflow client runs in a child process (see the module docstring) and this
    process runs no thread for it: log calls append to a list, and every `feed_seconds` one of
    them pickles the list and writes it to the child's pipe without blocking (~0.1 ms).
    `in_process=True` runs the MLflow client in a thread of this process instead.
    """

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
        in_process: bool = False,
        feed_seconds: float = 0.5,
    ):
        self.uri = uri
        self.feed_seconds = feed_seconds
        config = dict(uri=uri, experiment=experiment, run_name=run_name, params={k: str(v) for k, v in params.items()},
                      tags={k: str(v) for k, v in tags.items()}, artifact_root=artifact_root, run_id=run_id,
                      retry_seconds=retry_seconds, flush_seconds=flush_seconds)
        self._engine: Optional[_Engine] = _Engine(**config) if in_process else None
        self._status = {"run_id": run_id, "failures": 0, "last_error": None, "dropped": 0, "close_ok": False}
        self._items: list = [("init", config)]
        self._out = b""  # serialized frames not yet written to the pipe
        self._next_send = 0.0
        self._accepting = True
        self._pipe_ok = True
        self._dropped_at_enqueue = 0
        self._result: Optional[bool] = None
        self.proc: Optional[subprocess.Popen] = None
        if self._engine is not None:
            return
        try:
            self._start_child()
            self._send()
        except Exception as e:  # noqa: BLE001 - no tracking is better than no training
            warnings.warn(f"MLflow tracking disabled: could not start the tracking process ({e})", RuntimeWarning,
                          stacklevel=2)
            self._accepting = False
            self._result = False

    def _start_child(self) -> None:
        status_r, status_w = os.pipe()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        for k, v in {**_MLFLOW_ENV, **_CHILD_ENV}.items():
            env.setdefault(k, v)
        code = "import sys; from megaroute.train.tracking import _child_main; _child_main(int(sys.argv[1]))"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(status_w)], stdin=subprocess.PIPE,
                                         pass_fds=(status_w,), env=env, close_fds=True)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        self._status_reader = _FrameReader(status_r)
        os.set_blocking(self.proc.stdin.fileno(), False)

    # ---- state reported by the engine ----
    def _get(self, key: str):
        if self._engine is not None:
            return {"run_id": self._engine.run_id, "failures": self._engine.failures,
                    "last_error": self._engine.last_error, "dropped": self._engine.dropped_metrics}[key]
        if self._result is None and time.monotonic() >= self._next_send:
            self._send()  # also reads the status; a crash loses at most feed_seconds of log calls
        else:
            self._poll_status()
        return self._status[key]

    @property
    def run_id(self) -> Optional[str]:
        return self._get("run_id")

    @property
    def failures(self) -> int:
        """Consecutive failed attempts to reach the tracking store (0 while it is reachable)."""
        return self._get("failures")

    @property
    def last_error(self) -> Optional[str]:
        return self._get("last_error")

    @property
    def dropped_metrics(self) -> int:
        """Metric points given up on: beyond the buffer bounds, not numbers, or rejected by the server."""
        return self._dropped_at_enqueue + self._get("dropped")

    # ---- called from the training loop (cheap, never raises, never blocks) ----
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._engine is not None:
            return self._engine.log_metrics(metrics, step)
        if not self._accepting:
            return
        if len(self._items) >= MAX_QUEUED_ITEMS:
            self._dropped_at_enqueue += len(metrics)
        else:
            self._items.append(("metrics", (dict(metrics), step, int(time.time() * 1000))))
        if time.monotonic() >= self._next_send:
            self._send()

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        if self._engine is not None:
            return self._engine.log_artifact(path, artifact_path)
        if self._accepting:
            self._items.append(("artifact", (str(path), None if artifact_path is None else str(artifact_path))))
            self._send()

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._engine is not None:
            return self._engine.set_tags(tags)
        if self._accepting:
            self._items.append(("tags", {str(k): str(v) for k, v in tags.items()}))
            self._send()

    def close(self, status: str = "FINISHED", timeout: float = 30.0) -> bool:
        """Flushes within `timeout` seconds and marks the run `status`.

        Returns False (never raises) if the run could not be marked or data was left unsent;
        nothing keeps running after the deadline. If nothing listened at the tracking URI before
        close() (or it was never reached) and nothing listens at the final attempt either, it
        gives up at once instead of waiting out `timeout`.
        """
        if self._engine is not None:
            return self._engine.close(status, timeout)
        if self._result is not None:
            return self._result
        deadline = time.monotonic() + max(0.0, timeout)
        self._accepting = False
        try:
            self._items.append(("close", (status, deadline)))
            self._send()
            fd = self.proc.stdin.fileno()
            while (self._out or self._items) and self._accepting_pipe() and time.monotonic() < deadline:
                select.select([], [fd], [], max(0.0, deadline - time.monotonic()))
                self._send()
            self.proc.stdin.close()
            self.proc.wait(max(0.0, deadline - time.monotonic()) + 2.0)  # + the child's own exit
        except subprocess.TimeoutExpired:
            pass
        except Exception:  # noqa: BLE001 - the child is gone or the pipe broke: report False
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            warnings.warn(f"MLflow tracking at {self.uri}: run {self._status['run_id']} not finished within "
                          f"{timeout:g}s of close(); stopped the tracking process (last error: "
                          f"{self._status['last_error']})", RuntimeWarning, stacklevel=2)
        until = time.monotonic() + 2.0
        while time.monotonic() < until:  # the final status, up to end of file
            try:
                frames = self._status_reader.read(timeout=0.2)
            except (OSError, ValueError, pickle.UnpicklingError):
                break
            if frames is None:
                break
            for frame in frames:
                self._status.update(frame)
        os.close(self._status_reader.fd)
        self._result = self.proc.returncode == 0 and bool(self._status["close_ok"])
        return self._result

    # ---- the pipe (non-blocking; called from the training thread) ----
    def _accepting_pipe(self) -> bool:
        return self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed and self._pipe_ok

    def _send(self) -> None:
        self._next_send = time.monotonic() + self.feed_seconds
        self._poll_status()
        try:
            if not self._out and self._items:
                items, self._items = self._items, []
                self._out = self._frame(items)
            while self._out:
                n = os.write(self.proc.stdin.fileno(), self._out)
                self._out = self._out[n:]
        except BlockingIOError:
            pass  # the pipe is full: the rest goes at the next send
        except (OSError, ValueError):  # the tracking process is gone: nothing more can be sent
            self._accepting = self._pipe_ok = False
            self._items, self._out = [], b""

    def _frame(self, items: list) -> bytes:
        """Only builtins cross the pipe (a tensor or numpy scalar would drag torch into the child)."""
        plain_items = []
        for kind, payload in items:
            if kind == "metrics":
                values, step, ts = payload
                plain = {}
                for k, v in values.items():
                    try:
                        plain[str(k)] = float(v)
                    except (TypeError, ValueError):
                        self._dropped_at_enqueue += 1
                payload = (plain, int(step), ts)
            plain_items.append((kind, payload))
        data = pickle.dumps(plain_items, protocol=pickle.HIGHEST_PROTOCOL)
        return _LEN.pack(len(data)) + data

    def _poll_status(self) -> None:
        if self.proc is None or self._result is not None:
            return
        try:
            while True:
                frames = self._status_reader.read(timeout=0)
                if not frames:
                    return
                for frame in frames:
                    self._status.update(frame)
        except (OSError, ValueError, pickle.UnpicklingError):
            return
