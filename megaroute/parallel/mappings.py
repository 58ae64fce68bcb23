"""Paired autograd collectives for tensor parallelism (each takes its process group explicitly).

    copy_to_tp     forward: identity               backward: all-reduce     (enter a column-parallel region)
    reduce_from_tp forward: all-reduce             backward: identity       (leave a row-parallel region)
    gather_from_tp forward: all-gather last dim    backward: keep own slice (sharded -> replicated)
    scatter_to_tp  forward: keep own slice         backward: all-gather     (replicated -> sharded)

A group of None (or of size 1) makes every function the identity, so TP=1 code paths run
exactly the single-process math. Collectives are written for any device (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def tp_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    # A fresh buffer, never in place on the input: autograd may hand the same grad tensor to
    # several branches (e.g. both operands of an add), and an in-place collective would corrupt them.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(tp_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = tp_size(group)
    if x.shape[-1] % n:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[tp_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if tp_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if tp_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if tp_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if tp_size(group) == 1 else _ScatterToTP.apply(x, group)
