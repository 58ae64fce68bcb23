"""Token dispatch for routed layers: choose -> gather -> (compute) -> combine.

Choosing tokens (capacity_k, topk_indices, mask_indices) is plain PyTorch here. Moving them is
done by a `Dispatcher`, which each routed layer builds from `routing.dispatch` and which runs
either the pure-PyTorch reference (megaroute.kernels.reference, the semantics) or the fused
Triton kernels. All ops are batched (no per-sample Python loops) and keep the causal order of
the selected tokens. Ragged selections (mask_indices' padded batch) are executed without padding
the token-wise work by ragged.py (execute.update_masked / update_selected); this padded layout
remains the KV-cache path and the reference those are tested against.
"""

from __future__ import annotations

import torch

from ...kernels import check_backend, reference, resolve


# idx [B, k] positions -> [B * k] rows b * T + idx[b, j] of the flat [B * T, D] view (the reference gather's)
flat_rows = reference.flat_rows


def capacity_k(seq_len: int, capacity: float) -> int:
    """Tokens a routed block processes per sequence: max(1, round(c * T)). Never zero."""
    return max(1, int(round(capacity * seq_len)))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per-sequence expert-choice top-k: scores [B, T] -> indices [B, k], ascending (causal order)."""
    return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


def mask_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged selection as a padded batch: mask [B, T] -> (indices [B, kmax], valid [B, kmax]).

    Selected positions come first in ascending order, padding (unselected positions) after, so
    a causal mask in index order never lets a real token see padding. kmax is the largest count,
    read on the host (a sync on a GPU), except for one-token steps on a GPU (incremental decoding:
    every routed layer, every token: one_token_gpu_step), where kmax = 1 whatever the mask (no sync):
    a row that runs nothing is one padded row, which runs the block, adds nothing and writes no key.
    """
    B, T = mask.shape
    counts = mask.sum(dim=1)
    kmax = T if one_token_gpu_step(mask) else int(counts.max()) if B > 0 else 0
    pos = torch.arange(T, device=mask.device).expand(B, T)
    order = torch.where(mask, pos, pos + T).argsort(dim=1)[:, :kmax]
    valid = torch.arange(kmax, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    return order, valid


def one_token_gpu_step(mask: torch.Tensor) -> bool:
    """A routing decision mask [B, T] of a one-token step (incremental decoding) on a GPU. There a
    routed layer does not size its work by reading the decision on the host (a sync per layer and
    token): mask_indices pads to T = 1 row, the depth gate runs both FFNs and keeps each token's own.
    The extra compute costs less than the host waiting for the device. On CPU there is no sync to
    save, and the extra work would be real time."""
    return mask.shape[1] == 1 and mask.device.type != "cpu"


def selected_fraction(idx: torch.Tensor, valid, seq_len: int) -> torch.Tensor:
    """Fraction of a [B, seq_len] batch's tokens that a selection idx [B, k] (valid [B, k] or None: all
    real) routes through the block, as a 0-dim tensor on idx's device. torch.full rather than
    new_tensor: a Python number copied to the GPU would wait for it (a host sync per layer)."""
    count = valid.sum() if valid is not None else torch.full((), idx.numel(), device=idx.device)
    return count / (idx.shape[0] * seq_len)


def indices_to_mask(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    mask = torch.zeros(indices.shape[0], seq_len, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, indices, True)


class Dispatcher:
    """Moves tokens for one routed layer on the backend named by `routing.dispatch`.

        gather(x, idx)                   x[b, idx[b]]                              [B, k, D]
        combine(x, idx, g, delta)        out = x;  out[b, idx[b, j]] += g[b, j] * delta[b, j]
        permute(x, slot)                 [B*T, D]: full-path tokens first, then cheap (see path_slots)
        unpermute(h, slot, w, yf, yc)    h + w * (each token's row of yf / yc)

    The backend is resolved per call from the input's device, so a layer built on CPU and moved
    to a GPU picks up the kernels. Holds only the backend name (picklable, no global state).
    """

    def __init__(self, backend: str = "auto"):
        self.backend = check_backend(backend)

    def __repr__(self) -> str:
        return f"Dispatcher({self.backend!r})"

    def runs_reference(self, device: torch.device) -> bool:
        """Whether tensors on `device` get the pure-PyTorch reference (no fused kernels)."""
        return resolve(self.backend, device) is reference

    def gather(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return resolve(self.backend, x.device).gather(x, idx)

    def combine(self, x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return resolve(self.backend, x.device).combine(x, idx, g, delta)

    def permute(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return resolve(self.backend, x.device).permute(x, slot)

    def unpermute(self, h: torch.Tensor, slot: torch.Tensor, w: torch.Tensor, y_full: torch.Tensor,
                  y_cheap: torch.Tensor) -> torch.Tensor:
        return resolve(self.backend, h.device).unpermute(h, slot, w, y_full, y_cheap)
