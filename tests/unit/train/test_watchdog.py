"""Launcher-death detection with real process trees (no training: the child only waits for a stop)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaroute.train.watchdog import LauncherWatchdog, Proc, _stat, launcher_ancestors, launcher_name

# Stands in for a rank: records its launcher ancestors, waits for a stop request, reports how it came.
RANK = """
import json, os, signal, sys, time
from megaroute.train.signals import StopSignal
from megaroute.train.watchdog import LauncherWatchdog
out = sys.argv[1]
stop = StopSignal().install()
watchdog = LauncherWatchdog(stop.request, interval=0.1).start()
with open(out + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "ancestors": [p.pid for p in watchdog.ancestors]}, f)
os.rename(out + ".tmp", out)
deadline = time.monotonic() + 30
while not stop.requested and time.monotonic() < deadline:
    time.sleep(0.05)
watchdog.stop()
stop.uninstall()
with open(out + ".stopped", "w") as f:
    f.write(str(stop.received))
sys.exit(75 if stop.requested else 1)
"""

# Runs its arguments as a child and waits, like a launcher; saved under a launcher's name or not.
FORWARDER = "import subprocess, sys\nsys.exit(subprocess.run(sys.argv[1:]).returncode)\n"


@pytest.mark.parametrize("argv,name", [
    (["/venv/bin/python", "/venv/bin/deepspeed", "--num_gpus", "2", "train.py"], "deepspeed"),
    (["/usr/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=abc", "train.py"],
     "deepspeed.launcher.launch"),
    (["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"], "torch.distributed.run"),
    (["/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"], "torchrun"),
    (["python", "/site-packages/deepspeed/launcher/launch.py", "x"], "launch.py"),
    (["python", "-u", "launcher/pretrain.py", "--local_rank=0", "deepspeed"], None),
    (["python", "-m", "pytest", "torchrun"], None),
    (["/usr/sbin/slurmstepd"], None),
    (["bash", "slurm/pretrain.sh", "--config", "deepspeed"], None),
    ([], None),
])
def test_launcher_name(argv, name):
    assert launcher_name(argv) == name


def test_proc_identity_includes_start_time():
    state, ppid, start = _stat(os.getpid())
    assert ppid == os.getppid() and state not in "ZX"
    assert Proc(os.getpid(), start).alive()
    assert not Proc(os.getpid(), start + 1).alive()  # same pid, another process: a reused pid
    assert launcher_ancestors() == []  # pytest is not launched by a launcher


def _tree(tmp_path: Path, *layers: str) -> tuple[subprocess.Popen, dict]:
    """Starts layers[0] -> layers[1] -> ... -> RANK (each layer a FORWARDER saved under that name)."""
    cmd = []
    for i, name in enumerate(layers):
        script = tmp_path / str(i) / name
        script.parent.mkdir()
        script.write_text(FORWARDER)
        cmd += [sys.executable, str(script)]
    out = tmp_path / "rank.json"
    top = subprocess.Popen([*cmd, sys.executable, "-c", RANK, str(out)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not out.exists():
        assert time.monotonic() < deadline and top.poll() is None, "the rank did not start"
        time.sleep(0.05)
    return top, json.loads(out.read_text())


def _wait_stopped(tmp_path: Path, timeout: float = 10) -> str:
    marker = tmp_path / "rank.json.stopped"
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert time.monotonic() < deadline, "the rank did not notice its launcher's death"
        time.sleep(0.05)
    return marker.read_text()


def _children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_rank_stops_when_a_launcher_grandparent_dies(tmp_path):
    """`deepspeed` runner -> launch (not a launcher here, so no parent-death signal) -> rank: SIGTERM
    to the runner alone (left a zombie: nobody reaps it yet) must still stop the rank."""
    top, rank = _tree(tmp_path, "deepspeed", "launch_wrapper.py")
    others = _children(top.pid)
    try:
        assert rank["ancestors"] == [top.pid]
        os.kill(top.pid, signal.SIGTERM)
        assert _wait_stopped(tmp_path) == str(int(signal.SIGTERM))
    finally:
        _kill_all(others)
        top.kill()
        top.wait()


def test_rank_stops_when_its_launcher_parent_is_killed(tmp_path):
    top, rank = _tree(tmp_path, "torchrun")
    others = _children(top.pid)
    try:
        assert rank["ancestors"] == [top.pid]
        os.kill(top.pid, signal.SIGKILL)
        top.wait()
        assert _wait_stopped(tmp_path) == str(int(signal.SIGTERM))
    finally:
        _kill_all(others)


def test_rank_without_launcher_is_not_watched(tmp_path):
    """Under srun (or a plain `python pretrain.py`) nothing is recorded, and losing the parent stops nothing."""
    top, rank = _tree(tmp_path, "wrapper.py")
    others = _children(top.pid)
    try:
        assert rank["ancestors"] == []
        os.kill(top.pid, signal.SIGKILL)
        top.wait()
        time.sleep(1)
        assert not (tmp_path / "rank.json.stopped").exists()
    finally:
        _kill_all(others)


def test_watchdog_stop_ends_the_thread_without_calling_back():
    calls = []
    me = Proc(os.getpid(), _stat(os.getpid())[2], "self")
    watchdog = LauncherWatchdog(lambda: calls.append(1), interval=0.05, ancestors=[me]).start()
    time.sleep(0.2)
    watchdog.stop()
    assert calls == [] and watchdog._thread is None
