"""Process environment: rank/world from torchrun, the deepspeed launcher or srun; device choice.

Must run before `import deepspeed`: DeepSpeed picks its accelerator at import time, so a
CPU-only machine needs DS_ACCELERATOR=cpu set first.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# DeepSpeed's CPU all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp) maps one buffer per local rank,
# named from the uid and the rendezvous address; it never unlinks them.
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" on GPUs, "gloo" on CPU
    device: str
    # Variables detect_env() set itself (single process): release() removes them again, so an
    # in-process run leaves no RANK/MASTER_PORT behind for the next library that looks (accelerate).
    added_env: tuple[str, ...] = ()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def detect_env() -> DistEnv:
    """Reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun, deepspeed) or Slurm's task variables (srun).

    Under srun the torch.distributed variables are filled in from Slurm's so that one code
    path initializes the process group; MASTER_ADDR/PORT come from the sbatch script.
    """
    if "RANK" not in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        _env_from_srun()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    added = []
    if world == 1:
        # A single process still needs a (trivial) process group for DeepSpeed.
        defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        for key, value in defaults.items():
            if key not in os.environ:
                os.environ[key] = value
                added.append(key)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
            added.append("MASTER_PORT")
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        # DeepSpeed JIT-builds its CPU comm op here: one build per environment. A shared
        # ~/.cache/torch_extensions is rebuilt on every launch when several venvs take turns.
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")
        added.append("TORCH_EXTENSIONS_DIR")
    if _cuda_available():
        return DistEnv(rank, world, local_rank, "nccl", f"cuda:{local_rank}", tuple(added))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return DistEnv(rank, world, local_rank, "gloo", "cpu", tuple(added))


def release(env: DistEnv) -> None:
    """Ends an in-process run: destroys the process group and removes the variables detect_env added."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    unlink_shm_buffer(env)  # normally gone already (see unlink_shm_buffer); this covers a failed start
    for key in env.added_env:
        os.environ.pop(key, None)


def shm_buffer_path(env: DistEnv) -> str:
    """The /dev/shm file DeepSpeed's CPU comm op creates for this rank (when all ranks are local)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return os.path.join(SHM_DIR, f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{env.rank}")


def unlink_shm_buffer(env: DistEnv) -> None:
    """Removes this rank's shared-memory buffer name; the mappings stay valid until exit.

    Safe once every rank has mapped every peer's buffer (i.e. after a barrier that follows
    deepspeed.init_distributed): unlinking then means no exit path, not even SIGKILL, leaves
    66 MiB per rank behind in /dev/shm.
    """
    if env.backend != "gloo":
        return
    try:
        os.unlink(shm_buffer_path(env))
    except FileNotFoundError:
        pass


def _env_from_srun() -> None:
    """Maps an srun task's variables to torch.distributed's.

    SLURM_STEP_NUM_TASKS is only set inside a job step: the batch shell of an `sbatch -n 8`
    job has SLURM_NTASKS=8 and SLURM_PROCID=0 too, and must stay a single process.
    """
    world = int(os.environ["SLURM_STEP_NUM_TASKS"])
    if world == 1:
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"srun task without {' and '.join(missing)}: launch through slurm/pretrain.sh, which "
                           "derives them from the node list and the job id, or export them before srun")
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    per_node = _tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = int(os.environ.get("SLURM_NODEID", "0"))
    if node < len(per_node):
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(per_node[node]))


def _tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, repeat = part.partition("(x")
        out += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
