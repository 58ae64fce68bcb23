"""Bookkeeping collectives: loss sums, stop and non-finite flags, metric means, barriers.

NCCL reduces only CUDA tensors and gloo only CPU ones ("No backend type associated with device
type cpu"), so every tensor built here from host numbers is placed on the device the caller names
(the engine's). Outside `megaroute/parallel/` no module calls a `torch.distributed` collective
directly (a test over the package source enforces it): they come here, or to the autograd
collectives of `mappings.py`. Results come back to the host with one copy per call.

With no process group (a single process, unit tests) every function is the identity.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def is_distributed(group: Group = None) -> bool:
    """True when a process group is up and `group` (default: the world) has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """In-place all-reduce of a tensor that already lives on the collective's device."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    if is_distributed(group):
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_reduce(values: Union[Sequence[float], torch.Tensor], device: Union[str, torch.device], op: str = "sum",
               group: Group = None) -> torch.Tensor:
    """Reduces host numbers or a tensor on `device` (float64) and returns the result there.

    `device` is explicit because the right one depends on the backend, not on where the values
    happen to be: the engine's device (cuda:N under NCCL, cpu under gloo).
    """
    t = torch.as_tensor(values, dtype=torch.float64).to(device, copy=True)
    return all_reduce_(t, op, group)


def barrier(group: Group = None) -> None:
    if not is_distributed(group):
        return
    if dist.get_backend(group) == "nccl":
        # Without device_ids NCCL guesses the device from the rank and warns; name the one in use.
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Group = None) -> Any:
    """Rank `src`'s picklable `obj` on every rank (NCCL stages it through the current CUDA device)."""
    if not is_distributed(group):
        return obj
    box = [obj]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]
