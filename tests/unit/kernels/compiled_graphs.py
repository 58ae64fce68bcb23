"""torch.compile with a backend that records the ops of the forward and backward graphs AOTAutograd
hands it (and runs them as traced): what the compiled-kernel tests check their opaque ops against."""

from __future__ import annotations

from typing import Callable

import torch
from torch._dynamo.backends.common import aot_autograd


def compile_recording(fn: Callable) -> tuple[Callable, dict[str, set]]:
    """-> (fn compiled whole, {"forward": ops, "backward": ops}: call_function targets, filled as it runs)."""
    targets: dict[str, set] = {"forward": set(), "backward": set()}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            targets[kind] |= {node.target for node in gm.graph.nodes if node.op == "call_function"}
            return gm
        return compile_graph

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    return torch.compile(fn, backend=backend, fullgraph=True), targets


def assert_compiled_matches_eager(fn: Callable, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> dict[str, set]:
    """fn compiled whole (compile_recording) against fn run eagerly on `inputs`: the same output, strides
    included, and the same input gradients for `grad`, exactly. -> the recorded graphs' ops."""
    eager = fn(*inputs)
    eager_grads = torch.autograd.grad(eager, inputs, grad)
    compiled_fn, targets = compile_recording(fn)
    compiled = compiled_fn(*inputs)
    compiled_grads = torch.autograd.grad(compiled, inputs, grad)
    assert compiled.stride() == eager.stride()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return targets
