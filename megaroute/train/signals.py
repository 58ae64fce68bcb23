"""Graceful stop on SIGTERM/SIGUSR1 and the exit codes the Slurm scripts act on."""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_CONFIG_ERROR = 2        # bad config or data: fix the input, do not requeue
EXIT_NONFINITE = 3           # too many consecutive non-finite steps: last good state checkpointed
EXIT_REQUEUE = 75            # stopped by a signal after committing a checkpoint: requeue to resume (EX_TEMPFAIL)


class StopSignal:
    """Records that a stop was requested; the loop agrees on it across ranks at a step boundary.

    `received` is the first signal, `count` how many arrived (a second one escalates, e.g. in
    `sweep run --local`)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS):
        self.signals = signals
        self.received: int | None = None
        self.count = 0
        self._previous = {}

    def install(self) -> "StopSignal":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        self.count += 1

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Asks for a stop as if `signum` had arrived (e.g. the launcher died)."""
        self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None
