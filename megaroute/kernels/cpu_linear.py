"""float32 CPU linears with their three GEMMs through oneDNN, the library torch's bf16 CPU matmuls
and its inductor already use, instead of torch's float32 `mm` (MKL's sgemm in torch's wheels).

    linear(x, weight, bias=None, fused=True)
                                   F.linear's values and gradients; oneDNN where `usable` (and `fused`),
                                   else F.linear
    usable(x, weight, bias=None)   whether linear takes the oneDNN path for these tensors
    matmul(a, b)                   a @ b of 2-D float32 CPU matrices through the same GEMM
    Linear                         nn.Linear through `linear` (the routing methods' gates and heads)

Why: MKL picks its kernels by CPU vendor, and on AMD CPUs with AVX-512 (the EPYC CI machines) its
sgemm ran at 203-222 GFLOP/s on a block's shapes (2048 x 384 x 384..2048, 2 threads) where oneDNN's
ran at 467-496 (at 8192 outputs: 160 against 270), each at strict float32 (no bf16 or tf32 inner
products: errors against float64 within 2-4x of MKL's, a different summation order). The three
GEMMs are oriented the way oneDNN runs fastest. Its first operand must be contiguous, so the weight
gradient takes the orientation that lays out fewer elements transposed: (x^T g)^T at 2048 rows,
384 -> 1152 (4.8 against 5.7 ms with torch's transposing copy), g^T x at 1024 -> 384 (4.5 against
5.3 ms) and at MoD's 256 rows (a [2048, 384] transposed result copy alone took 0.65 ms there). The
transposes run through the fused CPU kernels (`transposed`), ~3x faster than torch's copy.

Under torch.compile the GEMMs stay oneDNN's, as one opaque registered op (torch.ops.megaroute.
onednn_linear): inductor would lower them to torch's mm. The reference math (Transformer.set_fused(False),
the `reference` variant of bench.step) keeps F.linear, and so does everything that must see the aten
ops or other precisions: autocast (bf16 already runs through oneDNN), FlopCounterMode and fake tensors
(backend.aten_required), non-CPU tensors, empty inputs, one output feature (a gate's readout: torch's gemv took 10-45 us where
oneDNN's call took 30-65), or a torch without oneDNN or its `mkldnn::_linear_pointwise` op (which
inductor's CPU linears lower to). tests/unit/kernels/test_cpu_linear.py holds the values and
gradients to F.linear's.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu, functions
from .backend import aten_required, op_registered


# Rows of a GEMM beyond one bucket are padded (zero rows) to a multiple of this: oneDNN builds a
# primitive per shape (0.3-1.6 ms each here), and ragged selections (hard halting, causal MoD) bring a
# new row count to every layer of every batch. With fresh masks per forward and no bucket, a
# hard-halting forward took 1.17x dense's time at the char shape and 0.94x at nanoGPT's. The bucket's
# padding is work too: at 64 rows (~2% more rows at 80% executed) hard / dense was 0.875 at nanoGPT's
# shape and 0.972 at the char shape, at 16 rows 0.865 and 0.963 (per-round medians, one process,
# buckets interleaved round by round, 30 and 60 rounds, 1 thread).
ROW_BUCKET = 16


@functools.cache
def _onednn_linear():
    """torch.ops.mkldnn._linear_pointwise, or None where this torch does not have it."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def _register_traceable_op() -> bool:
    """torch.ops.megaroute.onednn_linear(x, weight, bias): the oneDNN GEMM as an op torch.compile keeps
    opaque. Inductor lowers float32 CPU training linears to torch's mm (MKL's slow path on AMD: a
    compiled dense fp32 step took 1.74x the eager one), and cannot lower the raw oneDNN op with a plain
    weight. Registered once per process: a converted model's remote code carries its own copy of this
    module (hf/bundle.py), whose registration finds the op there already. False without oneDNN."""
    if _onednn_linear() is None:
        return False
    if op_registered("onednn_linear"):
        return True

    @torch.library.custom_op("megaroute::onednn_linear", mutates_args=(),
                             schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    def onednn_linear(x, weight, bias):
        return _onednn_linear()(x, weight, bias, "none", [], "")

    @onednn_linear.register_fake
    def _(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    return True


TRACEABLE = _register_traceable_op()


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    """GEMMs of these tensors would run through oneDNN here: all float32 on CPU, no autocast, oneDNN
    built, and no dispatch mode (FlopCounterMode, fake tensors: they must see the aten ops) unless
    torch.compile is tracing, where the GEMMs go through the registered op (_register_traceable_op)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) or torch.is_autocast_enabled("cpu"):
        return False
    if torch.compiler.is_compiling():
        return TRACEABLE
    return not aten_required() and _onednn_linear() is not None


def usable(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """True when linear(x, weight, bias) runs through oneDNN (see the module docstring for when it does not)."""
    return (weight.dim() == 2 and weight.shape[0] > 1 and x.numel() > 0
            and _float32_cpu(x, weight, *(() if bias is None else (bias,))))


def bucket_rows(rows: int, like: torch.Tensor) -> int:
    """`rows` rounded up to the row bucket for CPU tensors like `like` whose GEMMs oneDNN runs (rows
    itself within one bucket, or elsewhere): float32 through `linear`, which pads to it, and bf16 or
    under CPU autocast through torch's own oneDNN matmuls, which build a primitive per shape as well
    (a bf16 [n, 384] x [384, 1152] GEMM at a row count not seen before took 3.2 us a row against 1.9
    at one seen, 1 thread). Callers that lay out their rows anyway (the ragged routed path) pad
    once, and then no linear copies its input to pad it."""
    return _bucket(rows) if _float32_cpu(like) or _onednn_bf16_cpu(like) else rows


def _onednn_bf16_cpu(t: torch.Tensor) -> bool:
    """t's GEMMs run in bf16 through torch's oneDNN matmuls: bf16 CPU, or float32 under CPU autocast
    (bf16), with oneDNN built and no dispatch mode (which must see the aten ops unpadded)."""
    bf16 = t.dtype == torch.bfloat16 or (t.dtype == torch.float32 and torch.is_autocast_enabled("cpu")
                                         and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    return (t.device.type == "cpu" and bf16 and torch.backends.mkldnn.is_available()
            and not torch.compiler.is_compiling() and not aten_required())


def _bucket(rows: int) -> int:
    return rows if rows <= ROW_BUCKET else math.ceil(rows / ROW_BUCKET) * ROW_BUCKET


def _linear(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x2d @ weight^T (+ bias) through oneDNN: weight with any strides; x2d is laid out contiguous first
    when it is not (oneDNN would copy it; a transposed x2d by `transposed`). While traced
    (torch.compile, including its tracing of _LinearFunction's backward) through the registered op."""
    if aten_required():
        return torch.ops.megaroute.onednn_linear(x2d, weight, bias)
    if not x2d.is_contiguous() and x2d.stride(0) == 1:  # a transposed matrix: laid out by `transposed`
        x2d = transposed(x2d.t())
    return _onednn_linear()(x2d, weight, bias, "none", [], "")


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b [k, n] through oneDNN's float32 GEMM (the measured peak bench.step compares with)."""
    return _linear(a, b.t())


def _transposes_g(rows: int, inputs: int, outputs: int) -> bool:
    """The weight gradient's orientation with the fewer elements copied: oneDNN copies its first
    operand contiguous, so g^T x copies g^T [outputs, rows], and (x^T g)^T copies x^T [inputs, rows]
    and then its [outputs, inputs] result."""
    return outputs * rows <= inputs * rows + outputs * inputs


def transposed(t2d: torch.Tensor) -> torch.Tensor:
    """t2d^T, contiguous: by the fused CPU kernel (cpu.py's transpose_matrix: both threads in 16-row
    strips) for a contiguous float32 CPU matrix, else by torch's copy, which runs one thread through
    scalar blocks. The weight gradients' transposed operands took ~4% of a dense fp32 step at nanoGPT's
    shape that way (A/B in one process, with the LM loss's weight-gradient transpose: dense step
    507.1 -> 490.0 ms, MoD 339.4 -> 329.7, 2 threads)."""
    kernels = cpu.usable(t2d) if t2d.dtype == torch.float32 and t2d.dim() == 2 else None
    return kernels.transpose_matrix(t2d) if kernels is not None else t2d.t().contiguous()


def _bucketed(t2d: torch.Tensor) -> torch.Tensor:
    """t2d [rows, n] with zero rows appended up to the row bucket: arithmetic only, so backward pads g
    as forward padded x whatever dispatch mode or autocast state backward runs under."""
    rows = t2d.shape[0]
    size = _bucket(rows)
    if size == rows:
        return t2d
    padded = t2d.new_empty(size, t2d.shape[1])
    padded[:rows].copy_(t2d)
    padded[rows:].zero_()  # zeros, not garbage: the weight gradient sums over these rows
    return padded


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        x2d = _bucketed(x2d)
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return _linear(x2d, weight, bias)[:rows].view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2d, weight = ctx.saved_tensors  # x2d: bucketed rows
        g2d = grad.reshape(-1, weight.shape[0])
        rows = g2d.shape[0]
        g = _bucketed(g2d)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _linear(g, weight.t())[:rows].view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            (padded, inputs), outputs = x2d.shape, weight.shape[0]
            if _transposes_g(padded, inputs, outputs):
                grad_w = _linear(g.t(), x2d.t())  # g^T x
            else:  # (x^T g)^T, made contiguous, as the parameter's .grad is kept
                grad_w = transposed(_linear(x2d.t(), g.t()))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           fused: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias), its GEMMs through oneDNN where `usable` (float32 CPU); F.linear itself
    elsewhere and with `fused` False (a module's switch, Transformer.set_fused)."""
    if not (fused and usable(x, weight, bias)):
        return F.linear(x, weight, bias)
    return functions.apply(_LinearFunction, x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, init and state dict) whose float32 CPU GEMMs run through oneDNN
    (`linear`): the routing methods' gates, routers and heads, which run on every token. `fused`
    False (Transformer.set_fused) runs F.linear."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fused)
