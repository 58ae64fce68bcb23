"""Free TCP ports on 127.0.0.1 for the servers the integration tests start (MLflow, Slurm's daemons,
torchrun's and DeepSpeed's rendezvous)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port nothing is bound to, below the kernel's ephemeral range. A port from that range (what
    binding port 0 returns) can be taken by any outgoing connection in the seconds before the server
    binds it: an MLflow server started by test_slurm.py once lost its port that way ("address already
    in use") while the other xdist worker's jobs were connecting. Below the range only an explicit
    bind can take it, and each candidate is checked by binding it."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
