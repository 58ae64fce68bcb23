"""Fused token-dispatch kernels for routed layers, importable as `megaroute.kernels`.

    reference  pure-PyTorch semantics (gather, combine, path_slots, permute, unpermute)
    ops        the same ops as Triton kernels with autograd.Function wrappers (imports triton), and
               rotary_qkv (RoPE of a qkv projection, the CUDA path of rope.split_qkv_rotary)
    backend    routing.dispatch = auto | torch | triton -> reference, ops, or per op (auto on CUDA)
    bench      `python -m megaroute.kernels.bench`
    cpu        fused CPU kernels for a block's elementwise work (SwiGLU, RoPE, RMSNorm), JIT-built C++
    cpu_linear float32 CPU linears with their GEMMs through oneDNN (the parallel layers, the LM loss)
    functions  `apply`: a Function's forward run directly where autograd records nothing (inference)

Routed layers reach these only through `megaroute.model.routing.dispatch.Dispatcher`, the RoPE through
`compiled_cuda_ops` (CUDA tensors only). Importing this package does not import triton; `ops` is
loaded on first use of the triton backend.
"""

from . import reference
from .backend import BACKENDS, check_backend, compiled_cuda_ops, resolve

__all__ = ["BACKENDS", "check_backend", "compiled_cuda_ops", "reference", "resolve"]
