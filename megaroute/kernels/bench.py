"""Token-dispatch benchmark.

    python -m megaroute.kernels.bench [--batch 8 --seq-len 2048 --capacity 0.125 --d 2048 4096]

CUDA: achieved GB/s of each fused kernel (bytes it must move / time) against the device's peak
memory bandwidth (target >= 80% at D >= 2048) and against a measured device-to-device copy, and
its speedup over the unfused PyTorch chain (two roundings where the kernel rounds once) and over
what `routing.dispatch: torch` runs (reference.py; `auto` picks per op between the two:
backend.AUTO_TORCH_OPS); `--dtype bfloat16 float16 float32` for all three. Then the block's
elementwise kernels the eager CUDA model runs (SwiGLU and RMSNorm, forward and backward, on B*T
rows of width D) against the eager torch ops they replace.

CPU: the share of a routed block's time spent in dispatch on the PyTorch path (target <= 5%):
a MoD layer's training step (forward + backward) and a depth-gate layer's single-path inference,
each against the same dispatch ops timed alone at the same shapes. CPU times are this thread's
CPU time with one torch thread, so other load on a shared machine barely moves them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from megaroute.argtypes import fraction, positive_float, positive_int
from megaroute.bench.noise import against
from megaroute.config import ModelConfig, RoutingConfig
from megaroute.model.rope import Positions, RotaryEmbedding
from megaroute.model.routing import build_layer
from megaroute.model.routing.context import RoutingContext

from . import reference as ref
from .backend import resolve

CPU_TARGET = 0.05
GPU_TARGET = 0.80


# ----------------------------------------------------------------------------------------- CUDA


# Datasheet HBM bandwidth (GB/s), matched as substrings of the device name, most specific first:
# the fallback where the driver reports no memory clock (CUDA 13 dropped it from cudaDeviceProp).
PEAK_GBS = (
    ("H100 PCIe", 2000), ("H100 NVL", 3900), ("H200", 4800), ("H100", 3350),
    ("A100 80GB PCIe", 1935), ("A100-SXM4-80GB", 2039), ("A100", 1555), ("V100", 900),
)


def _peak_gbs(device: torch.device) -> tuple[float | None, str]:
    """-> (peak GB/s, where the figure comes from)."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:  # DDR: two transfers per clock
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    for key, gbs in PEAK_GBS:
        if key.lower() in props.name.lower():
            return float(gbs), "datasheet"
    return None, "unknown device"


def _timer() -> Callable[[Callable[[], object]], float]:
    """Triton's do_bench (L2 flushed before each timed call), returning the median in ms, not its
    default mean: on an H100 one width's column ran 2-8x slow for every kernel in one session and
    another width's in the next, which a few outlying calls would explain."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, return_mode="median")


def _copy_gbs(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Achievable bandwidth: a device-to-device copy of nbytes (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _timer()(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _unfused(B, T, D):
    """The chains the kernels replace, as a routed layer would write them without fusion."""
    def combine(x, idx, g, delta):
        update = (g.unsqueeze(-1) * delta).to(x.dtype)
        return x.scatter_add(1, idx.unsqueeze(-1).expand(-1, -1, D), update)

    def unpermute(h, slot, w, yf, yc):
        return h + w.unsqueeze(-1) * torch.cat([yf, yc]).index_select(0, slot.view(-1)).view(B, T, D)

    return {"gather": ref.gather, "combine": combine, "permute": ref.permute, "unpermute": unpermute}


def bench_cuda(args) -> None:
    import triton

    do_bench = _timer()
    device = torch.device("cuda")
    ops = resolve("triton", device)
    peak, source = (args.peak_gbs, "--peak-gbs") if args.peak_gbs else _peak_gbs(device)
    copy = _copy_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}: peak {peak or float('nan'):.0f} GB/s ({source}); "
          f"measured copy {copy:.0f} GB/s; triton {triton.__version__}, torch {torch.__version__}")
    B, T = args.batch, args.seq_len
    k = max(1, round(args.capacity * T))
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        es = torch.finfo(dtype).bits // 8
        for D in args.d:
            _bench_shape(ops, do_bench, device, dtype, dtype_name, es, B, T, k, D, peak, copy)
            torch.cuda.empty_cache()


def _bench_shape(ops, do_bench, device, dtype, dtype_name, es, B, T, k, D, peak, copy) -> None:
    x = torch.randn(B, T, D, device=device, dtype=dtype)
    idx = torch.rand(B, T, device=device).topk(k, dim=1).indices.sort(dim=1).values
    g, delta = torch.rand(B, k, device=device, dtype=dtype), torch.randn(B, k, D, device=device, dtype=dtype)
    slot, n_full = ref.path_slots(torch.rand(B, T, device=device) < 0.5)
    y = torch.randn(B * T, D, device=device, dtype=dtype)
    w = torch.ones(B, T, device=device, dtype=dtype)
    combine_out = torch.randn(B, T, D, device=device, dtype=dtype)
    unfused = _unfused(B, T, D)
    # What routing.dispatch=torch runs (reference.py: one rounding, float32 accumulation), the
    # alternative `auto` chooses between; combine's backward is autograd's through it.
    g_req, delta_req = g.detach().requires_grad_(), delta.detach().requires_grad_()
    ref_out = ref.combine(x, idx, g_req, delta_req)
    x_req, grad_sel = x.detach().requires_grad_(), torch.randn_like(delta)
    ref_gathered = ref.gather(x_req, idx)
    # name: (fused, unfused chain, torch backend or None where it is the unfused chain, bytes to move)
    cases = {
        "gather": (lambda: ops.gather(x, idx), lambda: unfused["gather"](x, idx), None, 2 * B * k * D * es),
        # _Gather.backward: a zeroed x-shaped gradient, the selected rows written into it
        "gather bwd": (lambda: ops.tk.scatter_rows(grad_sel, idx, x.new_zeros(x.shape)),
                       lambda: torch.autograd.grad(ref_gathered, x_req, grad_sel, retain_graph=True), None,
                       (B * T * D + 2 * B * k * D) * es),
        "combine fwd": (lambda: ops.combine(x, idx, g, delta), lambda: unfused["combine"](x, idx, g, delta),
                        lambda: ref.combine(x, idx, g, delta), (2 * B * T * D + B * k * D) * es),
        "combine bwd": (lambda: ops.tk.combine_bwd(combine_out, idx, g, delta, need_grad_g=True),
                        lambda: (g.unsqueeze(-1) * ref.gather(combine_out, idx),
                                 (ref.gather(combine_out, idx) * delta).sum(-1)),
                        lambda: torch.autograd.grad(ref_out, (g_req, delta_req), combine_out, retain_graph=True),
                        3 * B * k * D * es),
        "permute": (lambda: ops.permute(x, slot), lambda: unfused["permute"](x, slot), None, 2 * B * T * D * es),
        "unpermute": (lambda: ops.unpermute(x, slot, w, y[:n_full], y[n_full:]),
                      lambda: unfused["unpermute"](x, slot, w, y[:n_full], y[n_full:]),
                      lambda: ref.unpermute(x, slot, w, y[:n_full], y[n_full:]), 3 * B * T * D * es),
    }
    print(f"\nB={B} T={T} k={k} D={D} {dtype_name}")
    for name, (fused, chain, torch_backend, nbytes) in cases.items():
        t_fused, t_chain = do_bench(fused), do_bench(chain)  # ms
        t_torch = t_chain if torch_backend is None else do_bench(torch_backend)
        print(_row(name, t_fused, nbytes, peak, copy) + f"x{t_chain / t_fused:4.1f} vs unfused ({t_chain * 1e3:.1f} us)  "
              f"x{t_torch / t_fused:4.1f} vs dispatch=torch ({t_torch * 1e3:.1f} us){_verdict(t_fused, nbytes, peak, D)}")
    # A block's elementwise work on B*T rows of D features (SwiGLU's hidden width taken as D): the
    # Triton kernels mlp.swiglu and norm.RMSNorm run on CUDA, against the eager ops they replace.
    rows = B * T
    gate_up, grad = torch.randn(rows, 2 * D, device=device, dtype=dtype), torch.randn(rows, D, device=device, dtype=dtype)
    gu_req = gate_up.detach().requires_grad_()
    eager_swiglu = torch.nn.functional.silu(gu_req[:, :D]) * gu_req[:, D:]
    h, weight = torch.randn(rows, D, device=device, dtype=dtype), torch.rand(D, device=device, dtype=dtype) + 0.5
    h_req, w_req = h.detach().requires_grad_(), weight.detach().requires_grad_()
    eager_norm = torch.nn.functional.rms_norm(h_req, (D,), w_req, 1e-5)
    normed, rstd = ops.tk.rms_norm_fwd(h, weight, 1e-5)
    block = {  # name: (kernel, eager ops, bytes to move)
        "swiglu fwd": (lambda: ops.tk.swiglu_fwd(gate_up),
                       lambda: torch.nn.functional.silu(gate_up[:, :D]) * gate_up[:, D:], 3 * rows * D * es),
        "swiglu bwd": (lambda: ops.tk.swiglu_bwd(grad, gate_up),
                       lambda: torch.autograd.grad(eager_swiglu, gu_req, grad, retain_graph=True), 5 * rows * D * es),
        "rms_norm fwd": (lambda: ops.tk.rms_norm_fwd(h, weight, 1e-5),
                         lambda: torch.nn.functional.rms_norm(h, (D,), weight, 1e-5), 2 * rows * D * es),
        "rms_norm bwd": (lambda: ops.tk.rms_norm_bwd(normed, h, weight, rstd),
                         lambda: torch.autograd.grad(eager_norm, (h_req, w_req), normed, retain_graph=True),
                         3 * rows * D * es),
    }
    for name, (kernel, eager, nbytes) in block.items():
        t_kernel, t_eager = do_bench(kernel), do_bench(eager)
        print(_row(name, t_kernel, nbytes, peak, copy)
              + f"x{t_eager / t_kernel:4.1f} vs eager torch ({t_eager * 1e3:.1f} us){_verdict(t_kernel, nbytes, peak, D)}")


def _row(name: str, ms: float, nbytes: int, peak, copy: float) -> str:
    gbs = nbytes / (ms * 1e-3) / 1e9
    share = f"{gbs / peak:6.1%} of peak, " if peak else ""
    return f"  {name:12s} {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s ({share}{gbs / copy:6.1%} of copy)  "


def _verdict(ms: float, nbytes: int, peak, D: int) -> str:
    if not peak or D < 2048:
        return ""
    return "  ok" if nbytes / (ms * 1e-3) / 1e9 / peak >= GPU_TARGET else "  BELOW TARGET"


# ------------------------------------------------------------------------------------------ CPU


def _cpu_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def bench_cpu(args) -> None:
    torch.set_num_threads(1)  # thread_time measures this thread only
    torch.manual_seed(0)
    B, T, D = args.cpu_batch, args.cpu_seq_len, args.cpu_d
    model_cfg = ModelConfig(vocab_size=256, d_model=D, n_layers=2, n_heads=max(1, D // 64), max_seq_len=T)
    rope = RotaryEmbedding(model_cfg.head_dim, T, model_cfg.rope_theta)
    pos = Positions(rope, torch.arange(T).expand(B, T))
    x = torch.randn(B, T, D)
    print(f"CPU, PyTorch dispatch path, one thread: B={B} T={T} D={D} capacity={args.capacity}")

    # MoD training step: route -> gather -> block -> combine, forward + backward.
    mod = build_layer(1, model_cfg, RoutingConfig(method="mod", capacity=args.capacity, dispatch="torch"))
    k = max(1, round(args.capacity * T))

    grad_out = torch.randn(B, T, D)

    def mod_step():
        xg = x.detach().requires_grad_()
        mod(xg, pos, RoutingContext(), "layer_1").backward(grad_out)

    idx = torch.rand(B, T).topk(k, dim=1).indices.sort(dim=1).values
    g, delta = torch.rand(B, k, requires_grad=True), torch.randn(B, k, D, requires_grad=True)
    grad_sel = torch.randn(B, k, D)

    def mod_dispatch():  # the same gather and combine, forward and backward, nothing else
        xg = x.detach().requires_grad_()
        torch.autograd.backward([ref.gather(xg, idx), ref.combine(xg, idx, g, delta)], [grad_sel, grad_out])

    # Depth gate inference: attention for all, then each token down one FFN (permute / unpermute).
    gate = build_layer(1, model_cfg, RoutingConfig(method="depth_gate", dispatch="torch")).eval()
    slot, n_full = ref.path_slots(torch.rand(B, T) < gate.cfg.budget)
    w = torch.ones(B, T)
    y = torch.randn(B * T, D)

    @torch.no_grad()
    def gate_infer():
        gate(x, pos, RoutingContext(), "layer_1")

    @torch.no_grad()
    def gate_dispatch():
        ref.permute(x, slot)
        ref.unpermute(x, slot, w, y[:n_full], y[n_full:])

    for name, (layer_fn, dispatch_fn) in {"MoD train step": (mod_step, mod_dispatch),
                                          "depth-gate inference": (gate_infer, gate_dispatch)}.items():
        t_layer, t_dispatch = _cpu_time(layer_fn, args.repeat), _cpu_time(dispatch_fn, args.repeat)
        share = t_dispatch / t_layer
        verdict = "ok" if share <= CPU_TARGET else "ABOVE TARGET"
        print(f"  {name:22s} layer {t_layer * 1e3:8.2f} ms  dispatch {t_dispatch * 1e3:7.2f} ms  "
              f"share {against(100 * share, 100 * CPU_TARGET, digits=1):>4}%  (target <= {CPU_TARGET:.0%}: {verdict})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--capacity", type=fraction, default=0.125)
    p.add_argument("--d", type=positive_int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--dtype", nargs="+", choices=["bfloat16", "float16", "float32"], default=["bfloat16"])
    p.add_argument("--peak-gbs", type=positive_float, default=None, help="override the device's peak bandwidth")
    p.add_argument("--cpu-batch", type=positive_int, default=2)
    p.add_argument("--cpu-seq-len", type=positive_int, default=512)
    p.add_argument("--cpu-d", type=positive_int, default=512)
    p.add_argument("--repeat", type=positive_int, default=5)
    p.add_argument("--cpu", action="store_true", help="the CPU measurement even where CUDA is available")
    args = p.parse_args(argv)
    if torch.cuda.is_available() and not args.cpu:
        bench_cuda(args)
    else:
        if not args.cpu:
            print("No CUDA device: kernel bandwidth and speedups need a GPU; measuring the CPU dispatch share.\n")
        bench_cpu(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
