"""The one compute step every routed layer shares: gather -> block.update -> combine.

    out = x;  out[b, idx[b, j]] += weight[b, j] * block.update(x[b, idx], positions[b, idx])

Tokens keep their original positions (RoPE and the causal mask in index order), the residual is
added exactly once, and padded rows of a ragged selection (valid = False) contribute nothing.

Ragged selections (a mask, or idx with `valid`) run without padding (ragged.py: the selected
tokens of the whole batch as one flat set, attention per sequence), so their cost follows the
tokens that run, not B x the largest count. Fixed-k selections (valid None) and incremental
decoding (a KV cache, whose appends are per padded row) take the padded path, `update_padded`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...parallel import collectives
from ..block import TransformerBlock
from ..rope import Positions
from . import dispatch, ragged
from .dispatch import Dispatcher


def update_padded(block: TransformerBlock, x: torch.Tensor, pos: Positions, idx: torch.Tensor,
                  weight: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None, *,
                  dispatcher: Dispatcher, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """update_selected through the gather/combine dispatcher, every row padded to k; `rows`: x's
    selected rows [B, k, D] when the caller gathered them already (MoD's router node, mod._RouteTopkGather)."""
    if idx.shape[1] == 0 and may_skip_block(block):
        return x
    delta = block.update(dispatcher.gather(x, idx) if rows is None else rows, pos.select(idx, valid))
    return combine_padded(x, idx, weight, valid, delta, dispatcher=dispatcher)


def combine_padded(x: torch.Tensor, idx: torch.Tensor, weight: Optional[torch.Tensor], valid: Optional[torch.Tensor],
                   delta: torch.Tensor, *, dispatcher: Dispatcher) -> torch.Tensor:
    """out = x;  out[b, idx[b, j]] += weight[b, j] * delta[b, j] (weight None = 1), padded rows
    (valid False) contributing nothing."""
    if weight is None:
        weight = torch.ones(idx.shape, dtype=delta.dtype, device=delta.device)
    if valid is not None:
        # Zero both factors: 0 * (a non-finite padded delta) would still be NaN.
        weight = torch.where(valid, weight, torch.zeros_like(weight))
        delta = torch.where(valid.unsqueeze(-1), delta, torch.zeros_like(delta))
    return dispatcher.combine(x, idx, weight, delta)


def may_skip_block(block: TransformerBlock) -> bool:
    """Whether a routed layer whose selection is empty may skip its block altogether: without grad, in
    one process, its parameters not partitioned by ZeRO-3 (`ds_id`: its hooks trace the modules each
    forward runs and prefetch by that trace). Otherwise k = 0 still runs the block, on no tokens: a
    module skipped on one rank only would leave ZeRO-3's parameter all-gathers and expert parallelism's
    all-to-alls out of step and hang the others, and parameters must get their (zero) gradients. On no
    rows a block's ~100 ops cost what they cost on one token, so a one-token decoding step paid for the
    block its token skipped (CPU; on a GPU such a step runs one padded row: dispatch.one_token_gpu_step)."""
    return (not torch.is_grad_enabled() and not collectives.is_distributed()
            and not hasattr(next(block.parameters()), "ds_id"))


def update_selected(block: TransformerBlock, x: torch.Tensor, pos: Positions, idx: torch.Tensor,
                    weight: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None, *,
                    dispatcher: Dispatcher, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """idx [B, k] ascending (padding after the real rows); weight [B, k] (None = 1); valid [B, k] or None;
    rows: x's selected rows [B, k, D] if already gathered (fixed-k selections only: valid None)."""
    if rows is not None and valid is not None:
        raise ValueError("update_selected: pre-gathered rows are for fixed-k selections (valid None)")
    if valid is None or pos.kv is not None:
        return update_padded(block, x, pos, idx, weight, valid, dispatcher=dispatcher, rows=rows)
    rows, counts = ragged.index_rows(idx, valid, x.shape[1])
    if rows.shape[0] == 0 and may_skip_block(block):
        return x
    return ragged.update_rows(block, x, pos, rows, counts, None if weight is None else weight[valid])


def update_masked(block: TransformerBlock, x: torch.Tensor, pos: Positions, mask: torch.Tensor,
                  weight: Optional[torch.Tensor] = None, *, dispatcher: Dispatcher) -> torch.Tensor:
    """Ragged selection: runs the block for tokens where mask [B, T] is True; weight is [B, T] or None."""
    if pos.kv is not None:
        return update_masked_padded(block, x, pos, mask, weight, dispatcher=dispatcher)
    rows, counts = ragged.mask_rows(mask)
    if rows.shape[0] == 0 and may_skip_block(block):
        return x
    return ragged.update_rows(block, x, pos, rows, counts,
                              None if weight is None else weight.reshape(-1).index_select(0, rows))


def update_masked_padded(block: TransformerBlock, x: torch.Tensor, pos: Positions, mask: torch.Tensor,
                         weight: Optional[torch.Tensor] = None, *, dispatcher: Dispatcher) -> torch.Tensor:
    """update_masked through the padded path (every row padded to the batch's largest count): the one
    the KV cache takes, and the reference the ragged path is tested against."""
    idx, valid = dispatch.mask_indices(mask)
    weight = None if weight is None else weight.gather(1, idx)
    return update_padded(block, x, pos, idx, weight, valid, dispatcher=dispatcher)


def run_topk_forward(layer, x: torch.Tensor, pos: Positions, *args):
    """layer.topk_forward(x, pos, *args): the layer's training-time ("topk" mode) forward as one function,
    through its torch.compile'd twin when Transformer.compile_blocks set `layer.compiled_topk` and
    the block does not checkpoint activations (checkpointing stays outside compiled graphs)."""
    compiled = layer.compiled_topk is not None and not layer.block.checkpoint_activations
    return (layer.compiled_topk if compiled else type(layer).topk_forward)(layer, x, pos, *args)

