"""Helpers shared by the routed-layer tests: counting executed rows, causality, op counts."""

from __future__ import annotations

import collections
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from megaroute.kernels import cpu_linear
from megaroute.model.routing import ragged


def tokens_for(cfg, B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)


def record_updates(monkeypatch, model) -> dict[int, list[torch.Tensor]]:
    """Wraps every block's `update` and the ragged path: layer index -> the position tensors
    [B, rows] it was called with (ragged: each sequence's selected positions, padded with -1).

    Every routed path and DenseLayer go through block.update or ragged.update_rows, so these are
    the rows computed."""
    calls: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
    index = {id(layer.block): i for i, layer in enumerate(model.layers)}
    for i, layer in enumerate(model.layers):
        original = layer.block.update

        def update(x, pos, i=i, original=original):
            calls[i].append(pos.positions.clone())
            return original(x, pos)

        monkeypatch.setattr(layer.block, "update", update)
    update_rows = ragged.update_rows

    def recorded_rows(block, x, pos, rows, counts, weight=None):
        if rows.numel() < pos.positions.numel():  # every token selected: block.update records the call
            picked = pos.positions.reshape(-1)[rows].split(counts.tolist())
            calls[index[id(block)]].append(torch.nn.utils.rnn.pad_sequence(list(picked), batch_first=True,
                                                                           padding_value=-1))
        return update_rows(block, x, pos, rows, counts, weight)

    monkeypatch.setattr(ragged, "update_rows", recorded_rows)
    return calls


def rows(calls: dict[int, list[torch.Tensor]], i: int) -> int:
    """Rows layer i computed (the ragged path's -1 fill is no row)."""
    return sum(int((p >= 0).sum()) for p in calls.get(i, []))


def assert_causal(run, tokens: torch.Tensor, vocab: int, ts=(0, 3, 8, 14)) -> None:
    """run(tokens) -> logits. Changing tokens after t leaves logits at <= t unchanged (and changes later ones)."""
    base = run(tokens)
    for t in ts:
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] * 7 + 3) % vocab
        logits = run(changed)
        torch.testing.assert_close(logits[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-5)
        assert (logits[:, t + 1:] - base[:, t + 1:]).abs().max() > 1e-3


class OpCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__qualname__", repr(func))] += 1
        return func(*args, **(kwargs or {}))


def op_counts(run, batch_sizes=(1, 5)) -> list[collections.Counter]:
    """Torch calls per forward for each batch size: equal counts mean no per-sample Python loop. The
    float32 CPU linears' row bucket (kernels/cpu_linear.py ROW_BUCKET) is widened to 64 here, so the
    callers' 12-token sequences keep B x 12 rows within one bucket: past it the ragged path's
    zero-row padding adds a fixed few calls whenever a selection's count is not a multiple."""
    counts = []
    for B in batch_sizes:
        with OpCounter() as counter, mock.patch.object(cpu_linear, "ROW_BUCKET", 64):
            run(B)
        counts.append(counter.calls)
    return counts
