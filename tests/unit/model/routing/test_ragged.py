"""Ragged dispatch without padding (routing/ragged.py) equals the padded gather/combine path."""

from __future__ import annotations

import pytest
import torch

from megaroute.config import ModelConfig
from megaroute.model.block import TransformerBlock
from megaroute.model.rope import Positions, RotaryEmbedding
from megaroute.model.routing import dispatch
from megaroute.model.routing.dispatch import Dispatcher
from megaroute.model.routing.execute import update_masked, update_padded, update_selected

B, T = 5, 13


def _setup(seed: int = 0, checkpoint: bool = False):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, max_seq_len=32)
    block = TransformerBlock(cfg).double()
    block.checkpoint_activations = checkpoint
    for p in block.parameters():  # non-trivial norms too
        torch.nn.init.normal_(p, mean=float(p.dim() == 1), std=0.3)
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len)
    # Shifted positions (a sequence continued past 0): RoPE must use them, not the row index.
    pos = Positions(rope, torch.arange(3, 3 + T).expand(B, T))
    return block, pos


def _masks(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # an empty row
    mask[1] = True   # a full row
    return [mask, torch.zeros(B, T, dtype=torch.bool), torch.ones(B, T, dtype=torch.bool)]


def _run(fn, block, x, w):
    x = x.clone().requires_grad_(True)
    w = None if w is None else w.clone().requires_grad_(True)
    out = fn(x, w)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [x.grad] + ([] if w is None else [w.grad]) + [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("checkpoint,weighted", [(False, True), (True, False)])
def test_masked_ragged_equals_padded_forward_and_backward(checkpoint, weighted):
    block, pos = _setup(checkpoint=checkpoint)
    block.train()
    d = Dispatcher("torch")
    for mask in _masks(0):  # random with an empty and a full row; all empty; all full
        x = torch.randn(B, T, 32, dtype=torch.float64)
        w = torch.rand(B, T, dtype=torch.float64) if weighted else None

        def padded(x, w, mask=mask):
            idx, valid = dispatch.mask_indices(mask)
            return update_padded(block, x, pos, idx, None if w is None else w.gather(1, idx), valid, dispatcher=d)

        ragged_out, ragged_grads = _run(lambda x, w: update_masked(block, x, pos, mask, w, dispatcher=d),
                                        block, x, w)
        padded_out, padded_grads = _run(padded, block, x, w)
        torch.testing.assert_close(ragged_out, padded_out, rtol=1e-12, atol=1e-12)
        for a, b in zip(ragged_grads, padded_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        # unselected tokens pass through bit for bit
        assert torch.equal(ragged_out[~mask], x[~mask])


def test_selected_with_valid_takes_the_ragged_path_and_equals_padded():
    block, pos = _setup(seed=1)
    d = Dispatcher("torch")
    mask = _masks(4)[0]
    idx, valid = dispatch.mask_indices(mask)
    x = torch.randn(B, T, 32, dtype=torch.float64)
    w = torch.rand(idx.shape, dtype=torch.float64)
    out = update_selected(block, x, pos, idx, w, valid, dispatcher=d)
    ref = update_padded(block, x, pos, idx, w, valid, dispatcher=d)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_ragged_float32_close_to_padded():
    block, pos = _setup(seed=2)
    block.float()
    d = Dispatcher("torch")
    mask = _masks(5)[0]
    x = torch.randn(B, T, 32)
    idx, valid = dispatch.mask_indices(mask)
    out = update_masked(block, x, pos, mask, dispatcher=d)
    ref = update_padded(block, x, pos, idx, None, valid, dispatcher=d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
