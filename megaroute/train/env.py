"""Process environment: rank/world from torchrun, the deepspeed launcher or srun; device choice.

Must run before `import deepspeed`: DeepSpeed picks its accelerator at import time, so a
CPU-only machine needs DS_ACCELERATOR=cpu set first.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" on GPUs, "gloo" on CPU
    device: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def detect_env() -> DistEnv:
    """Reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun, deepspeed) or SLURM_PROCID/NTASKS/LOCALID (srun).

    Under srun the torch.distributed variables are filled in from Slurm's so that one code
    path initializes the process group; MASTER_ADDR/PORT come from the sbatch script.
    """
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1:
        # A single process still needs a (trivial) process group for DeepSpeed.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if _cuda_available():
        return DistEnv(rank, world, local_rank, "nccl", f"cuda:{local_rank}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return DistEnv(rank, world, local_rank, "gloo", "cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
