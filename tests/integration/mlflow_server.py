"""A real `mlflow server` on 127.0.0.1 for tests, and a teardown that leaves nothing behind.

`mlflow server` starts uvicorn workers and a job runner whose Huey consumers run in its process
group, but job subprocesses are started with `start_new_session=True` (outside it), and the job
queue lives in a fresh /dev/shm/tmpXXXX directory. So the server is started in its own session,
every process it starts carries a marker in its environment, and `stop()` kills, by id:
the server's process group, every descendant seen while it ran, and every process carrying the
marker or naming this server's directory or port in its command line; then it checks that none
is left and removes the Huey storage directory.

    with MlflowServer(tmp_path) as server:      # or server.start(); server.wait_ready(); server.stop()
        MlflowClient(server.uri) ...
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Optional

import psutil

from .ports import free_port

BIN = Path(sys.executable).parent
MARKER = "MEGAROUTE_TEST_MLFLOW_SERVER"
HUEY_ENV = "_MLFLOW_HUEY_STORAGE_PATH"


class MlflowServer:
    def __init__(self, workdir: Path, port: Optional[int] = None, workers: int = 1):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self._port_chosen = port is None  # a port we chose may be moved if it is lost before the bind
        self.workers = workers
        self.token = uuid.uuid4().hex
        self.db = self.workdir / "server.db"
        self.artifacts = self.workdir / "artifacts"
        self.log = self.workdir / "server.log"
        self.proc: Optional[subprocess.Popen] = None
        self._seen: dict[int, float] = {}  # pid -> create_time of every process of ours observed
        self._shm_dirs: set[str] = set()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- lifecycle ----
    def start(self) -> "MlflowServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.db}", "--host", "127.0.0.1",
               "--port", str(self.port), "--artifacts-destination", str(self.artifacts),
               "--workers", str(self.workers)]
        env = {**os.environ, MARKER: self.token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300, rebinds: int = 3) -> "MlflowServer":
        """Blocks until GET /health answers 200 (startup takes 20-90 s on a busy 2-core machine). A
        server whose chosen port was taken before it bound it ("address already in use") is started
        again on another port, up to `rebinds` times; read `uri` after this returns."""
        deadline = time.monotonic() + timeout
        last_observed = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() - last_observed > 3:
                self._observe()
                last_observed = time.monotonic()
            if self.proc.poll() is not None:
                if self._port_chosen and rebinds > 0 and "address already in use" in self.output():
                    rebinds -= 1
                    self.port = free_port()
                    self.start()
                    continue
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            if self.healthy():
                self._observe()
                return self
            time.sleep(0.5)
        raise TimeoutError(f"mlflow server not healthy after {timeout:.0f}s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __enter__(self) -> "MlflowServer":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- finding and stopping every process it started ----
    def _ours(self, p: psutil.Process) -> bool:
        """Carries our marker, or names our directory or port (never matches processes of other tests)."""
        try:
            if p.environ().get(MARKER) == self.token:
                return True
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            pass
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            return False
        return str(self.workdir) in cmd or (("mlflow" in cmd or "uvicorn" in cmd) and f"--port {self.port}" in cmd)

    def processes(self) -> list[psutil.Process]:
        """Live processes this server started, wherever they are now (group, session or reparented)."""
        found: dict[int, psutil.Process] = {}
        if self.proc is not None:
            try:
                root = psutil.Process(self.proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    found[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter():
            if p.pid == os.getpid() or p.pid in found:
                continue
            if self._group_member(p.pid) or self._ours(p):
                found[p.pid] = p
        for pid, created in list(self._seen.items()):  # descendants seen earlier, maybe reparented since
            if pid not in found:
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created:
                        found[pid] = p
                except psutil.NoSuchProcess:
                    pass
        alive = []
        for p in found.values():
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def _group_member(self, pid: int) -> bool:
        if self.proc is None:
            return False
        try:
            return os.getpgid(pid) == self.proc.pid or os.getsid(pid) == self.proc.pid
        except OSError:
            return False

    def _observe(self) -> None:
        """Remembers every current descendant (and the Huey storage dir) while the tree is intact."""
        for p in self.processes():
            try:
                self._seen.setdefault(p.pid, p.create_time())
                shm = p.environ().get(HUEY_ENV)
                if shm:
                    self._shm_dirs.add(shm)
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
                pass

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM everything, SIGKILL what is left after `grace`, verify nothing remains."""
        if self.proc is None:
            return
        self._observe()
        procs = self.processes()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=grace)
        for attempt in range(20):  # anything still alive, or started while we were stopping it
            left = self.processes()
            if not left:
                break
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for p in left:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(left, timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for d in self._shm_dirs:
            if os.path.basename(d).startswith("tmp"):
                shutil.rmtree(d, ignore_errors=True)
        left = self.processes()
        if left:
            raise RuntimeError(f"mlflow server processes survived stop(): {[(p.pid, p.name()) for p in left]}")
