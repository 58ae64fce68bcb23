"""Cached against uncached greedy generation of a converted model, on a model whose tokens follow their context."""

from __future__ import annotations

import torch


def scramble_weights(hf, seed: int = 0) -> None:
    """Redraws every weight matrix (standard normal / sqrt(fan-in); norms' gains, biases and buffers such as
    calibrated thresholds kept), so greedy tokens follow their context. A barely trained or freshly
    initialised tiny model repeats one token whatever came before, and then a decoding step that lost its
    context (a cache dropped between steps) picks the same tokens as one that kept it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)


def assert_cached_generation_equals_uncached(hf, prompt: torch.Tensor, new_tokens: int, min_distinct: int = 3,
                                             **kwargs) -> None:
    """generate() with the cache equals generate() without it, `new_tokens` each (min_new_tokens: an early end
    of sequence would leave too few cached steps to compare), after scramble_weights; and the tokens vary
    (at least `min_distinct` distinct in each row: greedy decoding loops, but not on one token), so a
    context lost between steps would show."""
    scramble_weights(hf)
    args = dict(min_new_tokens=new_tokens, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    cached = hf.generate(prompt, use_cache=True, **args)
    uncached = hf.generate(prompt, use_cache=False, **args)
    generated = uncached[:, -new_tokens:].tolist()
    assert all(len(set(row)) >= min_distinct for row in generated), generated
    assert cached.tolist() == uncached.tolist()
