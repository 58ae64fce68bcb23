"""Triton-backed dispatch ops: input checks + autograd.Function wrappers around triton_kernels.

Same signatures and semantics as reference.py. Inputs may be strided over B and T (no copies);
index tensors must be int64. The E-group ops (permute_groups / unpermute_groups, Mixture-of-Experts)
take contiguous flat rows; a token in several groups is summed over a per-token inverse map (no atomics,
so the result does not depend on thread order). Backward passes are fused kernels too: combine's grad_x is grad_out
itself (the residual), and grad_delta / grad_g come out of one pass over the selected rows.
"""

from __future__ import annotations

import torch

from . import functions
from . import triton_kernels as tk

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16 for the Triton dispatch kernels, "
                        f"got {t.dtype} (use routing.dispatch=torch for other dtypes)")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Validated index tensor, made contiguous: the kernels read indices by flat offset, and an
    index is small next to the activations (B*k int64), so a copy costs nothing measurable."""
    if t.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t.contiguous()


def _check_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"dispatch inputs must share one device, got {devices}")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        ctx.x_shape = x.shape
        return tk.gather(x, idx)

    @staticmethod
    def backward(ctx, grad_out):
        (idx,) = ctx.saved_tensors
        grad_x = grad_out.new_zeros(ctx.x_shape)  # unselected rows get no gradient
        return tk.scatter_rows(grad_out, idx, grad_x), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, idx, g, delta):
        ctx.save_for_backward(idx, g, delta)
        return tk.combine_fwd(x, idx, g, delta)

    @staticmethod
    def backward(ctx, grad_out):
        idx, g, delta = ctx.saved_tensors
        _, need_g, need_delta = ctx.needs_input_grad[1:]
        grad_delta = grad_g = None
        if need_g or need_delta:
            grad_delta, grad_g = tk.combine_bwd(grad_out, idx, g, delta, need_grad_g=need_g)
        return grad_out, None, grad_g, grad_delta if need_delta else None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot):
        B, T, D = x.shape
        out = x.new_empty(B * T, D)
        ctx.save_for_backward(slot)
        ctx.x_shape = x.shape
        # The flat buffer as [1, B*T, D] with batch stride 0: row slot[b, t] of every batch.
        return tk.scatter_rows(x, slot, out, dst_strides=(0, *out.stride()))

    @staticmethod
    def backward(ctx, grad_out):
        (slot,) = ctx.saved_tensors
        like = grad_out.new_empty(ctx.x_shape)
        return tk.gather_rows(grad_out, (0, *grad_out.stride()), slot, like), None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, slot, w, y_full, y_cheap):
        ctx.save_for_backward(slot, w, y_full, y_cheap)
        return tk.unpermute_fwd(h, slot, w, y_full, y_cheap)

    @staticmethod
    def backward(ctx, grad_out):
        slot, w, y_full, y_cheap = ctx.saved_tensors
        need_w = ctx.needs_input_grad[2]
        grad_yf, grad_yc, grad_w = tk.unpermute_bwd(grad_out, slot, w, y_full, y_cheap, need_grad_w=need_w)
        return grad_out, None, grad_w, grad_yf, grad_yc


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    _check_float("x", x, 3)
    idx = _check_index("idx", idx, (x.shape[0], idx.shape[1] if idx.dim() == 2 else -1))
    _check_device(x=x, idx=idx)
    if idx.shape[1] > x.shape[1]:
        raise ValueError(f"idx selects {idx.shape[1]} tokens from a sequence of {x.shape[1]}")
    return functions.apply(_Gather, x, idx)


def combine(x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    _check_float("x", x, 3)
    _check_float("delta", delta, 3)
    _check_float("g", g, 2)
    B, T, D = x.shape
    K = delta.shape[1]
    if delta.shape != (B, K, D):
        raise ValueError(f"delta must have shape (B, k, D) = ({B}, k, {D}), got {tuple(delta.shape)}")
    if K > T:
        raise ValueError(f"delta has {K} rows but the sequence has only {T} tokens")
    idx = _check_index("idx", idx, (B, K))
    if g.shape != (B, K):
        raise ValueError(f"g must have shape {(B, K)}, got {tuple(g.shape)}")
    _check_device(x=x, idx=idx, g=g, delta=delta)
    return functions.apply(_Combine, x, idx, g, delta)


def permute(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    _check_float("x", x, 3)
    slot = _check_index("slot", slot, tuple(x.shape[:2]))
    _check_device(x=x, slot=slot)
    return functions.apply(_Permute, x, slot)


def unpermute(h: torch.Tensor, slot: torch.Tensor, w: torch.Tensor, y_full: torch.Tensor,
              y_cheap: torch.Tensor) -> torch.Tensor:
    _check_float("h", h, 3)
    _check_float("w", w, 2)
    _check_float("y_full", y_full, 2)
    _check_float("y_cheap", y_cheap, 2)
    B, T, D = h.shape
    slot = _check_index("slot", slot, (B, T))
    if w.shape != (B, T):
        raise ValueError(f"w must have shape {(B, T)}, got {tuple(w.shape)}")
    for name, y in (("y_full", y_full), ("y_cheap", y_cheap)):
        if y.shape[1] != D:
            raise ValueError(f"{name} must have D = {D} features, got shape {tuple(y.shape)}")
    if y_full.shape[0] + y_cheap.shape[0] != B * T:
        raise ValueError(f"y_full and y_cheap must hold B*T = {B * T} rows together, "
                         f"got {y_full.shape[0]} + {y_cheap.shape[0]}")
    _check_device(h=h, slot=slot, w=w, y_full=y_full, y_cheap=y_cheap)
    return functions.apply(_Unpermute, h, slot, w, y_full, y_cheap)


# ----------------------------------------------------------------------------- E groups (MoE)


def _token_rows(src: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Inverse of a grouped permutation: pos [N, kmax], the buffer rows holding each token
    (ascending), -1 where a token has fewer. Reading kmax synchronizes with the device."""
    counts = torch.bincount(src, minlength=n_tokens)
    kmax = int(counts.max()) if src.numel() else 0
    order = torch.argsort(src, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(src.numel(), device=src.device) - starts.repeat_interleave(counts)
    pos = torch.full((n_tokens, kmax), -1, dtype=torch.int64, device=src.device)
    pos[src[order], rank] = order
    return pos


def _gather_flat(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return tk.gather(x.unsqueeze(0), src.unsqueeze(0)).squeeze(0)


class _PermuteGroups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src):
        ctx.save_for_backward(src)
        ctx.n_tokens = x.shape[0]
        return _gather_flat(x, src)

    @staticmethod
    def backward(ctx, grad_out):
        (src,) = ctx.saved_tensors
        pos = _token_rows(src, ctx.n_tokens)
        return tk.gather_sum(None, pos, None, grad_out.contiguous(), ctx.n_tokens, grad_out), None


class _UnpermuteGroups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, src, w, y):
        ctx.save_for_backward(src, w, y)
        return tk.gather_sum(h, _token_rows(src, h.shape[0]), w, y, h.shape[0], h)

    @staticmethod
    def backward(ctx, grad_out):
        src, w, y = ctx.saved_tensors
        rows = _gather_flat(grad_out.contiguous(), src).float()  # each assignment's token gradient
        grad_y = (w.float().unsqueeze(-1) * rows).to(y.dtype)
        grad_w = (rows * y.float()).sum(-1).to(w.dtype) if ctx.needs_input_grad[2] else None
        return grad_out, None, grad_w, grad_y


def _check_groups(src: torch.Tensor, n_tokens: int) -> torch.Tensor:
    if src.dtype != torch.int64 or src.dim() != 1:
        raise TypeError(f"src must be a 1-D int64 tensor, got {src.dtype} of shape {tuple(src.shape)}")
    if src.numel() and (int(src.min()) < 0 or int(src.max()) >= n_tokens):
        raise ValueError(f"src holds token rows outside [0, {n_tokens})")
    return src.contiguous()


def permute_groups(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    _check_float("x", x, 2)
    src = _check_groups(src, x.shape[0])
    _check_device(x=x, src=src)
    return functions.apply(_PermuteGroups, x.contiguous(), src)


def unpermute_groups(h: torch.Tensor, src: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _check_float("h", h, 2)
    _check_float("w", w, 1)
    _check_float("y", y, 2)
    src = _check_groups(src, h.shape[0])
    if w.shape[0] != src.shape[0] or y.shape != (src.shape[0], h.shape[1]):
        raise ValueError(f"w and y must have {src.shape[0]} rows (y with {h.shape[1]} features), "
                         f"got {tuple(w.shape)} and {tuple(y.shape)}")
    _check_device(h=h, src=src, w=w, y=y)
    return functions.apply(_UnpermuteGroups, h.contiguous(), src, w.contiguous(), y.contiguous())


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin):
        B, T, _, H, Dh = qkv.shape
        ctx.save_for_backward(cos, sin)
        ctx.qkv_shape = qkv.shape
        outs = tuple(torch.empty(B, H, T, Dh, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
        for i, out in enumerate(outs):  # q and k rotated, v copied
            tk.rotate_heads(qkv[:, :, i], cos, sin, out.transpose(1, 2), rotate=i < 2)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        cos, sin = ctx.saved_tensors
        grad = torch.empty(ctx.qkv_shape, dtype=cos.dtype, device=cos.device)
        neg_sin = -sin  # the transpose of a rotation is the rotation by -angle
        for i, g in enumerate(grads):
            if g is None:
                grad[:, :, i].zero_()
            else:
                tk.rotate_heads(g.transpose(1, 2), cos, neg_sin, grad[:, :, i], rotate=i < 2)
        return grad, None, None


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RoPE of a qkv projection in one kernel per tensor (rope.split_qkv_rotary on CUDA): qkv
    [B, T, 3, H, Dh] (any strides), cos / sin [B, T, Dh/2] in qkv's dtype -> q, k rotated and v, each
    [B, H, T, Dh] contiguous, computed in float32 and rounded once. Backward rotates the gradients by
    -angle into one [B, T, 3, H, Dh] gradient."""
    _check_float("qkv", qkv, 5)
    _check_float("cos", cos, 3)
    _check_float("sin", sin, 3)
    B, T, three, H, Dh = qkv.shape
    if three != 3 or Dh % 2 or cos.shape != (B, T, Dh // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotary_qkv: qkv {tuple(qkv.shape)} must be [B, T, 3, H, Dh] (Dh even) and cos / sin "
                         f"[B, T, Dh/2], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if not qkv.dtype == cos.dtype == sin.dtype:
        raise TypeError(f"rotary_qkv: qkv, cos and sin must share a dtype, got {qkv.dtype}, {cos.dtype}, {sin.dtype}")
    _check_device(qkv=qkv, cos=cos, sin=sin)
    return functions.apply(_RotaryQKV, qkv, cos, sin)


# ----------------------------------------------------------------------------- a block's elementwise work


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as rows [N, D] with unit column stride (a view where the strides allow)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def _check_rows(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"{name} must have a feature dimension, got a 0-d tensor")


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        rows = _rows(gate_up)
        ctx.save_for_backward(rows)
        return tk.swiglu_fwd(rows).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        shape = grad.shape[:-1] + (rows.shape[1],)
        return tk.swiglu_bwd(_rows(grad.to(rows.dtype)), rows).view(shape)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2H] (gate first) in one kernel each way (mlp.swiglu on CUDA).
    Keeps only gate|up for backward (silu is recomputed there), where autograd's graph also keeps
    silu(gate); rounds silu(gate) to the input's dtype before the product, as the plain ops do."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: gate_up's last dimension must be even (gate | up), got {tuple(gate_up.shape)}")
    return functions.apply(_SwiGLU, gate_up)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = _rows(x)
        y, rstd = tk.rms_norm_fwd(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = tk.rms_norm_bwd(_rows(grad), rows, weight, rstd)
        return grad_x.view(grad.shape), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, weight.shape, weight, eps) over x's last dimension in one kernel each way
    (norm.RMSNorm on CUDA without apex): float32 math, the output and x's gradient in x's dtype,
    the weight's gradient in its own; keeps x and one float32 rstd per row for backward."""
    _check_rows("x", x)
    _check_rows("weight", weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1]}] (x's last dimension), got {tuple(weight.shape)}")
    _check_device(x=x, weight=weight)
    return functions.apply(_RMSNorm, x, weight.contiguous(), float(eps))
