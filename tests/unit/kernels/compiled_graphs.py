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
