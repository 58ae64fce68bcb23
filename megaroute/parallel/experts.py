"""Expert parallelism: the token exchange between the ranks of an expert-parallel (EP) group.

Each EP rank holds E / ep consecutive experts (rank r: experts [r * E/ep, (r + 1) * E/ep)). A rank's
rows arrive grouped by global expert (the kernels' E-group permutation), so the rows for EP rank r
are one contiguous block; `exchange` sends each block to its rank with one all_to_all_single (gloo
and NCCL both have it), runs the local experts on everything received, and sends the outputs back
with a second all_to_all. Both are torch.distributed.nn's autograd all_to_all, whose backward is the
reverse exchange, so the gradients of the rows (and of the experts, from every rank's tokens) are
those of the single-process layer. A per-(rank, expert) count exchange comes first, so every rank
knows how many rows to expect from each peer for each of its experts.

Expert parameters carry DeepSpeed's MoE marks (`allreduce = False`, `group_name = "ep_size_<ep>"`):
the DeepSpeed engine then averages their gradients over the expert-data-parallel group instead of
the whole data-parallel group (train/engine.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from .mappings import Group

ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]  # (rows grouped by local expert, counts) -> outputs


def group_name(ep: int) -> str:
    """DeepSpeed's name for the expert groups of degree ep (deepspeed.utils.groups)."""
    return f"ep_size_{ep}"


def mark_expert_param(p: nn.Parameter, ep: int) -> nn.Parameter:
    """DeepSpeed's MoE parameter marks (deepspeed.moe.utils.is_moe_param reads `allreduce`)."""
    p.allreduce = False
    p.group_name = group_name(ep)
    return p


def is_expert_param(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False


def _all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return dist_fn.all_to_all_single(out, x.contiguous(), recv, send, group=group)


def exchange(rows: torch.Tensor, counts: torch.Tensor, local_experts: ExpertFn, group: Group) -> torch.Tensor:
    """rows [N, D] grouped by global expert with per-expert `counts` [E] -> each row's expert output
    [N, D'], in the same order, with the experts of EP rank r run on rank r (collective over `group`)."""
    ep = dist.get_world_size(group)
    E = counts.numel()
    per = E // ep
    # How many rows this rank sends to each (rank, local expert), and receives from each.
    send_counts = counts.view(ep, per).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    send = send_counts.sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    got = _all_to_all(rows, recv, send, group)  # [(source, local expert)] blocks
    # Regroup by local expert (one matmul pair each): blocks in (source, expert) -> (expert, source) order.
    blocks = torch.arange(got.shape[0], device=rows.device).split(recv_counts.flatten().tolist())
    order = torch.cat([blocks[s * per + e] for e in range(per) for s in range(ep)])
    out = local_experts(got.index_select(0, order), recv_counts.sum(0).tolist())
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=rows.device))
    return _all_to_all(out.index_select(0, back), send, recv, group)


__all__ = ["exchange", "group_name", "is_expert_param", "mark_expert_param"]
