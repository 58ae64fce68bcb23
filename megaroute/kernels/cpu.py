"""Fused CPU kernels for a block's work (cpu_fused.cpp), JIT-built once per environment.

    swiglu_forward / swiglu_backward      used by model/mlp.py's _SwiGLUFunction
    rotary_qkv_forward / _backward        used by model/rope.py's _SplitQKVRotary
    rms_norm_forward / rms_norm_backward  used by model/norm.py's _RMSNormFunction
    rotary_qkv_scatter / gather_heads     used by model/attention.py's forward_varlen without autograd
    rows_add                              model/routing/ragged.py's combine without autograd (x copied
                                          and the update added to the selected rows in one pass)
    router_grads                          model/routing/mod.py's _RouteTopkGather backward (x's three
                                          gradients summed and the router weight's in one pass)
    quantile_update                       model/routing/calibration.py's QuantileCut.update in one call
    causal_attention_forward / _backward  float32 attention, model/attention.py's _CausalAttentionF32
                                          (built where torch's headers declare the float32 brgemm);
                                          under torch.compile the registered ops
                                          torch.ops.megaroute.causal_attention_f32[_backward]
    attention_output(q)                   the layout the CPU attention functions return
    varlen_attention_forward              the same per (sequence, head) of rows laid end to end:
                                          forward_varlen in float32 without autograd (same condition)
    cross_entropy_rows                    the LM loss's softmax passes, model/lm_loss.py's
                                          _LinearCrossEntropy (per row: loss, and the gradient in place;
                                          optionally the row's argmax)
    row_argmax                            torch.argmax(-1) of [n, V] rows: parallel.parallel_argmax

Eager torch runs the first four as several elementwise passes with fresh temporaries (SwiGLU's
backward: three passes and a temporary; RoPE: eight strided passes 32 values wide; RMSNorm: five
passes, a reduction and a matrix-vector product; the varlen buckets: an index_select, RoPE, a cat
and an index_select); here each is one vectorised pass over its rows. Attention runs per head with
the head's data in cache through all its matmuls. `load()` builds the extension with
torch.utils.cpp_extension (g++ and ninja, ~30 s) into $TORCH_EXTENSIONS_DIR (default: <sys.prefix>/torch_extensions, where the launcher
puts DeepSpeed's CPU ops too), compiled for the CPU capability torch itself dispatches to (AVX2 or
AVX-512), and returns None where it cannot: not x86, no AVX2, no compiler, MEGAROUTE_CPU_KERNELS=0,
no C++ source (a converted model's remote code, hf/bundle.py, ships this module alone) or a failed
build (warned once). The callers then run their eager ops, which stay the reference
that tests/unit/kernels/test_cpu_fused.py holds these kernels to. Processes that need the kernels
while another builds them wait on torch's lock file in the build directory; a build killed midway
leaves that `lock` behind, and it must be deleted by hand (as for DeepSpeed's JIT-built ops).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from torch.utils.cpp_extension import load as load_extension

from .backend import aten_required, op_registered

SOURCE = Path(__file__).with_name("cpu_fused.cpp")
ENV_SWITCH = "MEGAROUTE_CPU_KERNELS"  # "0" turns the kernels off (the eager ops run)
DTYPES = (torch.float32, torch.bfloat16)
# Per capability torch reports: the macros ATen's Vectorized headers select on, and the ISA flags.
_CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


def unavailable_reason() -> Optional[str]:
    """Why the kernels cannot be built here (None: they can), without building anything."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if not SOURCE.is_file():  # this module shipped without its C++ source: a converted model's remote code
        return f"no {SOURCE.name} beside {Path(__file__).name}"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _CAPABILITY_FLAGS:
        return f"torch's CPU capability is {capability}, not AVX2 or AVX512"
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool, path=_search_path()) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH"
    return None


def _search_path() -> str:
    """PATH plus this interpreter's bin directory, where pip puts the ninja wheel's binary (a venv's
    python run by its path, not activated, does not have it on PATH)."""
    return os.pathsep.join([os.environ.get("PATH", os.defpath), os.path.dirname(sys.executable)])


def build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")
    return Path(root) / f"megaroute_cpu_fused_{torch.backends.cpu.get_cpu_capability().lower()}"


@functools.cache
def load() -> Optional[ModuleType]:
    """The built extension, or None (the reason warned once) where it cannot be built or loaded."""
    reason = unavailable_reason()
    if reason is not None:
        return None
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", *_CAPABILITY_FLAGS[torch.backends.cpu.get_cpu_capability()]]
    path = os.environ.get("PATH")
    os.environ["PATH"] = _search_path()  # torch's build runs `ninja` from PATH
    try:
        return load_extension(name=directory.name, sources=[str(SOURCE)], extra_cflags=flags,
                              extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as exc:  # a compiler or linker error: the eager ops still work
        warnings.warn(f"megaroute's fused CPU kernels did not build ({type(exc).__name__}: {exc}); "
                      "running the eager ops", RuntimeWarning, stacklevel=2)
        return None
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path


def _register_traceable_attention() -> None:
    """torch.ops.megaroute.causal_attention_f32(q, k, v) -> (out, logsumexp) and its backward op: the
    float32 attention kernels as ops torch.compile keeps opaque, with autograd. Compiled blocks
    otherwise trace attention as torch's CPU flash kernel, which took 111 ms of a dense fp32 step's
    forward + backward where these took 34 (2 threads; the compiled step 1.14x the eager one). Where
    the kernels are off or did not build, the ops run torch's flash kernel (what traced SDPA lowers
    to), whose (out, logsumexp) mean the same, in the same layouts. Registered once per process: a
    converted model's remote code carries its own copy of this module (hf/bundle.py), whose
    registration finds the ops there already."""
    if op_registered("causal_attention_f32"):
        return
    flash, flash_backward = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    @torch.library.custom_op("megaroute::causal_attention_f32", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
    def attention(q, k, v):
        kernel = getattr(load(), "causal_attention_forward", None)  # built with torch's float32 brgemm only
        if kernel is not None:
            out, lse = kernel(q, k, v)
            return out, lse
        out, lse = flash(q, k, v, 0.0, True)
        return attention_output(q).copy_(out), lse.contiguous()

    @attention.register_fake
    def _(q, k, v):
        return attention_output(q), q.new_empty(q.shape[:-1])

    @torch.library.custom_op("megaroute::causal_attention_f32_backward", mutates_args=(),
                             schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse) "
                                    "-> (Tensor, Tensor, Tensor)")
    def attention_backward(grad, q, k, v, out, lse):
        kernel = getattr(load(), "causal_attention_backward", None)
        if kernel is not None:
            dq, dk, dv = kernel(rows(grad), q, k, v, out, lse)
        else:
            dq, dk, dv = (g.contiguous() for g in flash_backward(grad, q, k, v, out, lse, 0.0, True))
        return dq, dk, dv

    @attention_backward.register_fake
    def _(grad, q, k, v, out, lse):
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)

    def save(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)

    def backward(ctx, grad, _grad_lse):
        return tuple(torch.ops.megaroute.causal_attention_f32_backward(grad, *ctx.saved_tensors))

    attention.register_autograd(backward, setup_context=save)


def attention_output(q: torch.Tensor) -> torch.Tensor:
    """An empty attention output for q [B, H, T, Dh], as the CPU attention functions return it: rows
    laid out [B, T, H, Dh] (the output projection reads them as [B * T, D] with no copy)."""
    B, H, T, Dh = q.shape
    return q.new_empty(B, T, H, Dh).permute(0, 2, 1, 3)


_register_traceable_attention()


def usable(*tensors: torch.Tensor, strided: tuple[torch.Tensor, ...] = ()) -> Optional[ModuleType]:
    """The extension when every tensor is a float32 / bfloat16 CPU tensor of one dtype, contiguous
    (`strided` ones: any strides with the last dimension contiguous, which the kernels taking
    [B, H, T, Dh] tensors read in place), and the plain ops are not required (backend.aten_required:
    torch.compile, FlopCounterMode, fake tensors); else None."""
    first = tensors[0]
    if (first.device.type != "cpu" or first.dtype not in DTYPES or aten_required()
            or any(t.device.type != "cpu" or t.dtype != first.dtype for t in (*tensors, *strided))
            or not all(t.is_contiguous() for t in tensors) or not all(_rows_contiguous(t) for t in strided)):
        return None
    return load()


def rows(t: torch.Tensor) -> torch.Tensor:
    """t when its last dimension is contiguous (what `strided` tensors need), else a contiguous copy."""
    return t if _rows_contiguous(t) else t.contiguous()


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 or t.numel() == 0


def main() -> int:
    """Builds the kernels now (`make install` does) and prints where they are, or why not."""
    reason = unavailable_reason()
    if reason is not None:
        print(f"megaroute CPU kernels: not built here ({reason}); the eager ops run")
        return 0
    module = load()
    print(f"megaroute CPU kernels: {module.__file__}" if module is not None
          else "megaroute CPU kernels: the build failed (see the warning); the eager ops run")
    return 0
