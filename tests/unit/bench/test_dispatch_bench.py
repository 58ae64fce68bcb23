"""The dispatch benchmark's masks execute the fraction they are labelled with."""

from __future__ import annotations

import pytest
import torch

from megaroute.bench.dispatch import random_masks


@pytest.mark.parametrize("frac", [0.3, 0.8, 1.0])
@pytest.mark.parametrize("spread", [False, True])
def test_masks_execute_their_fraction(frac, spread):
    masks = random_masks(3, 8, 64, frac, torch.Generator().manual_seed(0), spread=spread)
    assert sorted(masks) == ["layer_0", "layer_1", "layer_2"]
    for mask in masks.values():
        assert mask.shape == (8, 64) and mask.dtype == torch.bool
        assert mask.float().mean().item() == pytest.approx(frac, abs=1 / 64)
        counts = mask.sum(dim=1)
        if spread and frac < 1.0:
            assert counts.max() - counts.min() >= 0.5 * 64 * min(frac, 1 - frac)  # rows really differ
