"""Run a function on N gloo processes (CPU) and collect what each rank returns.

    results = run_distributed(fn, 2, arg)     # fn(rank, world_size, arg) on each rank -> [r0, r1]

fn must be importable (a module-level function): ranks are spawned, not forked, because a fork of
a process with a live OpenMP pool can hang. Each rank runs single-threaded. Results travel through
torch.save files, so tensors, dicts and lists come back; a rank's exception is re-raised here
with its traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    result: Any
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # reported to the parent, which raises
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_distributed(fn: Callable, world_size: int, *args: Any, env: dict[str, str] | None = None) -> list[Any]:
    """Runs fn(rank, world_size, *args) on world_size gloo ranks; returns the results by rank."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_worker, args=(fn, world_size, _free_port(), out_dir, args), nprocs=world_size, join=True)
            results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in enumerate(results) if status == "error"]
    if errors:
        raise RuntimeError("distributed function failed\n" + "\n".join(errors))
    return [payload for _, payload in results]
