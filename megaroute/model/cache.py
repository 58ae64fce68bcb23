"""Key/value cache for incremental decoding, routing-aware.

Each layer keeps only the keys/values of tokens that actually ran its attention: a token a routed
layer skipped writes nothing there, exactly as in the uncached forward where skipped tokens are
absent from that layer's attention. Rows are stored with their original positions and a validity
flag (ragged routing pads the gathered batch), and attention masks by position, so the cache
needs no per-sequence bookkeeping beyond that.
"""

from __future__ import annotations

from typing import Optional

import torch


class LayerKV:
    """One layer's cache: k, v [B, H, S, Dh], positions [B, S], valid [B, S]."""

    def __init__(self):
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None
        self.valid: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               valid: Optional[torch.Tensor]) -> torch.Tensor:
        """Adds this step's rows; returns the attention mask [B, 1, T, S] for this step's queries."""
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        if self.k is None:
            self.k, self.v, self.positions, self.valid = k, v, positions, valid
        else:
            self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            self.positions = torch.cat([self.positions, positions], dim=1)
            self.valid = torch.cat([self.valid, valid], dim=1)
        # Causal by original position; padded rows (of a ragged selection, or padding tokens) are never
        # keys. Every row still sees its own key, so a padding query with no visible key gets a finite
        # output instead of NaN (which, as a later layer's value, would poison real rows: 0 * NaN).
        # (An OR with a [T, S] mask rather than an indexed `= True`, whose CPU scalar is copied to the
        # GPU: a host sync in every layer of every decoding step.)
        visible = (self.positions.unsqueeze(1) <= positions.unsqueeze(2)) & self.valid.unsqueeze(1)
        S, T = self.positions.shape[1], positions.shape[1]
        keys = torch.arange(S, device=positions.device)
        own = keys == torch.arange(S - T, S, device=positions.device).unsqueeze(1)  # [T, S]: each query's own row
        return (visible | own).unsqueeze(1)

    def reorder(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
            self.positions, self.valid = self.positions.index_select(0, index), self.valid.index_select(0, index)


class KVCache:
    """Per-layer caches plus the number of positions already consumed (the next token's position)."""

    def __init__(self, n_layers: int):
        self.layers = [LayerKV() for _ in range(n_layers)]
        self.seen = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search: keep the batch rows `index` (in that order)."""
        for layer in self.layers:
            layer.reorder(index)

    def stored_tokens(self) -> list[int]:
        """Rows held per layer (batch row 0): shows routed-out tokens writing nothing."""
        return [0 if layer.valid is None else int(layer.valid[0].sum()) for layer in self.layers]
