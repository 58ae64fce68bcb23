"""MLflow tracking from rank 0: `MLflowTracker`, which runs the MLflow client in a child process.

The training process runs no thread for it: a log call appends to a list (microseconds; never
blocks, never raises), and every `feed_seconds` one of them pickles the list and writes it to the
child's pipe without blocking. Keeping MLflow out of the training process matters: importing it
takes seconds, and its SQLAlchemy store spends ~0.3-0.7 ms of Python per metric point; in a thread
of the training process all of that would compete with the training loop for the GIL (and for the
GIL holder's core: a descheduled holder stalls the training thread for a whole time slice).

This module is the transport: length-prefixed pickle frames of builtins, rank 0 -> child on its
stdin and status (run id, failures, dropped points) child -> rank 0 on a second pipe. The child
hands the items to an `MLflowWriter` (mlflow_writer.py: the run, buffering, retries); training
never waits on it except for a bounded flush in `close()`.

If the training process dies without close(), the child sees its pipe close and marks the run
FAILED. It ignores SIGTERM/SIGINT (a scheduler signals every process of the job: the training
process then stops gracefully and closes the run KILLED), but after one it gives up quickly
once the training process is gone.
"""

from __future__ import annotations

import importlib.metadata
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import time
import urllib.parse
import warnings
from typing import Any, Optional

from .mlflow_writer import MLflowWriter, preload_client

# Items (one per log call) waiting for the next send; only reached if the child stops reading.
MAX_QUEUED_ITEMS = 10_000


def default_uri(runs_dir: str) -> str:
    return f"sqlite:///{os.path.abspath(os.path.join(runs_dir, 'mlflow.db'))}"


def config_uri(cfg) -> str:
    """The store a config's runs go to: tracking.uri, else the SQLite store under runs_dir."""
    return cfg.tracking.uri or default_uri(cfg.runs_dir)


FILE_STORE_REFUSED_FROM = (3, 13)  # MLflow's file store raises on use unless MLFLOW_ALLOW_FILE_STORE is true


def file_store_problem(uri: str, routed: bool) -> Optional[str]:
    """Why `uri` cannot hold the run when it names MLflow's file store (a path or file://), else None.
    That store keeps each metric in a file at its key's path, and a routed run logs a key both as a
    metric and as a prefix (eval/exec_frac and eval/exec_frac/layer_1): the second fails ("Is a
    directory"). A dense run's keys fit, where MLflow takes the store at all: before 3.13, or with
    MLFLOW_ALLOW_FILE_STORE=true (MLflow's version read from its package metadata: no import)."""
    scheme = urllib.parse.urlparse(uri).scheme
    if (scheme not in ("", "file") and len(scheme) != 1) or uri == "databricks":  # one letter: a Windows drive
        return None
    instead = "use a database store such as sqlite:///<dir>/mlflow.db, or leave tracking.uri unset (a SQLite store " \
              "under runs_dir)"
    if routed:
        return (f"{uri!r} is MLflow's file store, which cannot hold a routed run's metrics (it stores each metric "
                f"as a file at its key's path, and eval/exec_frac beside eval/exec_frac/layer_1 needs one path as a "
                f"file and as a folder); {instead}")
    try:
        version = importlib.metadata.version("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return None
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")
    if allowed or tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < FILE_STORE_REFUSED_FROM:
        return None
    return f"{uri!r} is MLflow's file store, which MLflow {version} refuses (maintenance mode); {instead}, or " \
           f"export MLFLOW_ALLOW_FILE_STORE=true"


# ---------------------------------------------------------------- frames

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


def _child_main(status_fd: int, uri: str = "") -> None:
    """The tracking process: frames of [(kind, payload), ...] on stdin, status frames on `status_fd`.
    `uri`: the store to preload the client for, before the run's frames arrive."""
    signaled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signaled.append(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # blocked by TrackingProcess
    preload_client(uri)
    os.set_blocking(status_fd, False)  # the training process reads it only now and then
    reader = _FrameReader(sys.stdin.fileno())
    writer: Optional[MLflowWriter] = None
    sent: dict = {}

    def report(final: bool = False) -> None:
        nonlocal sent
        if writer is None:
            return
        status = {"run_id": writer.run_id, "ready": writer.ready, "failures": writer.failures,
                  "last_error": writer.last_error, "dropped": writer.dropped_metrics, "close_ok": writer.close_ok}
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
        if writer is not None:
            writer.close(status, timeout=max(0.0, timeout))
        report(final=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # not interpreter shutdown: no atexit hooks, no waiting on a stuck request

    while True:
        # Until the run exists (or the store failed), report promptly: rank 0 waits for it before step 1.
        starting = writer is not None and not writer.ready and not writer.failures
        frames = reader.read(timeout=0.05 if starting else 1.0)
        if frames is None:  # the training process is gone without close(): it crashed or was killed
            finish("FAILED", 2.0 if signaled else 10.0)
        for items in frames:
            for kind, payload in items:
                if kind == "init":
                    writer = MLflowWriter(**payload)
                elif writer is None:
                    continue
                elif kind in ("metrics", "artifact", "tags"):
                    writer.put(kind, payload)
                elif kind == "close":
                    status, deadline = payload
                    finish(status, deadline - time.monotonic())
        report()


# How the tracking process starts. SIGTERM/SIGINT are blocked before anything is imported: a scheduler
# signals every process of the job, and one arriving while the child still imports (MLflow: seconds on
# a loaded node) would kill it before _child_main's handlers exist; _child_main unblocks them once they
# do. The package is entered through a bare module object for `megaroute` (path: argv[3]), so its
# __init__, which loads the model (torch: ~1.2 s of CPU per launch) to register the routing methods,
# does not run: this process needs only this module and mlflow_writer, which import neither.
_CHILD_CODE = (
    "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT}); "
    "import sys, types; package = types.ModuleType('megaroute'); package.__path__ = [sys.argv[3]]; "
    "sys.modules['megaroute'] = package; "
    "from megaroute.train.tracking import _child_main; _child_main(int(sys.argv[1]), sys.argv[2])")


class TrackingProcess:
    """The tracking process, started ahead of its run.

    Started with the tracking URI only, it imports MLflow and that store's client while the training
    process sets up (seconds: rank 0 would otherwise wait for them before step 1). `MLflowTracker`
    adopts it and sends it the run; `discard()` ends one that was never adopted (the launch failed first).
    """

    def __init__(self, uri: str = ""):
        status_r, status_w = os.pipe()
        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, str(status_w), uri, package_dir],
                                         stdin=subprocess.PIPE, pass_fds=(status_w,), close_fds=True)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        self._status_reader: Optional[_FrameReader] = _FrameReader(status_r)
        os.set_blocking(self.proc.stdin.fileno(), False)

    def adopt(self) -> tuple[subprocess.Popen, "_FrameReader"]:
        """Hands the process and its status pipe to their one owner (an `MLflowTracker`)."""
        if self._status_reader is None:
            raise RuntimeError("the tracking process was already adopted or discarded")
        reader, self._status_reader = self._status_reader, None
        return self.proc, reader

    def discard(self) -> None:
        """Ends the process unless a tracker adopted it: with its input closed before any run, it exits."""
        if self._status_reader is None:
            return
        os.close(self._status_reader.fd)
        self._status_reader = None
        self.proc.stdin.close()


class MLflowTracker:
    """Rank 0's MLflow run. Log calls are cheap, never block and never raise; `close()` is bounded.

    The MLflow client runs in a child process (see the module docstring) and this process runs no
    thread for it: log calls append to a list, and every `feed_seconds` one of them pickles the
    list and writes it to the child's pipe without blocking (~0.1 ms).
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
        feed_seconds: float = 0.5,
        record_path: Optional[str] = None,
        find_existing: bool = False,
        backfill: Optional[tuple] = None,
        process: Optional["TrackingProcess"] = None,
    ):
        """`record_path`, `find_existing` and `backfill`: see `MLflowWriter` (the run directory's record
        of its MLflow run, the look-up by name and tags, the re-sent points of a resumed run). `process`:
        a tracking process started earlier (see `TrackingProcess`); by default one starts now."""
        self.uri = uri
        self.feed_seconds = feed_seconds
        config = dict(uri=uri, experiment=experiment, run_name=run_name, params={k: str(v) for k, v in params.items()},
                      tags={k: str(v) for k, v in tags.items()}, artifact_root=artifact_root, run_id=run_id,
                      retry_seconds=retry_seconds, flush_seconds=flush_seconds, record_path=record_path,
                      find_existing=bool(find_existing), backfill=None if backfill is None else tuple(backfill))
        self._status = {"run_id": run_id, "ready": False, "failures": 0, "last_error": None, "dropped": 0,
                        "close_ok": False}
        self._items: list = [("init", config)]
        self._out = b""  # serialized frames not yet written to the pipe
        self._next_send = 0.0
        self._accepting = True
        self._pipe_ok = True
        self._dropped_at_enqueue = 0
        self._result: Optional[bool] = None
        self.proc: Optional[subprocess.Popen] = None
        try:
            process = process or TrackingProcess(uri)
            self.proc, self._status_reader = process.adopt()
            self._send()
        except Exception as e:  # noqa: BLE001 - no tracking is better than no training
            warnings.warn(f"MLflow tracking disabled: could not start the tracking process ({e})", RuntimeWarning,
                          stacklevel=2)
            self._accepting = False
            self._result = False

    # ---- state reported by the tracking process ----
    def _get(self, key: str):
        if self._result is None and time.monotonic() >= self._next_send:
            self._send()  # also reads the status; a crash loses at most feed_seconds of log calls
        else:
            self._poll_status()
        return self._status[key]

    @property
    def run_id(self) -> Optional[str]:
        return self._get("run_id")

    @property
    def ready(self) -> bool:
        """The run exists in the store (created, found or continued) and `run_id` names it."""
        return self._get("ready")

    def wait_for_run(self, timeout: float) -> bool:
        """Waits at most `timeout` seconds for the tracking process to create (or find) the run. Returns
        True once it has, False at once if the store could not be reached (the process keeps retrying
        in the background) or the process is gone, and False at the timeout. Never raises."""
        deadline = time.monotonic() + max(0.0, timeout)
        while self._result is None and self._accepting and self.proc is not None:
            self._send()  # pending log calls (the artifacts) go now; also reads the status
            if self._status["ready"]:
                return True
            if self._status["failures"] or self.proc.poll() is not None:
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                frames = self._status_reader.read(timeout=min(0.1, remaining))
            except (OSError, ValueError, pickle.UnpicklingError):
                return False
            if frames is None:  # the tracking process is gone
                return False
            for frame in frames:
                self._status.update(frame)
        return bool(self._status["ready"])

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
        if not self._accepting:
            return
        if len(self._items) >= MAX_QUEUED_ITEMS:
            self._dropped_at_enqueue += len(metrics)
        else:
            self._items.append(("metrics", (dict(metrics), step, int(time.time() * 1000))))
        if time.monotonic() >= self._next_send:
            self._send()

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        if self._accepting:
            self._items.append(("artifact", (str(path), None if artifact_path is None else str(artifact_path))))
            self._send()

    def set_tags(self, tags: dict[str, str]) -> None:
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
