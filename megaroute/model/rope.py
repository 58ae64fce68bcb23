"""Rotary position embeddings indexed by explicit positions.

Routed blocks process a gathered subset of tokens; they must rotate each token by its
original position, so the tables are indexed by a [B, T] position tensor, never by arange(T).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels import compiled_cuda_ops, cpu, functions


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables(None)
        # Non-persistent: derived from the config, so never part of a checkpoint.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "meta":  # shapes only (meta arange would import torch._dynamo: ~1.4 s)
            shape = (self.max_seq_len, self.head_dim // 2)
            return torch.empty(shape, device=device), torch.empty(shape, device=device)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                         / self.head_dim))
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32, device=device), inv_freq)
        return angles.cos(), angles.sin()

    def _apply(self, fn, recurse=True):
        # The tables are derived, never loaded, so rebuild them in float32 after every move/cast:
        # `model.to(bfloat16)` (or DeepSpeed's module.bfloat16()) would otherwise round them to
        # bf16 (~2e-3 error, blurring positions), and `to_empty()` after a meta-device build
        # would leave them uninitialized.
        super()._apply(fn, recurse)
        self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, sin), each [B, 1, T, head_dim/2] ready to broadcast over heads.
        index_select, not advanced indexing: ~10 vs ~50 us a table on CPU, twice per routed layer."""
        flat, shape = positions.reshape(-1), (*positions.shape, self.cos.shape[-1])
        return (self.cos.index_select(0, flat).view(shape).unsqueeze(1),
                self.sin.index_select(0, flat).view(shape).unsqueeze(1))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation as plain ops, in the dtype the operands promote to: interleaved-free halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, Dh]; rotates interleaved-free halves (GPT-NeoX / Llama layout).

    The reference math (in float32, whatever x's dtype); `split_qkv_rotary` is the fused path.
    """
    return _rotated(x.float(), cos, sin).type_as(x)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out = rotary(x), written half by half (no temporaries); out and x are [B, T, H, Dh] views."""
    h = x.shape[-1] // 2
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)


class _SplitQKVRotary(torch.autograd.Function):
    """qkv [B, T, 3, H, Dh] -> rotated q, rotated k, v, each [B, H, T, Dh] contiguous, in qkv's dtype.

    One read of qkv and one write of q, k, v; backward rotates the gradients back (rotation by -angle,
    the transpose) straight into one gradient tensor, instead of autograd's chunk/cat/select buffers.
    On CPU each direction is one pass of a fused kernel (kernels/cpu.py) with the same roundings
    (bf16: the same bits): [8, 256, 3, 6, 64] forward 0.95 -> 0.41 ms, backward 1.31 -> 0.40 ms
    (fp32, 2 threads), where the eager ops make eight strided passes 32 values wide.
    """

    @staticmethod
    def forward(ctx, qkv, cos, sin):
        B, T, _, H, Dh = qkv.shape
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)  # [B, T, 1, Dh/2]: broadcasts over heads
        ctx.save_for_backward(cos, sin)
        kernels = cpu.usable(qkv, cos, sin) if cos.shape == (B, T, 1, Dh // 2) == sin.shape else None
        if kernels is not None:
            return tuple(kernels.rotary_qkv_forward(qkv, cos, sin))
        q, k, v = (torch.empty(B, H, T, Dh, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
        _rotate_into(q.transpose(1, 2), qkv[:, :, 0], cos, sin)
        _rotate_into(k.transpose(1, 2), qkv[:, :, 1], cos, sin)
        v.transpose(1, 2).copy_(qkv[:, :, 2])
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        B, H, T, Dh = dv.shape
        neg_sin = -sin
        # The kernel reads gradients with any strides whose last dimension is contiguous: SDPA's are
        # [B, T, H, Dh]-strided on CPU, and copying them would cost 3 passes a layer.
        grads = [cpu.rows(t) for t in (dq, dk, dv)]
        kernels = cpu.usable(cos, neg_sin, strided=grads) if cos.shape == (B, T, 1, Dh // 2) else None
        if kernels is not None:
            return kernels.rotary_qkv_backward(*grads, cos, neg_sin), None, None
        grad = torch.empty(B, T, 3, H, Dh, dtype=dv.dtype, device=dv.device)
        _rotate_into(grad[:, :, 0], dq.transpose(1, 2), cos, neg_sin)
        _rotate_into(grad[:, :, 1], dk.transpose(1, 2), cos, neg_sin)
        grad[:, :, 2].copy_(dv.transpose(1, 2))
        return grad, None, None


def _split_qkv_rotary_traced(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_SplitQKVRotary's math as plain tensor ops (same arguments), for torch.compile: it cannot trace
    the `out=` writes into strided views, and inductor fuses these ops into one kernel itself."""
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
    q, k, v = qkv.unbind(2)  # each [B, T, H, Dh] -> [B, H, T, Dh]
    return _rotated(q, cos, sin).transpose(1, 2), _rotated(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


def split_qkv_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused `apply_rotary` for a qkv projection [B, T, 3, H, Dh] and tables [B, 1, T, Dh/2]
    (as Positions holds them): -> q, k (rotated) and v, each [B, H, T, Dh], computed in qkv's dtype
    (bf16 under autocast, as HF Llama does; the reference rotates in float32). Eager: one autograd
    function (contiguous outputs); on CUDA a Triton kernel per tensor and direction (kernels.ops.rotary_qkv:
    float32 math, one rounding), where the eager ops were 8 strided elementwise passes each way; under
    torch.compile: the same math as traceable ops."""
    cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
    if torch.compiler.is_compiling():
        return _split_qkv_rotary_traced(qkv, cos, sin)
    ops = compiled_cuda_ops(qkv, cos)
    if ops is not None and cos.shape[2] == 1:
        return ops.rotary_qkv(qkv, cos[:, :, 0].to(qkv.dtype), sin[:, :, 0].to(qkv.dtype))
    return functions.apply(_SplitQKVRotary, qkv, cos, sin)


class Positions:
    """Original positions of the tokens a layer sees, with their rotary tables.

    `select(indices, valid)` follows a routed gather, so the gathered tokens keep their positions.
    In incremental decoding it also carries the layer's KV cache (`kv`) and which gathered rows are
    real (`valid`, None = all): attention then appends the real rows' keys/values to that cache.
    `start` (host-side, or None): every row's positions are start, start + 1, ... and all are real,
    which the cache uses to skip its attention mask (LayerKV.append); a routed gather drops it.
    """

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor, kv=None,
                 valid: Optional[torch.Tensor] = None, start: Optional[int] = None):
        self.rope = rope
        self.positions = positions
        self.kv = kv  # megaroute.model.cache.LayerKV or None
        self.valid = valid
        self.start = start if valid is None else None
        self.cos, self.sin = rope(positions)

    def select(self, indices: torch.Tensor, valid: Optional[torch.Tensor] = None) -> "Positions":
        if self.valid is not None:  # padding tokens stay non-keys after a routed gather
            picked = self.valid.gather(1, indices)
            valid = picked if valid is None else valid & picked
        return Positions(self.rope, self.positions.gather(1, indices), self.kv, valid)

    def with_kv(self, kv) -> "Positions":
        """The same tokens, attending through (and appending to) one layer's cache."""
        out = Positions.__new__(Positions)
        out.rope, out.positions, out.kv, out.valid, out.start, out.cos, out.sin = (
            self.rope, self.positions, kv, self.valid, self.start, self.cos, self.sin)
        return out
