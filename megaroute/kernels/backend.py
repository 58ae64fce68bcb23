"""Backend selection for token dispatch: routing.dispatch = auto | torch | triton.

    torch   reference.py everywhere (autograd does the backward)
    triton  the fused kernels; on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1)
    auto    for CUDA tensors when triton is installed: the Triton kernels except those torch's own op
            outran on a GPU (AUTO_TORCH_OPS); torch otherwise, and wherever the kernels module is
            absent (a converted model's remote code, megaroute.hf.bundle)

Resolved per call from the input's device (a layer is often built on CPU and moved later), so
nothing is cached here. While torch.compile traces (train.compile's whole MoD and baseline layers)
every backend resolves to the plain ops, which inductor fuses itself.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import ModuleType, SimpleNamespace
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import reference

BACKENDS = ("auto", "torch", "triton")
DISPATCH_OPS = ("gather", "combine", "permute", "unpermute", "permute_groups", "unpermute_groups")
# On an H100 (kernels.bench, bf16, B 8, T 2048, k 256) torch's gather took 0.4-0.7x the Triton
# gather's time at D 1024, 2048 and 4096 (means); by medians, in a later session, the Triton gather's
# time swung 4-8x between runs and torch's did not. The other kernels were as fast as the PyTorch
# path or faster.
AUTO_TORCH_OPS = ("gather",)


def op_registered(name: str) -> bool:
    """Whether torch.ops.megaroute.<name> is registered already: by another copy of the module that
    registers it (a converted model's remote code carries copies, hf/bundle.py), as torch.library
    refuses a second registration."""
    return hasattr(torch.ops.megaroute, name)


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"dispatch backend must be one of {BACKENDS}, got {name!r}")
    return name


def _triton_ops() -> ModuleType:
    try:
        return importlib.import_module(f"{__package__}.ops")
    except ImportError as e:
        raise ImportError("routing.dispatch=triton needs triton (pip install 'megaroute[triton]')") from e


@cache
def _auto_cuda(ops: ModuleType) -> SimpleNamespace:
    return SimpleNamespace(**{op: getattr(reference if op in AUTO_TORCH_OPS else ops, op) for op in DISPATCH_OPS})


@cache
def _ops_shipped() -> bool:
    """False in a converted model's remote code (megaroute.hf.bundle), which ships no Triton kernels:
    there the PyTorch paths run on CUDA too."""
    return importlib.util.find_spec("triton") is not None and importlib.util.find_spec(f"{__package__}.ops") is not None


def _compiled_triton(device: torch.device) -> Optional[ModuleType]:
    """ops when Triton kernels run compiled on `device` (CUDA, triton and the kernels there, not interpreted)."""
    if device.type != "cuda" or not _ops_shipped():
        return None
    ops = _triton_ops()
    return None if ops.tk.INTERPRETED else ops  # the interpreter on GPU tensors: orders of magnitude slower


def resolve(name: str, device: torch.device) -> Union[ModuleType, SimpleNamespace]:
    """-> an object with the DISPATCH_OPS (gather / combine / permute / unpermute / ...) for tensors on `device`."""
    check_backend(name)
    if name == "torch" or torch.compiler.is_compiling():  # traced: inductor fuses the plain ops itself
        return reference
    if name == "auto":
        ops = _compiled_triton(device)
        return reference if ops is None else _auto_cuda(ops)
    ops = _triton_ops()
    if device.type != "cuda" and not ops.tk.INTERPRETED:
        raise RuntimeError(
            f"routing.dispatch=triton got {device.type} tensors: Triton kernels run on CPU only under the "
            "interpreter. Set TRITON_INTERPRET=1 before triton is first imported (the mode is fixed then), "
            "or use routing.dispatch=torch / auto.")
    return ops


def aten_required() -> bool:
    """True while hand-written kernels must step aside for the plain ops: under torch.compile (it
    fuses the plain ops itself) or a Python dispatch mode (FlopCounterMode, fake tensors: they must
    see the aten ops, which the kernels bypass)."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def compiled_cuda_ops(*tensors: torch.Tensor) -> Optional[ModuleType]:
    """ops (compiled Triton kernels) when every tensor is on CUDA, triton is installed and not
    interpreted, and the plain ops are not required (aten_required); else None."""
    if not tensors or any(t.device.type != "cuda" for t in tensors) or aten_required():
        return None
    return _compiled_triton(tensors[0].device)
