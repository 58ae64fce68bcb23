"""Ragged dispatch without padding the token-wise work: the selected tokens of the batch as one flat set.

    rows   = flat indices b * T + t of the selected tokens, row-major     [N], N = total selected
    delta  = the block's update of x.flat[rows]: attention on the rows scattered to a [B, max count]
             layout (each token at its original position), the FFN and its norm on the flat [N, D]
    out    = x;  out.flat[rows] += weight * delta   (accumulated in float32 or wider, rounded once)

The padded path (dispatch.mask_indices -> gather -> block.update -> combine) runs the whole block
on B x max(count) rows. Here only attention does (block.attn_update, the block's own module, so
the layer computes exactly what the block computes: fused kernels, tensor parallelism): the rows
are laid out in [B, max(count)] slots in row-major order, so each sequence's tokens stay
ascending (index order is causal order) and its padding rows follow the real ones and are never
their keys; attention's output is gathered straight back to the N rows. The FFN, two thirds of a
SwiGLU block's matmul FLOPs, runs on N rows. With tokens chosen evenly over the batch (80%,
B = 8, T = 256) attention's padding is ~5% of its rows; when sequences differ widely in count
(one runs every token) attention pays for B x T rows, the rest for N (python -m
megaroute.bench.dispatch shows both). Projecting q/k/v and the output on the N rows instead
(attention's math repeated here) measured no faster (one layer, d 384, B 8, T 256, spread 80%:
0.91 vs 0.87 of dense; d 128: 0.80 vs 0.80): what spread selections cost is the padded scores.
One SDPA per sequence would avoid them, at the price of a Python loop over the batch.

tests/unit/model/routing/test_ragged.py holds this path equal to the padded one, forward and
backward. Incremental decoding (a KV cache) keeps the padded path (execute.py).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ..block import TransformerBlock
from ..rope import Positions


def mask_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [B, T] bool -> (rows [N]: flat indices of the True entries, row-major; counts [B])."""
    return mask.reshape(-1).nonzero().squeeze(1), mask.sum(dim=1)


def index_rows(idx: torch.Tensor, valid: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded selection (idx [B, k] ascending, valid [B, k]) -> (rows [N], counts [B])."""
    offsets = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1) * seq_len
    return (idx + offsets)[valid], valid.sum(dim=1)


class Slots:
    """Where each of the N flat rows sits in a [B, kmax] padded layout (row-major, real rows first)."""

    def __init__(self, rows: torch.Tensor, counts: torch.Tensor, seq_len: int):
        self.B, self.N = counts.shape[0], rows.shape[0]
        self.kmax = int(counts.max()) if self.B else 0  # the one host sync: buffer sizes depend on it
        seq = torch.div(rows, seq_len, rounding_mode="floor")
        starts = counts.cumsum(0) - counts  # first flat row of each sequence
        self.slot = seq * self.kmax + torch.arange(self.N, device=rows.device) - starts[seq]  # [N]
        # Each padded slot reads a real row: its own, or for padding its sequence's last one (any
        # finite row would do: padding follows the real rows, so no real row attends to it, and its
        # outputs are dropped, so it gets no gradient). A gather is ~4x faster than index_copy on CPU.
        j = torch.arange(self.kmax, device=rows.device).unsqueeze(0)
        self.source = (starts.unsqueeze(1) + torch.minimum(j, (counts - 1).clamp(min=0).unsqueeze(1))
                       ).clamp(max=max(self.N - 1, 0)).reshape(-1)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, kmax, ...]; padding rows repeat real ones (zeros when N = 0)."""
        if self.N == 0:
            return flat.new_zeros((self.B, self.kmax, *flat.shape[1:]))
        return flat.index_select(0, self.source).view(self.B, self.kmax, *flat.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, kmax, ...] -> the N real rows [N, ...]."""
        return padded.reshape(self.B * self.kmax, *padded.shape[2:]).index_select(0, self.slot)


def _update(block: TransformerBlock, slots: Slots, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
    """TransformerBlock._update of the flat rows x [N, D]: attention on their padded layout."""
    a = slots.unpad(block.attn_update(slots.pad(x), cos, sin))
    return a + block.mlp_update(block.mlp_input(x + a))


def update_rows(block: TransformerBlock, x: torch.Tensor, pos: Positions, rows: torch.Tensor, counts: torch.Tensor,
                weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = x; out.flat[rows] += weight * block.update(x.flat[rows]); weight [N] (None = 1).

    rows row-major (ascending within each sequence), counts [B] of them per sequence. Without a KV
    cache: incremental decoding appends per padded row (execute.update_padded).
    """
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    slots = Slots(rows, counts, T)
    sel = Positions(pos.rope, slots.pad(pos.positions.reshape(B * T).index_select(0, rows)))
    delta = block.recomputed(partial(_update, block, slots), flat.index_select(0, rows), sel.cos, sel.sin)
    acc = torch.promote_types(torch.float32, torch.promote_types(x.dtype, delta.dtype))
    if weight is not None:
        acc = torch.promote_types(acc, weight.dtype)
        update = weight.to(acc).unsqueeze(-1) * delta.to(acc)
    else:
        update = delta.to(acc)
    return flat.to(acc).index_add(0, rows, update).to(x.dtype).view(B, T, D)
