"""The LM loss on CPU without tensor parallelism, a chunk of rows at a time.

    chunked_cross_entropy(logits, targets)           mean CE of materialized logits [..., V]
    linear_cross_entropy(h, weight, targets)         mean CE of h @ weight^T, the LM head run inside it
    linear_argmax(h, weight)                         argmax of h @ weight^T per row, without the logits

Both compute what F.cross_entropy(logits.float(), targets) computes (IGNORE_INDEX rows excluded
from the sum and the count). The fused one (`ForwardOptions(return_logits=False)`, the training
loop's and the step benchmark's forward) runs the LM head itself and computes the head's
gradients in forward, so backward only scales them by the loss's incoming scalar. The
returned-logits path allocates the [N, V] logits and, in backward, their gradient: fresh,
page-faulted allocations every step (64 MB each in float32 at nanoGPT's shape; in a 2-thread fp32
step the head's forward matmul into the logits ran at 143 GFLOP/s, the fused loss's chunked ones
at ~340). The fused one allocates no [N, V] tensor in float32 (a chunk's logits at a time; with
oneDNN's GEMMs, kernels/cpu_linear.py, a fresh chunk buffer each) and one in 16 bits.
tests/unit/model/test_fused.py holds both to F.linear + F.cross_entropy (values and gradients).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import cpu, cpu_linear
from ..parallel import parallel_argmax

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add no loss and do not count in the mean
# Logits per matmul chunk (16 MB in float32), and at least CE_CHUNK_MIN_ROWS rows whatever the
# vocabulary: the head's three matmuls per chunk run at full speed from ~512 rows. Forward + backward
# of the loss and head, 2048 rows, 2 threads: V 8192 131.6 -> 126.0 ms (256 -> 512 rows a chunk);
# V 32768, D 768 1676 -> 1046 ms (64 -> 512 rows; 1024 rows: no faster).
CE_CHUNK_ELEMENTS = 2**22
CE_CHUNK_MIN_ROWS = 512
CE_TILE_ELEMENTS = 2**19  # logits per softmax tile (2 MB in float32): one core's L2


def chunk_rows(n: int, vocab: int) -> int:
    """Rows of n per matmul chunk (CE_CHUNK_ELEMENTS logits, at least CE_CHUNK_MIN_ROWS rows;
    memory.py sizes the buffers with it)."""
    return max(1, min(n, max(CE_CHUNK_MIN_ROWS, CE_CHUNK_ELEMENTS // max(1, vocab))))


def tile_rows(n: int, vocab: int) -> int:
    """Rows of n per softmax tile (CE_TILE_ELEMENTS logits)."""
    return max(1, min(n, CE_TILE_ELEMENTS // max(1, vocab)))


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy [N] (float32) of logits [N, V] in any float dtype.

    Same math as F.cross_entropy(logits.float(), reduction="none"), but rows are processed in
    tiles (CE_TILE_ELEMENTS logits): no float32 copy, log-softmax or one-hot gradient buffer of the
    whole [N, V] (each a fresh page-faulted allocation per step on CPU); backward writes softmax -
    onehot once, in the logits' dtype. 16-bit logits are converted a tile at a time into the one
    reused float32 buffer, never by a mixed-dtype op: on CPU those cast their 16-bit input into a
    fresh temporary on every call (the forward's loop took 23 ms that way, 9 ms this way, on bf16
    logits at nanoGPT's shape).
    """

    @staticmethod
    def forward(ctx, logits, targets):
        rows = tile_rows(logits.shape[0], logits.shape[-1])
        valid = targets != IGNORE_INDEX
        safe = targets.masked_fill(~valid, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        buf = torch.empty(rows, logits.shape[-1], dtype=torch.float32, device=logits.device)
        for s in range(0, logits.shape[0], rows):
            chunk = logits[s:s + rows]
            b = buf[:chunk.shape[0]]
            if chunk.dtype != torch.float32:  # converted once, into the buffer (see above)
                chunk = b.copy_(chunk)
            peak = chunk.amax(dim=-1, keepdim=True)
            torch.sub(chunk, peak, out=b).exp_()  # one float32 buffer reused by every chunk
            torch.sum(b, dim=-1, out=lse[s:s + rows]).log_().add_(peak.squeeze(1))
        target_logit = logits.gather(1, safe.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.rows = rows
        return (lse - target_logit).masked_fill_(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad):
        logits, safe, valid, lse = ctx.saved_tensors
        g = grad.float().masked_fill(~valid, 0.0).unsqueeze(1)
        out = torch.empty_like(logits)
        # float32 logits: computed in place in the gradient; others: in one reused float32 buffer
        buf = None if logits.dtype == torch.float32 else torch.empty(
            ctx.rows, logits.shape[-1], dtype=torch.float32, device=logits.device)  # tile_rows: at most N
        for s in range(0, logits.shape[0], ctx.rows):
            e = s + ctx.rows
            p = out[s:e] if buf is None else buf[:out[s:e].shape[0]]
            chunk = logits[s:e] if buf is None else p.copy_(logits[s:e])
            torch.sub(chunk, lse[s:e].unsqueeze(1), out=p).exp_().mul_(g[s:e])  # softmax * grad
            p.scatter_add_(1, safe[s:e].unsqueeze(1), -g[s:e])
            if buf is not None:
                out[s:e].copy_(p)
        return out, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [..., V] against targets [...] (IGNORE_INDEX excluded), as
    F.cross_entropy(logits.float()) computes it; see _ChunkedCrossEntropy."""
    flat = targets.reshape(-1)
    loss = _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), flat)
    return loss.sum() / (flat != IGNORE_INDEX).sum()


def _cross_entropy_tiles(logits: torch.Tensor, safe: torch.Tensor, keep, losses: torch.Tensor, tile: int,
                         work, predictions=None) -> None:
    """The softmax passes of _LinearCrossEntropy in eager ops (the CPU kernel's cross_entropy_rows is
    held to them), a cache-sized tile of rows at a time: losses [n] = logsumexp - target logit of
    logits [n, V] (targets safe [n, 1]); with keep [n, 1] (a gradient is wanted) the rows become
    (softmax - onehot) * keep, rounded once to the logits' dtype; with predictions [n], each row's
    argmax. `work`: a float32 [tile, V] buffer for 16-bit logits; None works in place in float32
    logits (whose rows are then overwritten)."""
    for a in range(0, logits.shape[0], tile):
        b = min(logits.shape[0], a + tile)
        lg = logits[a:b]
        if predictions is not None:  # before the rows are overwritten; max(dim)'s index is argmax's, faster
            predictions[a:b] = lg.max(dim=-1).indices
        p = lg if work is None else work[:b - a]
        target_logit = lg.gather(1, safe[a:b]).to(p.dtype)
        if p is not lg:
            p.copy_(lg)
        peak = p.amax(dim=-1, keepdim=True)
        total = p.sub_(peak).exp_().sum(dim=-1, keepdim=True)
        torch.sub(total.log().add_(peak), target_logit, out=losses[a:b].unsqueeze(1))
        if keep is None:
            continue
        p.mul_(keep[a:b] / total).scatter_add_(1, safe[a:b], -keep[a:b])  # (softmax - onehot) / count
        if p is not lg:
            lg.copy_(p)  # the logits' rows become their gradient


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy (float32, or float64 for float64 math) of logits = h @ weight^T against
    targets (IGNORE_INDEX rows excluded), computed in `dtype` (autocast's, else h's), without the
    [N, V] logits.

    Per tile of rows (CE_TILE_ELEMENTS logits, sized for one core's L2: the softmax passes then
    re-read cache, not memory; in the bf16 loss, tiles of 64 rows instead of 256 took 55 -> 46 ms at
    nanoGPT's shape, 2 threads): the tile's logits, their float32 copy (16-bit) or themselves
    (float32) turned in place into exp(logit - row max), the row's logsumexp and loss (logsumexp -
    target logit, the target logit read from the logits in `dtype`, as F.cross_entropy on them reads
    it). When h or weight needs a gradient, the same buffer then becomes the gradient of the mean
    loss, (softmax - onehot) / count (zero for ignored rows). `predictions` (an int64 [N] tensor, or
    None) receives each row's argmax token from the same logits, before they are overwritten: the
    model's prediction, for callers that need it without the logits (early exit's labels).
    Float32: the logits come a chunk of rows (CE_CHUNK_ELEMENTS) at a time from one matmul into one
    reused buffer, and the head's backward matmuls run per chunk (grad_h rows = g @ weight,
    grad_weight += g^T @ h rows, accumulated in float32). 16-bit with a gradient: the logits come
    from one whole [N, V] matmul, each tile's gradient is rounded once to `dtype` into its rows, and
    the two backward matmuls run whole on that buffer, as autograd's would (per-chunk 16-bit partials
    of grad_weight would round once per chunk; the mixed-dtype accumulation also cost more). Without
    a gradient, a chunk of logits at a time in 16 bits too.
    With the fused CPU kernels (kernels/cpu.py; float32 / bf16 logits) a chunk's softmax passes are one
    call, per row: its max, exp(logit - max) into a float32 scratch row and its sum, the loss and the
    gradient written back (the bf16 loss + head: 44.7 -> 40.0 ms forward + backward at nanoGPT's shape,
    2 threads; float32 unchanged, its tiles were already in place).
    Backward multiplies both by the incoming scalar gradient (a scalar loss, so one number scales
    them all; usually 1, then they are handed over as they are).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, dtype, predictions, onednn):
        ctx.grads = None
        with torch.autocast(h.device.type, enabled=False):
            N, V = h.shape[0], weight.shape[0]
            wants_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            hc, wc = h.to(dtype), weight.to(dtype)
            valid = targets != IGNORE_INDEX
            safe = targets.masked_fill(~valid, 0).unsqueeze(1)
            count = valid.sum()
            # each row's weight in the mean: 1 / count for counted rows, 0 for ignored ones
            keep = (valid / count.clamp(min=1)).to(_math_dtype(dtype)).unsqueeze(1)
            # 16-bit with a gradient: the head's three matmuls whole, on one [N, V] buffer that holds the
            # logits, then their gradient; otherwise a chunk's logits at a time in one reused buffer
            whole = wants_grad and dtype != _math_dtype(dtype)
            # float32 on CPU: the chunks' GEMMs through oneDNN (kernels/cpu_linear.py), each into a fresh
            # buffer (it writes no out=): 194 -> 101 ms for the head's three at nanoGPT's shape, 2 threads
            onednn = onednn and not whole and cpu_linear.usable(hc, wc)
            rows = N if whole else chunk_rows(N, V)
            tile = tile_rows(rows, V)
            logits = torch.mm(hc, wc.t()) if whole else \
                None if onednn else torch.empty(rows, V, dtype=dtype, device=h.device)
            losses = torch.empty(N, dtype=_math_dtype(dtype), device=h.device)
            # float32 / bf16 logits (keep and losses then float32); oneDNN's chunks are fresh float32 CPU rows
            kernels = cpu.usable(hc.new_empty(0) if logits is None else logits) if N and V else None
            work = None if dtype == _math_dtype(dtype) or kernels else torch.empty(tile, V, dtype=torch.float32,
                                                                                   device=h.device)
            if wants_grad and not whole:
                grad_h = torch.empty(N, h.shape[1], dtype=dtype, device=h.device)
            grad_wt = None  # oneDNN: grad_w^T [D, V], the first chunk's product, the rest added to it
            if wants_grad and not whole and not onednn:
                # the first chunk's product is written, the rest accumulated: no zero-fill pass ([V, D])
                grad_w = (torch.empty if N else torch.zeros)(V, h.shape[1], dtype=_math_dtype(weight.dtype),
                                                             device=h.device)
            for s in range(0, N, rows):
                e = min(N, s + rows)
                if whole:
                    chunk = logits[s:e]
                else:
                    chunk = cpu_linear.matmul(hc[s:e], wc.t()) if onednn else \
                        torch.mm(hc[s:e], wc.t(), out=logits[:e - s])
                if kernels is not None:  # one pass per row; with keep, the chunk becomes its gradient
                    kernels.cross_entropy_rows(chunk, safe[s:e].view(-1), keep[s:e].view(-1) if wants_grad else None,
                                               losses[s:e], None if predictions is None else predictions[s:e])
                else:
                    _cross_entropy_tiles(chunk, safe[s:e], keep[s:e] if wants_grad else None, losses[s:e], tile, work,
                                         None if predictions is None else predictions[s:e])
                if wants_grad and onednn:
                    grad_h[s:e] = cpu_linear.matmul(chunk, wc)
                    # grad_w^T = h^T g: oneDNN copies only h^T [D, rows] (cpu_linear._transposes_g's choice)
                    part = cpu_linear.matmul(hc[s:e].t(), chunk)
                    grad_wt = part if grad_wt is None else grad_wt.add_(part)
                    del part
                elif wants_grad and not whole:
                    torch.mm(chunk, wc, out=grad_h[s:e])
                    if s == 0:
                        torch.mm(chunk.t(), hc[s:e], out=grad_w)
                    else:  # addmm with out=, not addmm_: FlopCounterMode has no formula for the in-place op
                        torch.addmm(grad_w, chunk.t(), hc[s:e], out=grad_w)
                del chunk  # oneDNN's chunks are fresh: freed before the next one is allocated
            if whole:
                grad_h, grad_w = torch.mm(logits, wc), torch.mm(logits.t(), hc)
                del logits
            elif wants_grad and onednn:
                grad_w = cpu_linear.transposed(grad_wt)
            if wants_grad:
                ctx.grads = (grad_h, grad_w)
            ctx.dtypes = (h.dtype, weight.dtype)
            return losses.masked_fill_(~valid, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice (retain_graph); its gradients are "
                               "computed once, in forward, and handed over in the first backward")
        (grad_h, grad_w), ctx.grads = ctx.grads, None  # handed over: autograd may adopt grad_w as .grad
        if grad.item() != 1.0:  # CPU only: no device sync; the common case returns them unscaled
            grad_h, grad_w = grad_h * grad.to(grad_h.dtype), grad_w * grad
        return grad_h.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None, None, None


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute h's logits in here: autocast's lower precision, else h's."""
    if torch.is_autocast_enabled(h.device.type) and h.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


@torch.no_grad()
def linear_argmax(h: torch.Tensor, weight: torch.Tensor, onednn: bool = True) -> torch.Tensor:
    """The argmax token of logits h @ weight^T (h [..., D], weight [V, D], no bias) per position, in
    the dtype F.linear would use here, a chunk of rows (chunk_rows) at a time into one reused buffer:
    no [N, V] logits (early exit's readouts; torch.argmax's index, parallel_argmax per chunk).
    `onednn`: float32 CPU chunks through oneDNN's GEMM (kernels/cpu_linear.py), as the head's linear,
    each into a fresh buffer (it writes no out=)."""
    flat = h.reshape(-1, h.shape[-1])
    dtype = _compute_dtype(h)
    with torch.autocast(h.device.type, enabled=False):
        hc, wc = flat.to(dtype), weight.to(dtype)
        N, V = flat.shape[0], weight.shape[0]
        rows = chunk_rows(N, V)
        out = torch.empty(N, dtype=torch.long, device=h.device)
        onednn = onednn and cpu_linear.usable(hc, wc)  # float32 on CPU, as _LinearCrossEntropy's chunks
        buf = None if onednn else torch.empty(rows, V, dtype=dtype, device=h.device)
        for s in range(0, N, rows):
            e = min(N, s + rows)
            out[s:e] = parallel_argmax(cpu_linear.matmul(hc[s:e], wc.t()) if onednn else
                                       torch.mm(hc[s:e], wc.t(), out=buf[:e - s]))
    return out.view(h.shape[:-1])


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         predictions: Optional[torch.Tensor] = None, onednn: bool = True) -> torch.Tensor:
    """Mean cross-entropy of logits h @ weight^T (h [..., D], weight [V, D], no bias) against
    targets [...] (IGNORE_INDEX excluded), in the dtype F.linear would use here (autocast's lower
    precision, else h's), without materializing the logits; see _LinearCrossEntropy. predictions: a
    contiguous int64 tensor shaped like targets, filled with the logits' argmax per position. `onednn`:
    float32 CPU chunks through oneDNN's GEMM (kernels/cpu_linear.py; False: torch's mm, as F.linear)."""
    flat = targets.reshape(-1)
    if predictions is not None and not (predictions.dtype == torch.long and predictions.is_contiguous()
                                        and predictions.shape == targets.shape):
        raise ValueError(f"linear_cross_entropy: predictions must be a contiguous int64 tensor shaped like targets "
                         f"{tuple(targets.shape)}, got {predictions.dtype} {tuple(predictions.shape)}")
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, flat, _compute_dtype(h),
                                     None if predictions is None else predictions.view(-1), onednn)
