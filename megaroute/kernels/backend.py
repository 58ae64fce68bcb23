"""Backend selection for token dispatch: routing.dispatch = auto | torch | triton.

    torch   reference.py everywhere (autograd does the backward)
    triton  the fused kernels; on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1)
    auto    triton for CUDA tensors when triton is installed, torch otherwise

Resolved per call from the input's device (a layer is often built on CPU and moved later), so
nothing is cached here.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import reference

BACKENDS = ("auto", "torch", "triton")


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"dispatch backend must be one of {BACKENDS}, got {name!r}")
    return name


def _triton_ops() -> ModuleType:
    try:
        return importlib.import_module(f"{__package__}.ops")
    except ImportError as e:
        raise ImportError("routing.dispatch=triton needs triton (pip install 'megaroute[triton]')") from e


def resolve(name: str, device: torch.device) -> ModuleType:
    """-> a module with gather / combine / permute / unpermute for tensors on `device`."""
    check_backend(name)
    if name == "torch" or (name == "auto" and (device.type != "cuda" or importlib.util.find_spec("triton") is None)):
        return reference
    ops = _triton_ops()
    interpreted = ops.tk.INTERPRETED
    if device.type == "cuda" and interpreted:
        if name == "auto":  # the interpreter on GPU tensors is correct but orders of magnitude slower
            return reference
    elif device.type != "cuda" and not interpreted:
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
    ops = resolve("auto", tensors[0].device)
    return None if ops is reference else ops
