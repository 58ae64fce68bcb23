"""Tensor-parallel layers (Megatron-style), each given its TP process group explicitly.

    ColumnParallelLinear    W [out, in] split by output rows: replicated in -> sharded out
    RowParallelLinear       W [out, in] split by input columns: sharded in -> replicated out (all-reduce)
    VocabParallelEmbedding  table split by vocab rows; each rank looks up its range, then all-reduce
    vocab_parallel_cross_entropy   CE over vocab-sharded logits without gathering them

Initialization builds the FULL master weight from the current RNG, then keeps this rank's slice
(`init_weight_`), so a model built from one seed is the same model at every TP size. The
construction-time default init draws exactly what nn.Linear / nn.Embedding draw, so the RNG stream
of everything built after a parallel layer is unchanged too. With group None (or size 1) each layer
computes what its plain counterpart computes: exactly with `fused = False` (Transformer.set_fused), to
float32 rounding by default, where float32 CPU linears run their GEMMs through oneDNN
(kernels/cpu_linear.py: a different summation order, 2x MKL's sgemm on AMD CPUs). Sharded parameters carry
`tensor_model_parallel = True`, which DeepSpeed reads to count them once per TP group in grad norms.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu, cpu_linear
from .mappings import Group, copy_to_tp, gather_from_tp, reduce_from_tp, tp_rank, tp_size

InitFn = Callable[[torch.Tensor], object]


def shard_dim(full: torch.Tensor, dim: int, rank: int, world: int, chunks: int = 1) -> torch.Tensor:
    """This rank's slice of `full` along `dim`. With chunks > 1 the dim is a concatenation of
    `chunks` logical blocks (q|k|v, gate|up), and each block is split separately, so every rank
    holds a matching slice of each block."""
    blocks = full.chunk(chunks, dim=dim)
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in blocks], dim=dim)


def _check_divisible(size: int, by: int, what: str) -> None:
    if size % by:
        raise ValueError(f"{what}={size} is not divisible by {by} (tensor-parallel size x chunks)")


def _mark(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tensor_model_parallel = True
    p.partition_dim = dim
    return p


def _linear_default_init(weight: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's default


class TensorParallelModule(nn.Module):
    """Shared init logic: a module whose `weight` is a slice of a full tensor of `full_shape`."""

    group: Group
    weight: nn.Parameter
    full_shape: tuple[int, ...]
    shard_dim: int
    chunks: int = 1

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return shard_dim(full, self.shard_dim, tp_rank(self.group), tp_size(self.group), self.chunks)

    @torch.no_grad()
    def init_weight_(self, init_fn: InitFn) -> None:
        """Draws the full weight with init_fn (same RNG consumption as TP=1), keeps the local slice."""
        if self.weight.is_meta:
            return  # no values to draw (and torch's meta normal_ imports torch._dynamo: ~1.4 s)
        if tp_size(self.group) == 1:
            init_fn(self.weight)
            return
        full = torch.empty(self.full_shape, dtype=self.weight.dtype, device=self.weight.device)
        init_fn(full)
        self.weight.copy_(self.shard(full))


class ColumnParallelLinear(TensorParallelModule):
    """y = x W^T (+ b), output features split across TP ranks.

    Input is replicated (its gradient is all-reduced in backward); output is this rank's feature
    slice, or the full output with gather_output=True. `chunks` splits fused projections block by
    block: qkv [3d, d] with chunks=3 gives each rank its heads' q, k and v.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group: Group = None,
                 chunks: int = 1, gather_output: bool = False):
        super().__init__()
        self.group, self.chunks, self.gather_output = group, chunks, gather_output
        self.in_features, self.out_features = in_features, out_features
        tp = tp_size(group)
        _check_divisible(out_features, tp * chunks, "out_features")
        self.full_shape, self.shard_dim = (out_features, in_features), 0
        self.fused = True  # float32 CPU GEMMs through oneDNN (kernels/cpu_linear.py); False: F.linear
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp)) if bias else None
        if tp > 1:
            _mark(self.weight, 0)
            if self.bias is not None:
                _mark(self.bias, 0)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.init_weight_(_linear_default_init)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            full = torch.empty(self.out_features, device=self.bias.device, dtype=self.bias.dtype)
            full.uniform_(-bound, bound)
            self.bias.copy_(shard_dim(full, 0, tp_rank(self.group), tp_size(self.group), self.chunks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_linear.linear(copy_to_tp(x, self.group), self.weight, self.bias, self.fused)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={tp_size(self.group)}, chunks={self.chunks}, bias={self.bias is not None}")


class RowParallelLinear(TensorParallelModule):
    """y = x W^T (+ b), input features split across TP ranks; partial products are all-reduced,
    so the output is replicated. The bias (replicated) is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group: Group = None):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        tp = tp_size(group)
        _check_divisible(in_features, tp, "in_features")
        self.full_shape, self.shard_dim = (out_features, in_features), 1
        self.fused = True  # as ColumnParallelLinear's
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if tp > 1:
            _mark(self.weight, 1)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.init_weight_(_linear_default_init)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            self.bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(cpu_linear.linear(x, self.weight, fused=self.fused), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={tp_size(self.group)}, bias={self.bias is not None}")


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding table split by vocabulary rows; rank r owns ids [r*V/tp, (r+1)*V/tp).

    Each rank embeds the ids in its range (zeros elsewhere) and the all-reduce assembles the
    replicated result."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group = None):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        tp = tp_size(group)
        _check_divisible(num_embeddings, tp, "num_embeddings")
        self.per_rank = num_embeddings // tp
        self.vocab_start = tp_rank(group) * self.per_rank
        self.full_shape, self.shard_dim = (num_embeddings, embedding_dim), 0
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        if tp > 1:
            _mark(self.weight, 0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_weight_(nn.init.normal_)  # nn.Embedding's default

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={tp_size(self.group)}"


class _VocabParallelCE(torch.autograd.Function):
    """Per-token CE from vocab-sharded logits [N, V/tp]: two all-reduces of [N]-sized tensors
    (max, then target logit + sum of exp) instead of gathering [N, V] logits."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start):
        ctx.dtype = logits.dtype
        logits = logits.float()
        v_local = logits.shape[-1]
        logits_max = logits.amax(dim=-1)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local = targets - vocab_start
        inside = (local >= 0) & (local < v_local)
        local = local.masked_fill(~inside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        dist.all_reduce(sums, group=group)  # one collective for both
        target_logit, sum_exp = sums[0], sums[1]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, inside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()  # d loss / d logits = softmax - onehot(target), onehot only on the owner rank
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group = None,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy (fp32) of logits [..., V/tp] (this rank's vocab slice) against targets [...].

    reduction "none" returns the per-token loss with targets' shape; "mean" its mean. With TP=1 it
    is F.cross_entropy on the float32 logits.
    """
    if reduction not in ("none", "mean"):
        raise ValueError(f"reduction must be 'none' or 'mean', got {reduction!r}")
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if tp_size(group) == 1:
        loss = F.cross_entropy(flat_logits.float(), flat_targets, reduction=reduction)
        return loss if reduction == "mean" else loss.view(targets.shape)
    loss = _VocabParallelCE.apply(flat_logits, flat_targets, group, tp_rank(group) * logits.shape[-1])
    return loss.mean() if reduction == "mean" else loss.view(targets.shape)


def parallel_argmax(logits: torch.Tensor, group: Group = None) -> torch.Tensor:
    """argmax over the full vocabulary of vocab-sharded logits [..., V/tp], without gathering them.

    Ties go to the lowest id, as torch.argmax does on the full tensor (NaN counts as the maximum).
    On CPU, float32 / bf16 logits take the fused kernel (kernels/cpu.py row_argmax) and others
    max(dim).indices, the same index: torch's CPU argmax is a scalar loop (at [2048, 8192], 2
    threads: 20 ms float32, 27 ms bf16; max(dim) 7-8 ms; the kernel ~1 ms).
    """
    if tp_size(group) == 1:
        kernels = cpu.usable(logits) if logits.dim() and logits.shape[-1] else None
        if kernels is not None:
            return kernels.row_argmax(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
        return logits.max(dim=-1).indices
    values, idx = logits.max(dim=-1)
    ids = idx + tp_rank(group) * logits.shape[-1]
    n = tp_size(group)
    vs = [torch.empty_like(values) for _ in range(n)]
    dist.all_gather(vs, values.contiguous(), group=group)
    is_ = [torch.empty_like(ids) for _ in range(n)]
    dist.all_gather(is_, ids.contiguous(), group=group)
    best = torch.stack(vs).argmax(dim=0)  # first max = lowest rank = lowest id on ties
    return torch.stack(is_).gather(0, best.unsqueeze(0)).squeeze(0)


def shard_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full (TP=1) weights -> this rank's slices for every sharded tensor of `model`, so a
    tensor-parallel model can load a single-process checkpoint. Other entries pass through."""
    out = dict(state)
    for prefix, module in model.named_modules():
        if not isinstance(module, TensorParallelModule) or tp_size(module.group) == 1:
            continue
        for pname in ("weight", "bias"):
            key = f"{prefix}.{pname}" if prefix else pname
            param = getattr(module, pname, None)
            if key not in out or not getattr(param, "tensor_model_parallel", False):
                continue
            full_shape = module.full_shape if pname == "weight" else module.full_shape[:1]
            if tuple(out[key].shape) != tuple(full_shape):
                raise ValueError(f"{key}: expected the full shape {tuple(full_shape)}, got {tuple(out[key].shape)} "
                                 "(a tensor-parallel slice?)")
            out[key] = module.shard(out[key]) if pname == "weight" else shard_dim(
                out[key], 0, tp_rank(module.group), tp_size(module.group), module.chunks)
    return out


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelModule", "VocabParallelEmbedding",
           "gather_from_tp", "parallel_argmax", "shard_dim", "shard_full_state_dict", "vocab_parallel_cross_entropy"]
