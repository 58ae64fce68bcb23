"""Stop a rank whose launcher died.

SIGTERM to the `deepspeed` runner kills only the runner (default handler): its
`deepspeed.launcher.launch` child and the ranks below it train on, orphaned. So each rank records
its launcher ancestors (deepspeed runner/launch, torchrun) at start and a daemon thread polls
them; when one is gone, the rank asks for a stop as SIGTERM would (checkpoint, exit 75).
PR_SET_PDEATHSIG on a launcher parent adds an immediate SIGTERM when that parent dies.
Under srun the parent is slurmstepd and nothing is watched: Slurm signals the tasks itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

# How launchers appear in /proc/PID/cmdline: a `-m` module, or a script (console entry point or file).
LAUNCHER_MODULES = frozenset({"deepspeed.launcher.runner", "deepspeed.launcher.launch", "torch.distributed.run",
                              "torch.distributed.launch"})
LAUNCHER_SCRIPTS = frozenset({"deepspeed", "torchrun"})
LAUNCHER_FILES = ("deepspeed/launcher/runner.py", "deepspeed/launcher/launch.py", "torch/distributed/run.py",
                  "torch/distributed/launch.py")
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Proc:
    """A process identified by pid and start time (clock ticks after boot), so a reused pid is not it."""

    pid: int
    start_time: int
    name: str = ""

    def alive(self) -> bool:
        stat = _stat(self.pid)
        # A zombie (killed, not yet reaped by its parent) is gone for our purpose.
        return stat is not None and stat[2] == self.start_time and stat[0] not in "ZX"


def _stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state, ppid, start time) from /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()  # the command name may contain spaces and ')'
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def launcher_name(argv: list[str]) -> Optional[str]:
    """The launcher a command line runs ("deepspeed", "torch.distributed.run", ...), else None."""
    if not argv:
        return None
    if os.path.basename(argv[0]) in LAUNCHER_SCRIPTS:
        return os.path.basename(argv[0])
    args = iter(argv[1:])
    for arg in args:  # interpreter options up to the module or script
        if arg == "-m":
            module = next(args, "")
            return module if module in LAUNCHER_MODULES else None
        if arg.startswith("-"):
            continue
        if os.path.basename(arg) in LAUNCHER_SCRIPTS or arg.endswith(LAUNCHER_FILES):
            return os.path.basename(arg)
        return None
    return None


def launcher_ancestors(pid: Optional[int] = None) -> list[Proc]:
    """The launcher processes above `pid` (default: this process), nearest first."""
    out = []
    stat = _stat(os.getpid() if pid is None else pid)
    while stat is not None and stat[1] > 1:
        ppid = stat[1]
        stat = _stat(ppid)
        name = launcher_name(_cmdline(ppid))
        if stat is not None and name:
            out.append(Proc(ppid, stat[2], name))
    return out


def _set_parent_death_signal(sig: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


class LauncherWatchdog:
    """Calls `on_death()` once, from a daemon thread, when a recorded launcher ancestor is gone."""

    def __init__(self, on_death: Callable[[], None], interval: float = 1.0,
                 ancestors: Optional[list[Proc]] = None):
        self.on_death = on_death
        self.interval = interval
        self.ancestors = launcher_ancestors() if ancestors is None else ancestors
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._pdeathsig = False

    def start(self) -> "LauncherWatchdog":
        if not self.ancestors:
            return self
        if self.ancestors[0].pid == os.getppid():
            _set_parent_death_signal(signal.SIGTERM)
            self._pdeathsig = True
        self._thread = threading.Thread(target=self._run, name="launcher-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (before the SIGTERM handler goes: a later parent death must not kill mid-exit)."""
        if self._pdeathsig:
            _set_parent_death_signal(0)
            self._pdeathsig = False
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        # The first check is immediate: the parent may have died before PR_SET_PDEATHSIG was set.
        while True:
            gone = next((p for p in self.ancestors if not p.alive()), None)
            if gone is not None:
                print(f"rank {os.environ.get('RANK', '?')}: launcher {gone.name} (pid {gone.pid}) is gone; "
                      "stopping as on SIGTERM", file=sys.stderr, flush=True)
                self.on_death()
                return
            if self._done.wait(self.interval):
                return
