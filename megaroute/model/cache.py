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


MIN_ROOM = 64  # rows a cache buffer holds at least: short generations never grow it


class LayerKV:
    """One layer's cache: k, v [B, H, S, Dh], positions [B, S], valid [B, S].

    While the cache is `in_order` (every append continued positions 0, 1, ..., S - 1 in every row,
    all real, as an unrouted layer's appends do; host-side), positions and valid are not stored: they
    are arange(S) and all True, built (`_materialize`) only if a later append breaks the order.

    The rows live in buffers of room for more, doubled when full (at most `max_len` rows): an append
    writes its rows in place, and k / v / positions / valid are views of the first S rows. torch.cat
    copied every cached row at every step, one new allocation per tensor, layer and token.
    """

    def __init__(self, max_len: Optional[int] = None):
        self.max_len = max_len
        self.length = 0
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None
        self._positions: Optional[torch.Tensor] = None
        self._valid: Optional[torch.Tensor] = None
        self.in_order = True

    def __len__(self) -> int:
        return self.length

    @property
    def k(self) -> Optional[torch.Tensor]:
        return _rows(self._k, self.length, 2)

    @property
    def v(self) -> Optional[torch.Tensor]:
        return _rows(self._v, self.length, 2)

    @property
    def positions(self) -> Optional[torch.Tensor]:
        return _rows(self._positions, self.length, 1)

    @property
    def valid(self) -> Optional[torch.Tensor]:
        return _rows(self._valid, self.length, 1)

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               valid: Optional[torch.Tensor], start: Optional[int] = None
               ) -> tuple[Optional[torch.Tensor], bool]:
        """Adds this step's rows; returns (attention mask [B, 1, T, S] or None, is_causal) for this
        step's queries, as F.scaled_dot_product_attention takes them. `start` (host-side, or None):
        the rows' positions are start, start + 1, ... in every row and all are real (Positions.start).

        In order, one query (a decoding step) sees every cached key and a first append is plain causal
        attention: no mask is built (~10 small ops per layer and step, which on a GPU are host time)."""
        S0, T = self.length, positions.shape[1]
        if self.in_order and not (valid is None and start is not None and start == S0):
            self._materialize(positions)
        self._k, self._v = self._write(self._k, k, S0, 2), self._write(self._v, v, S0, 2)
        S = self.length = S0 + T
        if self.in_order:
            if T == 1 or T == S:
                return None, T > 1
            return self._mask(positions, self._arange(S, positions), None), False  # a chunk after earlier rows
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        self._positions = self._write(self._positions, positions, S0, 1)
        self._valid = self._write(self._valid, valid, S0, 1)
        return self._mask(positions, self.positions, self.valid), False

    def _write(self, buffer: Optional[torch.Tensor], rows: torch.Tensor, at: int, dim: int) -> torch.Tensor:
        """buffer with `rows` written at [at, at + n) along dim, in a larger buffer (room for twice the
        rows needed, at least MIN_ROOM, at most max_len; the first `at` rows copied over) when it has none."""
        end = at + rows.shape[dim]
        if buffer is None or buffer.shape[dim] < end:
            room = max(2 * end, MIN_ROOM) if self.max_len is None else min(max(2 * end, MIN_ROOM), self.max_len)
            room = max(room, end)
            grown = rows.new_empty(rows.shape[:dim] + (room,) + rows.shape[dim + 1:])
            if at:
                grown.narrow(dim, 0, at).copy_(buffer.narrow(dim, 0, at))
            buffer = grown
        buffer.narrow(dim, at, end - at).copy_(rows)
        return buffer

    @staticmethod
    def _arange(S: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(S, device=like.device).expand(like.shape[0], S)

    @staticmethod
    def _mask(positions: torch.Tensor, keys_at: torch.Tensor, keys_valid: Optional[torch.Tensor]) -> torch.Tensor:
        """[B, 1, T, S]: query t sees key s when keys_at[s] <= positions[t] and s is real, and its own row."""
        # Causal by original position; padded rows (of a ragged selection, or padding tokens) are never
        # keys. Every row still sees its own key, so a padding query with no visible key gets a finite
        # output instead of NaN (which, as a later layer's value, would poison real rows: 0 * NaN).
        # (An OR with a [T, S] mask rather than an indexed `= True`, whose CPU scalar is copied to the
        # GPU: a host sync in every layer of every decoding step.)
        visible = keys_at.unsqueeze(1) <= positions.unsqueeze(2)
        if keys_valid is not None:
            visible = visible & keys_valid.unsqueeze(1)
        S, T = keys_at.shape[1], positions.shape[1]
        keys = torch.arange(S, device=positions.device)
        own = keys == torch.arange(S - T, S, device=positions.device).unsqueeze(1)  # [T, S]: each query's own row
        return (visible | own).unsqueeze(1)

    def _materialize(self, like: torch.Tensor) -> None:
        """Leaves the in-order state: the stored rows' positions (0..S-1) and validity (all real)."""
        S = self.length
        self._positions = self._write(None, self._arange(S, like), 0, 1)
        self._valid = self._write(None, torch.ones(like.shape[0], S, dtype=torch.bool, device=like.device), 0, 1)
        self.in_order = False

    def reorder(self, index: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
            if not self.in_order:
                self._positions = self._positions.index_select(0, index)
                self._valid = self._valid.index_select(0, index)


def _rows(buffer: Optional[torch.Tensor], n: int, dim: int) -> Optional[torch.Tensor]:
    """The first n rows of a LayerKV buffer along dim (a view), or None before the first append."""
    return None if buffer is None else buffer.narrow(dim, 0, n)


class KVCache:
    """Per-layer caches plus the number of positions already consumed (the next token's position)."""

    def __init__(self, n_layers: int, max_len: Optional[int] = None):
        self.layers = [LayerKV(max_len) for _ in range(n_layers)]
        self.seen = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search: keep the batch rows `index` (in that order)."""
        for layer in self.layers:
            layer.reorder(index)

    def stored_tokens(self) -> list[int]:
        """Rows held per layer (batch row 0): shows routed-out tokens writing nothing."""
        return [len(layer) if layer.in_order else int(layer.valid[0].sum()) for layer in self.layers]
