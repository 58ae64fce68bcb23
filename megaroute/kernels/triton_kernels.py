"""Triton kernels for token dispatch. Launchers take validated tensors (see ops.py) and allocate
outputs; autograd lives in ops.py. Semantics: reference.py.

One program moves one token row of D features, looping over D in BLOCK_D chunks, so any D
works (no power-of-two requirement) and each row is read and written exactly once. Row strides
are passed explicitly: inputs strided over B and T (slices, transposes) need no copy. Arithmetic
is float32; results are rounded once to the output dtype (round-to-nearest-even on GPUs; the
interpreter truncates float32 -> bfloat16, so interpreted bf16 results may differ by one ulp).

Interpreter mode (TRITON_INTERPRET=1) is fixed when triton is first imported (its standard
library, e.g. tl.zeros, is decorated then) and when this module decorates its kernels;
`INTERPRETED` is true only if both happened in interpreter mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

INTERPRETED = bool(knobs.runtime.interpret) and not isinstance(tl.zeros, JITFunction)


def _block_d(D: int) -> int:
    # Large enough for wide vector loads at D >= 2048, small enough to keep registers low.
    return min(triton.next_power_of_2(max(D, 1)), 2048)


def _warps(block_d: int) -> int:
    return 8 if block_d >= 2048 else 4


@triton.jit
def _move_rows_kernel(src_ptr, dst_ptr, idx_ptr, K, D,
                      s_sb, s_st, s_sd, d_sb, d_st, d_sd, i_sb, i_sk,
                      SCATTER: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r = (b, j): gather dst[b, j] = src[b, idx[b, j]]; scatter dst[b, idx[b, j]] = src[b, j]."""
    r = tl.program_id(0).to(tl.int64)
    b = r // K
    j = r % K
    t = tl.load(idx_ptr + b * i_sb + j * i_sk).to(tl.int64)
    if SCATTER:
        src_row = src_ptr + b * s_sb + j * s_st
        dst_row = dst_ptr + b * d_sb + t * d_st
    else:
        src_row = src_ptr + b * s_sb + t * s_st
        dst_row = dst_ptr + b * d_sb + j * d_st
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        v = tl.load(src_row + d * s_sd, mask=m)
        tl.store(dst_row + d * d_sd, v.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_fwd_kernel(x_ptr, inv_ptr, g_ptr, delta_ptr, out_ptr, T, D,
                        x_sb, x_st, x_sd, g_sb, g_sk, dl_sb, dl_sk, dl_sd, o_sb, o_st, o_sd,
                        BLOCK_D: tl.constexpr):
    """Row r = (b, t): out = x + g[b, j] * delta[b, j] where j = inv[b, t] >= 0, else out = x."""
    r = tl.program_id(0).to(tl.int64)
    b = r // T
    t = r % T
    j = tl.load(inv_ptr + r).to(tl.int64)
    # The row flag as a block: the interpreter cannot combine a scalar mask with a block mask.
    sel = (j + tl.zeros([BLOCK_D], dtype=tl.int64)) >= 0
    j = tl.maximum(j, 0)  # keep the (masked) addresses in range for unselected rows
    g = tl.load(g_ptr + b * g_sb + j * g_sk).to(tl.float32)  # unused where the row is unselected
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_ptr + b * x_sb + t * x_st + d * x_sd, mask=m)
        dl = tl.load(delta_ptr + b * dl_sb + j * dl_sk + d * dl_sd, mask=m & sel, other=0.0)
        # where(), not x + 0 * 0: unselected rows stay x bit for bit (-0.0 included).
        y = tl.where(sel, x.to(tl.float32) + g * dl.to(tl.float32), x.to(tl.float32))
        tl.store(out_ptr + b * o_sb + t * o_st + d * o_sd, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd_kernel(go_ptr, idx_ptr, g_ptr, delta_ptr, gdelta_ptr, gg_ptr, K, D,
                        go_sb, go_st, go_sd, i_sb, i_sk, g_sb, g_sk, dl_sb, dl_sk, dl_sd,
                        gd_sb, gd_sk, gd_sd,
                        GRAD_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r = (b, j), t = idx[b, j]: grad_delta = g * grad_out[b, t]; grad_g = <grad_out[b, t], delta[b, j]>."""
    r = tl.program_id(0).to(tl.int64)
    b = r // K
    j = r % K
    t = tl.load(idx_ptr + b * i_sb + j * i_sk).to(tl.int64)
    g = tl.load(g_ptr + b * g_sb + j * g_sk).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        go = tl.load(go_ptr + b * go_sb + t * go_st + d * go_sd, mask=m, other=0.0).to(tl.float32)
        tl.store(gdelta_ptr + b * gd_sb + j * gd_sk + d * gd_sd, (g * go).to(gdelta_ptr.dtype.element_ty), mask=m)
        if GRAD_G:
            dl = tl.load(delta_ptr + b * dl_sb + j * dl_sk + d * dl_sd, mask=m, other=0.0).to(tl.float32)
            acc += go * dl
    if GRAD_G:
        tl.store(gg_ptr + r, tl.sum(acc, axis=0))


@triton.jit
def _unpermute_fwd_kernel(h_ptr, slot_ptr, w_ptr, yf_ptr, yc_ptr, out_ptr, T, D, n_full,
                          h_sb, h_st, h_sd, w_sb, w_st, yf_sn, yf_sd, yc_sn, yc_sd, o_sb, o_st, o_sd,
                          BLOCK_D: tl.constexpr):
    """Row r = (b, t), s = slot[r]: out = h + w * (yf[s] if s < n_full else yc[s - n_full])."""
    r = tl.program_id(0).to(tl.int64)
    b = r // T
    t = r % T
    s = tl.load(slot_ptr + r).to(tl.int64)
    is_full = (s + tl.zeros([BLOCK_D], dtype=tl.int64)) < n_full  # a block: see _combine_fwd_kernel
    sf = tl.where(s < n_full, s, 0)
    sc = tl.where(s < n_full, 0, s - n_full)
    w = tl.load(w_ptr + b * w_sb + t * w_st).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        h = tl.load(h_ptr + b * h_sb + t * h_st + d * h_sd, mask=m).to(tl.float32)
        # Exactly one of the two masked loads touches memory.
        y = tl.load(yf_ptr + sf * yf_sn + d * yf_sd, mask=m & is_full, other=0.0).to(tl.float32) \
            + tl.load(yc_ptr + sc * yc_sn + d * yc_sd, mask=m & (~is_full), other=0.0).to(tl.float32)
        tl.store(out_ptr + b * o_sb + t * o_st + d * o_sd, (h + w * y).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _unpermute_bwd_kernel(go_ptr, slot_ptr, w_ptr, yf_ptr, yc_ptr, gyf_ptr, gyc_ptr, gw_ptr, T, D, n_full,
                          go_sb, go_st, go_sd, w_sb, w_st, yf_sn, yf_sd, yc_sn, yc_sd,
                          GRAD_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row r = (b, t), s = slot[r]: grad_y[s] = w * grad_out[b, t]; grad_w = <grad_out[b, t], y[s]>.

    grad_y buffers are contiguous [n, D] (allocated by the launcher)."""
    r = tl.program_id(0).to(tl.int64)
    b = r // T
    t = r % T
    s = tl.load(slot_ptr + r).to(tl.int64)
    is_full = (s + tl.zeros([BLOCK_D], dtype=tl.int64)) < n_full  # a block: see _combine_fwd_kernel
    sf = tl.where(s < n_full, s, 0)
    sc = tl.where(s < n_full, 0, s - n_full)
    w = tl.load(w_ptr + b * w_sb + t * w_st).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        go = tl.load(go_ptr + b * go_sb + t * go_st + d * go_sd, mask=m, other=0.0).to(tl.float32)
        gy = w * go
        tl.store(gyf_ptr + sf * D + d, gy.to(gyf_ptr.dtype.element_ty), mask=m & is_full)
        tl.store(gyc_ptr + sc * D + d, gy.to(gyc_ptr.dtype.element_ty), mask=m & (~is_full))
        if GRAD_W:
            y = tl.load(yf_ptr + sf * yf_sn + d * yf_sd, mask=m & is_full, other=0.0).to(tl.float32) \
                + tl.load(yc_ptr + sc * yc_sn + d * yc_sd, mask=m & (~is_full), other=0.0).to(tl.float32)
            acc += go * y
    if GRAD_W:
        tl.store(gw_ptr + r, tl.sum(acc, axis=0))


# ----------------------------------------------------------------------------------- launchers


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    B, _, D = x.shape
    K = idx.shape[1]
    out = x.new_empty(B, K, D)
    if out.numel():
        bd = _block_d(D)
        _move_rows_kernel[(B * K,)](x, out, idx, K, D, *x.stride(), *out.stride(), *idx.stride(),
                                    SCATTER=False, BLOCK_D=bd, num_warps=_warps(bd))
    return out


def scatter_rows(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, dst_strides=None) -> torch.Tensor:
    """dst[b, idx[b, j]] = src[b, j] (dst_strides overrides dst's (b, t, d) strides). Returns dst."""
    B, K, D = src.shape
    if B * K and D:
        bd = _block_d(D)
        _move_rows_kernel[(B * K,)](src, dst, idx, K, D, *src.stride(), *(dst_strides or dst.stride()),
                                    *idx.stride(), SCATTER=True, BLOCK_D=bd, num_warps=_warps(bd))
    return dst


def gather_rows(src: torch.Tensor, src_strides, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """out[b, j] = src[b, idx[b, j]] with src addressed by explicit (b, t, d) strides; out shaped like `like`."""
    B, K, D = like.shape
    out = torch.empty(B, K, D, dtype=src.dtype, device=src.device)
    if out.numel():
        bd = _block_d(D)
        _move_rows_kernel[(B * K,)](src, out, idx, K, D, *src_strides, *out.stride(), *idx.stride(),
                                    SCATTER=False, BLOCK_D=bd, num_warps=_warps(bd))
    return out


def combine_fwd(x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    B, T, D = x.shape
    K = idx.shape[1]
    if K == 0:  # nothing to add (and g, delta are empty: no valid pointers to hand the kernel)
        return x.clone()
    # Inverse map t -> j (or -1), so one pass over all B*T rows writes every output row once.
    inv = torch.full((B, T), -1, dtype=torch.int32, device=x.device)
    inv.scatter_(1, idx, torch.arange(K, dtype=torch.int32, device=x.device).expand(B, K))
    out = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    if out.numel():
        bd = _block_d(D)
        _combine_fwd_kernel[(B * T,)](x, inv, g, delta, out, T, D, *x.stride(), *g.stride(), *delta.stride(),
                                      *out.stride(), BLOCK_D=bd, num_warps=_warps(bd))
    return out


def combine_bwd(grad_out: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, delta: torch.Tensor,
                need_grad_g: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, K, D = delta.shape
    grad_delta = torch.empty(B, K, D, dtype=delta.dtype, device=delta.device)
    grad_g = torch.zeros(B, K, dtype=torch.float32, device=g.device) if need_grad_g else None
    if B * K:
        bd = _block_d(D)
        _combine_bwd_kernel[(B * K,)](grad_out, idx, g, delta, grad_delta, grad_g if need_grad_g else grad_delta,
                                      K, D, *grad_out.stride(), *idx.stride(), *g.stride(), *delta.stride(),
                                      *grad_delta.stride(), GRAD_G=need_grad_g, BLOCK_D=bd, num_warps=_warps(bd))
    return grad_delta, (grad_g.to(g.dtype) if need_grad_g else None)


def _nonempty(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An empty path buffer is never read or written; hand the kernel a valid pointer anyway."""
    return a if a.shape[0] else b


def unpermute_fwd(h, slot, w, y_full, y_cheap) -> torch.Tensor:
    B, T, D = h.shape
    out = torch.empty(B, T, D, dtype=h.dtype, device=h.device)
    if out.numel():
        bd = _block_d(D)
        yf, yc = _nonempty(y_full, y_cheap), _nonempty(y_cheap, y_full)
        _unpermute_fwd_kernel[(B * T,)](h, slot, w, yf, yc, out, T, D, y_full.shape[0],
                                        *h.stride(), *w.stride(), *yf.stride(), *yc.stride(),
                                        *out.stride(), BLOCK_D=bd, num_warps=_warps(bd))
    return out


def unpermute_bwd(grad_out, slot, w, y_full, y_cheap, need_grad_w: bool):
    B, T, D = grad_out.shape
    grad_yf = torch.empty(y_full.shape, dtype=y_full.dtype, device=y_full.device)
    grad_yc = torch.empty(y_cheap.shape, dtype=y_cheap.dtype, device=y_cheap.device)
    grad_w = torch.zeros(B, T, dtype=torch.float32, device=w.device) if need_grad_w else None
    if B * T:
        bd = _block_d(D)
        yf, yc = _nonempty(y_full, y_cheap), _nonempty(y_cheap, y_full)
        gyf, gyc = _nonempty(grad_yf, grad_yc), _nonempty(grad_yc, grad_yf)
        _unpermute_bwd_kernel[(B * T,)](grad_out, slot, w, yf, yc, gyf, gyc,
                                        grad_w if need_grad_w else gyf, T, D, y_full.shape[0],
                                        *grad_out.stride(), *w.stride(), *yf.stride(), *yc.stride(),
                                        GRAD_W=need_grad_w, BLOCK_D=bd, num_warps=_warps(bd))
    return grad_yf, grad_yc, (grad_w.to(w.dtype) if need_grad_w else None)


# ----------------------------------------------------------------------------- E groups (MoE)


@triton.jit
def _gather_sum_kernel(base_ptr, pos_ptr, w_ptr, y_ptr, out_ptr, KMAX, D,
                       HAS_BASE: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token n: out[n] = base[n] + sum_j w[pos[n, j]] * y[pos[n, j]] over pos >= 0, in float32."""
    n = tl.program_id(0).to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        if HAS_BASE:
            acc = tl.load(base_ptr + n * D + d, mask=m, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(KMAX):
            p = tl.load(pos_ptr + n * KMAX + j)
            # Padding (-1) reads row 0 (kmax > 0 means rows exist) and discards it (where, not * 0: inf).
            live = p >= 0
            p = tl.maximum(p, 0)
            row = tl.load(y_ptr + p * D + d, mask=m, other=0.0).to(tl.float32)
            if HAS_W:
                row = row * tl.load(w_ptr + p).to(tl.float32)
            acc += tl.where(live, row, 0.0)
        tl.store(out_ptr + n * D + d, acc.to(out_ptr.dtype.element_ty), mask=m)


def gather_sum(base, pos, w, y, n_tokens: int, like: torch.Tensor) -> torch.Tensor:
    """out[n] = base[n] + sum_j w[pos[n, j]] * y[pos[n, j]] (MoE combine; `pos` from ops._token_rows)."""
    D = like.shape[1]
    out = torch.empty(n_tokens, D, dtype=like.dtype, device=like.device)
    if out.numel():
        bd = _block_d(D)
        _gather_sum_kernel[(n_tokens,)](base if base is not None else out, pos, w if w is not None else out,
                                        y, out, pos.shape[1], D, HAS_BASE=base is not None, HAS_W=w is not None,
                                        BLOCK_D=bd, num_warps=_warps(bd))
    return out


@triton.jit
def _rotate_heads_kernel(src_ptr, cos_ptr, sin_ptr, dst_ptr, T, H, HALF,
                         s_b, s_t, s_h, s_d, c_b, c_t, c_d, d_b, d_t, d_h, d_d,
                         ROTATE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
    """Token (b, t): every head's halves x1, x2 -> (x1 cos - x2 sin, x2 cos + x1 sin) with the token's
    cos / sin row [HALF] (ROTATE; a plain copy otherwise), from src to dst, each [B, T, H, 2 HALF]
    by strides (either may be a [B, H, T, Dh] tensor's transpose)."""
    r = tl.program_id(0).to(tl.int64)
    b = r // T
    t = r % T
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_J)[None, :]
    m = (h < H) & (j < HALF)
    src = src_ptr + b * s_b + t * s_t + h * s_h
    dst = dst_ptr + b * d_b + t * d_t + h * d_h
    x1 = tl.load(src + j * s_d, mask=m).to(tl.float32)
    x2 = tl.load(src + (j + HALF) * s_d, mask=m).to(tl.float32)
    if ROTATE:
        c = tl.load(cos_ptr + b * c_b + t * c_t + j * c_d, mask=j < HALF).to(tl.float32)
        s = tl.load(sin_ptr + b * c_b + t * c_t + j * c_d, mask=j < HALF).to(tl.float32)
        x1, x2 = x1 * c - x2 * s, x2 * c + x1 * s
    tl.store(dst + j * d_d, x1.to(dst_ptr.dtype.element_ty), mask=m)
    tl.store(dst + (j + HALF) * d_d, x2.to(dst_ptr.dtype.element_ty), mask=m)


def rotate_heads(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, rotate: bool = True
                 ) -> torch.Tensor:
    """dst[b, t, h] = rotary(src[b, t, h]) (or a copy), src and dst [B, T, H, Dh] views of any strides,
    cos / sin [B, T, Dh/2]; arithmetic in float32, rounded once to dst's dtype."""
    B, T, H, Dh = src.shape
    if src.numel():
        bh, bj = triton.next_power_of_2(H), triton.next_power_of_2(max(Dh // 2, 1))
        _rotate_heads_kernel[(B * T,)](src, cos, sin, dst, T, H, Dh // 2, *src.stride(), *cos.stride(),
                                       *dst.stride(), ROTATE=rotate, BLOCK_H=bh, BLOCK_J=bj,
                                       num_warps=4 if bh * bj <= 1024 else 8)
    return dst


# ----------------------------------------------------------------------------- a block's elementwise work


def _block_cols(H: int) -> int:
    return min(triton.next_power_of_2(max(H, 1)), 1024)


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, out_ptr, H, gu_s, o_s, BLOCK: tl.constexpr):
    """Row r, columns c: out = silu(gate) * up with gate = gu[r, c], up = gu[r, H + c]. silu is
    rounded to out's dtype before the product, as the plain ops' intermediate is."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    gate = tl.load(gu_ptr + r * gu_s + c, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + r * gu_s + H + c, mask=m, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * o_s + c, (act * up).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, gu_ptr, dgu_ptr, H, g_s, gu_s, d_s, BLOCK: tl.constexpr):
    """Row r, columns c: the gate and up halves of the gradient of silu(gate) * up, silu recomputed
    (nothing but gate|up is saved); grad * up rounded before silu's backward, as autograd's is."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    grad = tl.load(g_ptr + r * g_s + c, mask=m, other=0.0).to(tl.float32)
    gate = tl.load(gu_ptr + r * gu_s + c, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + r * gu_s + H + c, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    act = (gate * sig).to(dgu_ptr.dtype.element_ty).to(tl.float32)
    grad_act = (grad * up).to(dgu_ptr.dtype.element_ty).to(tl.float32)
    d_gate = grad_act * sig * (1.0 + gate * (1.0 - sig))
    tl.store(dgu_ptr + r * d_s + c, d_gate.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dgu_ptr + r * d_s + H + c, (grad * act).to(dgu_ptr.dtype.element_ty), mask=m)


def swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2H] (unit stride along columns) -> silu(gate) * up [N, H]."""
    N, H = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(N, H, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        bc = _block_cols(H)
        _swiglu_fwd_kernel[(N, triton.cdiv(H, bc))](gate_up, out, H, gate_up.stride(0), out.stride(0), BLOCK=bc,
                                                    num_warps=_warps(bc))
    return out


def swiglu_bwd(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """grad [N, H], gate_up [N, 2H] (unit column strides) -> the gradient of gate_up [N, 2H]."""
    N, H = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(N, 2 * H, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        bc = _block_cols(H)
        _swiglu_bwd_kernel[(N, triton.cdiv(H, bc))](grad, gate_up, out, H, grad.stride(0), gate_up.stride(0),
                                                    out.stride(0), BLOCK=bc, num_warps=_warps(bc))
    return out


def _norm_warps(block_d: int) -> int:
    return 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, x_s, y_s, eps, BLOCK_D: tl.constexpr):
    """Row r: rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w, in float32, rounded once."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(x_ptr + r * x_s + d, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(rstd_ptr + r, rstd)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * y_s + d, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_bwd_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, N, D, ROWS, g_s, x_s, dx_s,
                         BLOCK_D: tl.constexpr):
    """Rows [p ROWS, (p + 1) ROWS): dx = (g w - xhat <g w, xhat> / D) rstd with xhat = x rstd, and
    this program's partial weight gradient sum(g xhat) into dw[p] (float32; summed on the host)."""
    p = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, ROWS):
        # The last program's rows past N re-read row N - 1 and discard it (vector masks: the
        # interpreter takes no scalar ones).
        r = tl.minimum(p * ROWS + i, N - 1)
        live = m & ((d * 0 + p * ROWS + i) < N)
        g = tl.load(g_ptr + r * g_s + d, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + r * x_s + d, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r)
        xhat = x * rstd
        gw = g * w
        dot = tl.sum(gw * xhat, axis=0) / D
        tl.store(dx_ptr + r * dx_s + d, ((gw - xhat * dot) * rstd).to(dx_ptr.dtype.element_ty), mask=live)
        acc += tl.where(live, g * xhat, 0.0)
    tl.store(dw_ptr + p * D + d, acc, mask=m)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] (unit column stride), weight [D] -> (y [N, D] in x's dtype, rstd [N] float32)."""
    N, D = x.shape
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    if N and D:
        bd = triton.next_power_of_2(D)
        _rms_norm_fwd_kernel[(N,)](x, weight, y, rstd, D, x.stride(0), y.stride(0), eps, BLOCK_D=bd,
                                   num_warps=_norm_warps(bd))
    return y, rstd


def _norm_programs(N: int, device: torch.device) -> int:
    """Programs of the norm's backward: a few per SM on a GPU (each sums its rows' weight gradient)."""
    per_device = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(N, per_device))


def rms_norm_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """grad, x [N, D] (unit column strides), weight [D], rstd [N] -> (grad_x in x's dtype, grad_w in
    weight's dtype)."""
    N, D = x.shape
    dx = torch.empty(N, D, dtype=x.dtype, device=x.device)
    if not (N and D):
        return dx, torch.zeros_like(weight)
    programs = _norm_programs(N, x.device)
    rows = triton.cdiv(N, programs)
    dw = torch.empty(programs, D, dtype=torch.float32, device=x.device)
    bd = triton.next_power_of_2(D)
    _rms_norm_bwd_kernel[(programs,)](grad, x, weight, rstd, dx, dw, N, D, rows, grad.stride(0), x.stride(0),
                                      dx.stride(0), BLOCK_D=bd, num_warps=_norm_warps(bd))
    return dx, dw.sum(0).to(weight.dtype)
