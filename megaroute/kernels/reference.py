"""Pure-PyTorch token dispatch: the semantics every fused kernel must reproduce.

Shapes: x [B, T, D] hidden states; idx [B, k] token positions, unique within a row (top-k and
mask_indices produce such rows); g [B, k] per-token weights; delta [B, k, D] updates.

    gather(x, idx)                   -> x[b, idx[b, j]]                          [B, k, D]
    combine(x, idx, g, delta)        -> out = x;  out[b, idx[b, j]] += g[b, j] * delta[b, j]
    path_slots(full)                 -> slot [B, T], n_full: each token's row in a buffer that
                                        holds the full-path tokens first, then the cheap ones
    permute(x, slot)                 -> xs [B*T, D] with xs[slot[b, t]] = x[b, t]
    unpermute(h, slot, w, yf, yc)    -> h + w[..., None] * cat(yf, yc)[slot]

The same permutation for E groups (Mixture-of-Experts dispatch), on flat token rows; a token may sit
in several groups (top-k > 1), so the buffer holds M assignment rows, not N tokens:

    group_rows(sel)                  -> src [M], counts [E]: sel [N, E] bool; the buffer's rows grouped
                                        by expert in expert order, tokens in order within a group
    permute_groups(x, src)           -> x[src]                                    [M, D]
    unpermute_groups(h, src, w, y)   -> out = h;  out[src[m]] += w[m] * y[m]      [N, D]

path_slots/permute/unpermute are the E = 2, one-group-per-token case (tests/unit/kernels).

Updates are computed in float32 (float64 if an input is float64) and rounded once to x's dtype;
rows that receive no update are x bit for bit. Everything here is differentiable by autograd (gradcheck runs on it in float64).
"""

from __future__ import annotations

import torch

from . import functions


def _acc(*tensors: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or wider if an input is wider."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def flat_rows(idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """idx [B, k] positions -> [B * k] row indices b * seq_len + idx[b, j] of the flat [B * T, D] view."""
    return (idx + torch.arange(idx.shape[0], device=idx.device).unsqueeze(1) * seq_len).reshape(-1)


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    # Whole rows of the flat [B * T, D] view (index_select): x.gather(1, idx expanded over D)'s values
    # and gradient, without CPU's element-wise gather kernel that reads the index for every element
    # (MoD's gather at nanoGPT's shape, 8 x 256 x 384, k = 32, 2 threads: forward 55 -> 14 us,
    # forward + backward 179 -> 96 us). Its backward saves only the index, as gather's does.
    B, T, D = x.shape
    return x.reshape(B * T, D).index_select(0, flat_rows(idx, T)).view(B, idx.shape[1], D)


def combine(x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return functions.apply(_Combine, x, flat_rows(idx, x.shape[1]), g, delta)


class _Combine(torch.autograd.Function):
    """combine on whole rows of the flat [B * T, D] view: x.to(acc).scatter_add(1, idx expanded over D,
    g * delta)'s values and gradients (the upcast is a no-op for float32 x and keeps 16-bit x to a
    single rounding). x's gradient is grad_out itself (no copy), as scatter_add's; g's and delta's
    read grad_out's selected rows with index_select, where scatter_add's backward ran CPU's element-wise
    gather (95 us for MoD's [8, 32, 384] at nanoGPT's shape, bf16 training). It saves the index, g and
    delta, where autograd's product saved a float32 copy of delta."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, g: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        acc = _acc(x, g, delta)
        update = (g.to(acc).unsqueeze(-1) * delta.to(acc)).reshape(-1, D)
        ctx.save_for_backward(rows, g, delta)
        ctx.dtypes = acc, x.dtype
        return x.reshape(B * T, D).to(acc).index_add(0, rows, update).to(x.dtype).view(B, T, D)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, g, delta = ctx.saved_tensors
        acc, x_dtype = ctx.dtypes
        grad = grad_out.to(acc)
        picked = grad.reshape(-1, grad.shape[-1]).index_select(0, rows).view(delta.shape)
        grad_x = grad.to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_g = (picked * delta.to(acc)).sum(-1).to(g.dtype) if ctx.needs_input_grad[2] else None
        grad_delta = (picked * g.to(acc).unsqueeze(-1)).to(delta.dtype) if ctx.needs_input_grad[3] else None
        return grad_x, None, grad_g, grad_delta


def path_slots(full: torch.Tensor) -> tuple[torch.Tensor, int]:
    """full [B, T] bool -> (slot [B, T] int64, number of full-path tokens).

    Tokens keep their (b, t) row-major order within each path, so the split is deterministic.
    Reading n_full synchronizes with the device: the buffer sizes depend on it.
    """
    flat = full.reshape(-1)
    n_full = int(flat.sum())
    full_rank = flat.cumsum(0) - 1
    cheap_rank = (~flat).cumsum(0) - 1 + n_full
    return torch.where(flat, full_rank, cheap_rank).view_as(full), n_full


def permute(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return torch.index_copy(torch.zeros_like(rows), 0, slot.reshape(-1), rows)


def unpermute(h: torch.Tensor, slot: torch.Tensor, w: torch.Tensor, y_full: torch.Tensor,
              y_cheap: torch.Tensor) -> torch.Tensor:
    y = torch.cat([y_full, y_cheap]).index_select(0, slot.reshape(-1)).view_as(h)
    acc = _acc(h, w, y)
    return (h.to(acc) + w.to(acc).unsqueeze(-1) * y.to(acc)).to(h.dtype)


def group_rows(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sel [N, E] bool (token n goes to expert e) -> (src [M] int64, counts [E] int64)."""
    expert_token = sel.t().nonzero()  # row-major over [E, N]: grouped by expert, tokens ascending
    return expert_token[:, 1], torch.bincount(expert_token[:, 0], minlength=sel.shape[1])


def permute_groups(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, src)


def unpermute_groups(h: torch.Tensor, src: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    acc = _acc(h, w, y)
    update = w.to(acc).unsqueeze(-1) * y.to(acc)
    return h.to(acc).index_add(0, src, update).to(h.dtype)
