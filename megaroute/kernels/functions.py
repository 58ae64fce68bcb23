"""`apply`: run an autograd Function's forward without autograd's machinery where autograd would record
nothing (inference: decoding, hard halting, causal MoD, evaluation).

Function.apply costs ~5-10 us a call on CPU even under torch.no_grad (wrapping, unwrapping, the
node's bookkeeping), and a forward pass calls megaroute's Functions (linears, RMSNorm, SwiGLU, RoPE,
attention, the dispatch kernels) ~8 times a block. Batch-1 greedy decoding at nanoGPT's shape
(`bench.step`'s sampling_speed: fp32, CPU, 2 threads, 4 runs each way interleaved in one process,
medians): dense 305 -> 337 tokens/s, calibrated MoD 428 -> 475, hard halting 221 -> 242, depth gate
244 -> 262; a forward of a 6-layer d 32 model 1.54 -> 1.34 ms. The values are the forward's own, bit
for bit (tests/unit/kernels/test_functions.py).
"""

from __future__ import annotations

import torch


class _Unrecorded:
    """The `ctx` of a forward run outside autograd: what it saves is dropped (there is no backward)."""

    def __init__(self, n_inputs: int):
        self.needs_input_grad = (False,) * n_inputs

    def save_for_backward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def records(*args) -> bool:
    """Whether autograd would record a node for these inputs: grad mode on and a tensor that requires
    grad. While torch.compile traces, always (dynamo handles Function.apply itself)."""
    return torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args))


def apply(function: type[torch.autograd.Function], *args):
    """function.apply(*args) where autograd records (`records`); otherwise function.forward(ctx, *args)
    with a ctx that keeps nothing: the same outputs. For Functions whose forward takes ctx first and
    uses it only to save tensors, mark outputs and set attributes (every one in megaroute)."""
    if records(*args):
        return function.apply(*args)
    return function.forward(_Unrecorded(len(args)), *args)
