"""Ragged dispatch without padding the token-wise work: the selected tokens of the batch as one flat set.

    rows   = flat indices b * T + t of the selected tokens, row-major     [N], N = total selected
    delta  = the block's update of x.flat[rows], computed on the flat [N, D] rows: norms, projections,
             FFN; attention per sequence (CausalSelfAttention.forward_varlen), each token at its
             original position, attending to the selected tokens of its own sequence up to itself
    out    = x;  out.flat[rows] += weight * delta   (accumulated in float32 or wider, rounded once)

The padded path (dispatch.mask_indices -> gather -> block.update -> combine) runs the whole block on
B x max(count) rows. Here every matmul runs on the N rows; only attention's scores need a per-sequence
layout. On CUDA (fp16/bf16/fp32) that is one varlen kernel over the flat rows (a jagged nested tensor
into torch's flash / memory-efficient SDPA; tests/cuda/test_model_cuda.py holds it to the CPU path).
On CPU, where torch 2.13 has no causal varlen kernel, inference runs megaroute's own
(kernels/cpu.py varlen_attention_forward: each sequence and head at its own length, no padding; bf16
on a float32 copy of the projection). Otherwise (autograd, no kernels) the sequences are sorted by
count into attention.VARLEN_BUCKETS groups, each padded to its longest, with a fixed number of torch
calls whatever the batch (no per-sequence Python loop): padded scores are bounded by the bucketing,
padded projections are gone. Padding rows repeat a real row and follow the real ones, so no real
query attends to them and their outputs are dropped. On CPU (float32, bf16, bf16 autocast) the flat
rows are likewise padded to a multiple of the linears' row bucket (cpu_linear.bucket_rows: oneDNN
builds a primitive per row count, and every batch brings new counts), as one extra sequence of the
last real row repeated.
Without autograd on CPU the update goes back in one pass over x (the kernels' rows_add), where
index_add copies x and then passes over the selected rows again.

tests/unit/model/routing/test_ragged.py holds this path equal to the padded one, forward and
backward, and forward_varlen equal to attention over each sequence alone. Incremental decoding (a
KV cache) keeps the padded path (execute.py).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ...kernels import cpu, cpu_linear
from ..block import TransformerBlock
from ..rope import Positions
from . import dispatch


def mask_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [B, T] bool -> (rows [N]: flat indices of the True entries, row-major; counts [B])."""
    return mask.reshape(-1).nonzero().squeeze(1), mask.sum(dim=1)


def index_rows(idx: torch.Tensor, valid: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded selection (idx [B, k] ascending, valid [B, k]) -> (rows [N], counts [B])."""
    return dispatch.flat_rows(idx, seq_len)[valid.reshape(-1)], valid.sum(dim=1)


def _table_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The selected rows' entries of a layer's rotary table [B, 1, T, Dh/2] (Positions.cos / .sin, already
    looked up for every token) -> [N, 1, 1, Dh/2]: one gather per table, where looking the rows'
    positions up again took a gather of the positions, a copy of their expanded [B, T] and two table
    gathers (hard / dense at 80%, per-round medians in one process: char 0.954 -> 0.942, nanoGPT
    0.873 -> 0.872; bit-identical)."""
    return table.reshape(-1, table.shape[-1]).index_select(0, rows).view(rows.shape[0], 1, 1, table.shape[-1])


def _combine_kernels(flat: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor, weight: Optional[torch.Tensor]):
    """The CPU kernels when they can add the update back (`rows_add`: x copied and the selected rows
    updated in one pass, where index_add copies x and then passes over those rows again): no autograd,
    float32 / bf16 CPU x and delta, contiguous int64 rows (every row too), weight None or float32
    (update_rows casts a 16-bit one); else None (the index_add below). Hard / dense at 80% executed,
    per-round medians in one process (1 thread, the two combines alternating): nanoGPT's shape 0.879
    -> 0.876 (40 rounds), the char shape 0.980 -> 0.972 (80); causal MoD at nanoGPT's shape 0.868 ->
    0.866 (30); the logits bit for bit the same."""
    tensors = [t for t in (flat, delta, weight) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if not (rows.dtype == torch.int64 and rows.is_contiguous()) or weight is not None and not (
            weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()):
        return None
    kernels = cpu.usable(flat) and cpu.usable(delta)
    return kernels if kernels and hasattr(kernels, "rows_add") else None


def _update(block: TransformerBlock, lengths: list[int], x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
    """TransformerBlock._update of the flat rows x [N, D] (block.attn_update, with varlen attention)."""
    a = block.attn(block.attn_norm(x), cos, sin, lengths=lengths)  # CausalSelfAttention.forward_varlen
    return a + block.mlp_update(block.mlp_input(x + a))


def update_rows(block: TransformerBlock, x: torch.Tensor, pos: Positions, rows: torch.Tensor, counts: torch.Tensor,
                weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = x; out.flat[rows] += weight * block.update(x.flat[rows]); weight [N] (None = 1).

    rows row-major (ascending within each sequence), counts [B] of them per sequence. Without a KV
    cache: incremental decoding appends per padded row (execute.update_padded). When every token is
    selected, the block runs on x as a dense layer does (the same values, bit for bit).
    """
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    every = rows.shape[0] == B * T  # every token runs: the block on the batch as it is (no gather, no layout)
    if every:
        delta = block.update(x, pos).reshape(B * T, D)
    else:
        lengths = counts.tolist()  # the one host sync: the attention layout depends on it
        n = rows.shape[0]
        padded = cpu_linear.bucket_rows(n, flat)
        if padded > n:  # CPU (oneDNN's GEMMs): every linear's rows a multiple of its row bucket, without a copy each
            rows = torch.cat([rows, rows[-1:].expand(padded - n)])  # the last real row, repeated, as
            lengths = [*lengths, padded - n]  # a sequence of its own: no real token attends to it
        cos, sin = (_table_rows(t, rows) for t in (pos.cos, pos.sin))
        delta = block.recomputed(partial(_update, block, lengths), flat.index_select(0, rows), cos, sin)
        rows, delta = rows[:n], delta[:n]
    if weight is not None and weight.dtype in (torch.bfloat16, torch.float16):
        # Exact, and the update accumulates in float32 anyway: a bf16 model's MoD weights (its router
        # logits are bf16) then take the one-pass kernel, not casts and index_add (causal MoD's bf16
        # forward at nanoGPT's shape, the two interleaved in one process: 3.6% faster at 80% executed)
        weight = weight.float()
    kernels = _combine_kernels(flat, rows, delta, weight)
    if kernels is not None:
        return kernels.rows_add(flat, rows, delta, weight).view(B, T, D)
    acc = torch.promote_types(torch.float32, torch.promote_types(x.dtype, delta.dtype))
    if weight is not None:
        acc = torch.promote_types(acc, weight.dtype)
        update = weight.to(acc).unsqueeze(-1) * delta.to(acc)
    else:
        update = delta.to(acc)
    if every:  # rows = 0 .. B T - 1: index_add's one add per element, without its row-by-row loop
        return (flat.to(acc) + update).to(x.dtype).view(B, T, D)
    return flat.to(acc).index_add(0, rows, update).to(x.dtype).view(B, T, D)
