"""Training-step throughput of a dense vs a Mixture-of-Depths model of the same shape.

    python -m megaroute.bench.step [--steps 10 --warmup 3 --precision fp32 bf16 --profile]
    python -m megaroute.bench.step --device cuda [--shape 157m --batch 8 16 --seq-len 1024]
    python -m megaroute.bench.step --device cuda --config configs/dense_350m.yaml configs/mod_350m.yaml

Times full training steps (forward + backward + AdamW step) and compares the MoD/dense
step-time ratio with the analytic FLOPs ratio from megaroute.flops. Target: the MoD step
costs at most 1.15 x its FLOPs share of a dense step, i.e. routing overhead (router, top-k,
gather/scatter) stays small.

CPU (default): the 6-layer/384 shape; dense and MoD steps alternate so machine noise hits both
alike. On a shared machine wall-clock times swing with other load; `--threads 1 --clock thread`
measures this thread's CPU time instead, which other processes barely disturb.

CUDA (`--device cuda`): dense_157m and mod_157m (configs/, or `--shape`/`--config`) at realistic
micro-batches, bf16 autocast over fp32 weights with fused AdamW (fp16 + GradScaler where the GPU
has no bf16), timed with CUDA events. Prints step time, tokens/s, achieved model TFLOP/s and MFU
against the device's datasheet peak (megaroute.flops, `--peak-tflops` overrides), with a measured
matmul peak beside it; then greedy KV-cache sampling tokens/s of MoD vs dense (`--no-sample` skips).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from ..config import ModelConfig, RoutingConfig, load_config
from ..flops import flops_per_token, peak_flops
from ..model import ForwardOptions, build_model
from .convert import calibrate_predictors

TARGET = 1.15
SHAPE = ModelConfig(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, max_seq_len=256)
VARIANTS = {
    "dense": RoutingConfig(),
    "mod": RoutingConfig(method="mod", capacity=0.125, every=2, offset=1),
}
PHASES = ("forward", "backward", "optimizer")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHAPES = ("small", "157m", "350m", "760m", "1b")  # small = SHAPE; the others: configs/{dense,mod}_<size>.yaml
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Trainer:
    """One model, its optimizer and a fixed batch; `step()` runs one full training step."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    tokens: torch.Tensor
    targets: torch.Tensor
    precision: str
    scaler: Optional[torch.amp.GradScaler] = field(default=None)  # fp16 on CUDA

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def autocast(self):
        if self.precision not in AMP_DTYPES:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=AMP_DTYPES[self.precision])

    def step(self, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
        """Runs one step; returns seconds per phase (CPU ops are synchronous; CUDA uses events)."""
        if self.device.type == "cuda":
            return self._cuda_step()
        t0 = clock()
        with self.autocast():
            loss = self.model(self.tokens, targets=self.targets).loss
        t1 = clock()
        loss.backward()
        t2 = clock()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        t3 = clock()
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}

    def _cuda_step(self) -> dict[str, float]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        with self.autocast():
            loss = self.model(self.tokens, targets=self.targets).loss
        events[1].record()
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        events[2].record()
        if self.scaler is not None:
            self.scaler.step(self.optim)
            self.scaler.update()
        else:
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        events[3].record()
        events[3].synchronize()
        return {ph: events[i].elapsed_time(events[i + 1]) / 1e3 for i, ph in enumerate(PHASES)}


def make_trainer(routing: RoutingConfig, precision: str, batch: int, seq_len: int, seed: int = 0,
                 device: str = "cpu", shape: Optional[ModelConfig] = None) -> Trainer:
    shape = shape or SHAPE
    torch.manual_seed(seed)
    cuda = torch.device(device).type == "cuda"
    model = build_model(shape, routing, device=device)  # fp32 weights: autocast runs the math in 16 bits
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True if cuda else None)
    data = torch.randint(0, shape.vocab_size, (batch, seq_len + 1)).to(device)
    scaler = torch.amp.GradScaler("cuda") if cuda and precision == "fp16" else None
    return Trainer(model, optim, data[:, :-1], data[:, 1:], precision, scaler)


def load_variants(shape: str = "small", configs: Optional[list[str]] = None) -> dict[str, tuple[ModelConfig, RoutingConfig]]:
    """name -> (model shape, routing): the built-in small pair, configs/{dense,mod}_<shape>.yaml, or
    explicit config files (named by their `variant`, else their `name`)."""
    if shape == "small" and not configs:
        return {name: (SHAPE, routing) for name, routing in VARIANTS.items()}
    paths = configs or [str(CONFIGS / f"dense_{shape}.yaml"), str(CONFIGS / f"mod_{shape}.yaml")]
    out: dict[str, tuple[ModelConfig, RoutingConfig]] = {}
    for path in paths:
        if not os.path.isfile(path):
            raise SystemExit(f"no config {path} (the configs/ directory of a source checkout)")
        cfg = load_config(path, [])
        out[cfg.variant if cfg.variant not in out else cfg.name] = (cfg.model, cfg.routing)
    return out


def bench(precision: str, steps: int, warmup: int, batch: int, seq_len: int,
          clock: Callable[[], float] = time.perf_counter, device: str = "cpu",
          variants: Optional[dict[str, tuple[ModelConfig, RoutingConfig]]] = None) -> dict[str, list[dict[str, float]]]:
    """Per-step phase times for each variant. CPU: dense and MoD steps interleaved. CUDA: one variant
    after the other (a GPU is not shared with other load, and two large models need not fit at once)."""
    variants = variants or {name: (SHAPE, r) for name, r in VARIANTS.items()}
    times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    if torch.device(device).type == "cuda":
        for name, (shape, routing) in variants.items():
            trainer = make_trainer(routing, precision, batch, seq_len, device=device, shape=shape)
            for i in range(warmup + steps):
                phases = trainer.step()
                if i >= warmup:
                    times[name].append(phases)
            del trainer
            torch.cuda.empty_cache()
        return times
    trainers = {name: make_trainer(r, precision, batch, seq_len, shape=shape) for name, (shape, r) in variants.items()}
    for i in range(warmup + steps):
        for name, trainer in trainers.items():
            phases = trainer.step(clock)
            if i >= warmup:
                times[name].append(phases)
    return times


def profile_mod(precision: str, batch: int, seq_len: int, steps: int = 3, rows: int = 25, device: str = "cpu",
                shape: Optional[ModelConfig] = None, routing: Optional[RoutingConfig] = None) -> str:
    """Operator table (self CPU time; self device time on CUDA) of MoD training steps, to see where routing time goes."""
    trainer = make_trainer(routing or VARIANTS["mod"], precision, batch, seq_len, device=device, shape=shape)
    trainer.step()  # warm up allocator and kernels outside the profile
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.step()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def report(precision: str, times: dict[str, list[dict[str, float]]], tokens: int, flops_ratio: float) -> str:
    total = {name: [sum(p.values()) for p in steps] for name, steps in times.items()}
    n = len(total["dense"])
    lines = [f"[{precision}] {n} timed steps per variant"]
    for name, t in total.items():
        best, med = min(t), statistics.median(t)
        phases = ", ".join(f"{ph} {statistics.median(p[ph] for p in times[name]) * 1e3:.0f}" for ph in PHASES)
        lines.append(f"  {name:<6} best {best * 1e3:7.1f} ms ({tokens / best:5.0f} tokens/s)  median {med * 1e3:7.1f} ms "
                     f"({tokens / med:5.0f} tokens/s)  [median ms: {phases}]")
    # Best-of-N is the least disturbed by other load on a shared machine; median for reference.
    for stat in (min, statistics.median):
        ratio = stat(total["mod"]) / stat(total["dense"])
        verdict = "HOLDS" if ratio <= TARGET * flops_ratio else "MISSED"
        lines.append(f"  {stat.__name__:<6} step-time ratio mod/dense {ratio:.3f} vs FLOPs ratio {flops_ratio:.3f}: "
                     f"{ratio / flops_ratio:.2f} x (target <= {TARGET}) {verdict}")
    # The optimizer step costs the same for both (same parameters) and is not in the FLOPs.
    fwd_bwd = {name: statistics.median(p["forward"] + p["backward"] for p in steps) for name, steps in times.items()}
    ratio = fwd_bwd["mod"] / fwd_bwd["dense"]
    lines.append(f"  forward+backward only (median): ratio {ratio:.3f} = {ratio / flops_ratio:.2f} x FLOPs ratio")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- CUDA


def device_peak_tflops(override: Optional[float] = None) -> tuple[Optional[float], str]:
    """-> (dense 16-bit tensor-core peak TFLOP/s of the current GPU, where it comes from)."""
    if override:
        return override, "--peak-tflops"
    name = torch.cuda.get_device_name()
    try:
        return peak_flops(name) / 1e12, f"datasheet, {name}"
    except ValueError:
        return None, f"unknown device {name!r}: pass --peak-tflops"


def measured_matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192, iters: int = 20) -> float:
    """Achieved TFLOP/s of an n x n x n matmul: the practical ceiling MFU is measured against."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) * 1e-3) / 1e12


def report_cuda(precision: str, batch: int, seq_len: int, times: dict[str, list[dict[str, float]]],
                flops: dict[str, float], peak: Optional[float], matmul: float) -> str:
    """Median step time, tokens/s, achieved model TFLOP/s and MFU per variant; MoD/dense ratios."""
    tokens = batch * seq_len
    lines = [f"[{precision}] micro-batch {batch} x {seq_len} ({tokens} tokens/step), "
             f"{len(next(iter(times.values())))} timed steps per variant"]
    medians = {}
    for name, steps in times.items():
        med = medians[name] = statistics.median(sum(p.values()) for p in steps)
        phases = ", ".join(f"{ph} {statistics.median(p[ph] for p in steps) * 1e3:.1f}" for ph in PHASES)
        tflops = tokens / med * flops[name] / 1e12
        mfu = f"MFU {tflops / peak:6.1%}" if peak else "MFU    n/a"
        lines.append(f"  {name:<6} step {med * 1e3:8.1f} ms  {tokens / med:9,.0f} tokens/s  {tflops:6.1f} TFLOP/s  "
                     f"{mfu}  ({tflops / matmul:5.1%} of measured matmul)  [median ms: {phases}]")
    if "dense" in medians and "mod" in medians:
        ratio, flops_ratio = medians["mod"] / medians["dense"], flops["mod"] / flops["dense"]
        verdict = "HOLDS" if ratio <= TARGET * flops_ratio else "MISSED"
        lines.append(f"  step-time ratio mod/dense {ratio:.3f} vs FLOPs ratio {flops_ratio:.3f}: "
                     f"{ratio / flops_ratio:.2f} x (target <= {TARGET}) {verdict}")
    return "\n".join(lines)


@torch.no_grad()
def sampling_speed(shape: ModelConfig, routing: RoutingConfig, dtype: torch.dtype, batch: int, prompt_len: int,
                   new_tokens: int, calibrate: bool = False, device: str = "cuda") -> tuple[float, Optional[float]]:
    """Greedy decoding with the KV cache (causal routing): -> (new tokens/s over the batch, fraction
    of tokens the routed blocks ran, or None for a dense model). Random weights; with `calibrate`,
    MoD's causal predictors pass the configured capacity, as trained ones do."""
    torch.manual_seed(0)
    model = build_model(shape, routing)
    if calibrate:
        calibrate_predictors(model, routing.capacity, shape.vocab_size)
    model = model.to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, shape.vocab_size, (batch, prompt_len), device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def decode() -> tuple[float, torch.Tensor]:
        cache = model.new_cache()
        logits = model(prompt, options=ForwardOptions(mode="causal", cache=cache)).logits[:, -1]
        out = [prompt]
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            logits = model(nxt, options=ForwardOptions(mode="causal", cache=cache)).logits[:, -1]
        sync()
        return time.perf_counter() - t0, torch.cat(out, dim=1)

    decode()  # warm-up (kernel compilation, allocator)
    elapsed, seq = min((decode() for _ in range(2)), key=lambda r: r[0])
    stats = model(seq, options=ForwardOptions(mode="causal")).routing_stats
    fracs = [float(v) for k, v in stats.items() if k.endswith("/selected_frac")]
    return batch * new_tokens / elapsed, (sum(fracs) / len(fracs) if fracs else None)


def run_cuda(args, variants: dict[str, tuple[ModelConfig, RoutingConfig]]) -> None:
    props = torch.cuda.get_device_properties(0)
    peak, source = device_peak_tflops(args.peak_tflops)
    first = next(iter(variants.values()))[0]
    print(f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    print(f"shape: {first.n_layers} layers, d_model {first.d_model}, {first.n_heads} heads, vocab {first.vocab_size}; "
          f"variants {', '.join(variants)}; {args.warmup} warmup + {args.steps} timed steps; fp32 weights, "
          f"autocast, fused AdamW")
    for precision in args.precision:
        dtype = AMP_DTYPES.get(precision, torch.float32)
        matmul = measured_matmul_tflops(dtype)
        peak_text = f"{peak:.0f} TFLOP/s ({source})" if peak else source
        print(f"\npeak (dense 16-bit tensor cores): {peak_text}; measured {precision} matmul 8192^3: "
              f"{matmul:.0f} TFLOP/s" + (f" ({matmul / peak:.0%} of peak)" if peak else ""))
        for batch in args.batch:
            flops = {name: flops_per_token(shape, r, args.seq_len) for name, (shape, r) in variants.items()}
            try:
                times = bench(precision, args.steps, args.warmup, batch, args.seq_len, device="cuda", variants=variants)
            except torch.cuda.OutOfMemoryError:
                print(f"[{precision}] micro-batch {batch} x {args.seq_len}: out of memory")
                torch.cuda.empty_cache()
                continue
            print(report_cuda(precision, batch, args.seq_len, times, flops, peak, matmul), flush=True)
            if args.profile and "mod" in variants:
                print(profile_mod(precision, batch, args.seq_len, device="cuda", shape=variants["mod"][0],
                                  routing=variants["mod"][1]))
    if args.sample:
        dtype = AMP_DTYPES.get(args.precision[0], torch.float32)
        print(f"\ngreedy sampling with the KV cache ({str(dtype).removeprefix('torch.')} weights, causal routing, "
              f"batch {args.sample_batch}, {args.prompt_len}-token prompt + {args.new_tokens} new tokens; random weights)")
        rows = [(name, shape, r, False) for name, (shape, r) in variants.items()]
        if "mod" in variants:  # a trained MoD passes ~capacity of the tokens; a random router's sign ~half
            shape, r = variants["mod"]
            rows.append(("mod_calibrated", shape, dataclasses.replace(r, causal_method="predictor"), True))
        speeds = {}
        for name, shape, r, calibrate in rows:
            tps, frac = sampling_speed(shape, r, dtype, args.sample_batch, args.prompt_len, args.new_tokens, calibrate)
            speeds[name] = tps
            extra = f", routed blocks ran {frac:.0%} of tokens" if frac is not None else ""
            print(f"  {name:<14} {tps:9,.0f} tokens/s{extra}", flush=True)
        for name in speeds:
            if name != "dense" and "dense" in speeds:
                print(f"  {name} / dense sampling speed: {speeds[name] / speeds['dense']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaroute.bench.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=SHAPES, default=None,
                        help="model shape: small (6 x 384, the CPU default) or configs/{dense,mod}_<size>.yaml "
                             "(157m: the CUDA default)")
    parser.add_argument("--config", nargs="+", default=None, metavar="YAML",
                        help="explicit configs to compare (model + routing sections; named by `variant`)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--batch", type=int, nargs="+", default=None,
                        help="micro-batch size(s) (default: 8 on CPU, 8 and 16 on CUDA)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 256 on CPU, 1024 on CUDA")
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: fp32 bf16 on CPU; bf16 on CUDA (fp16 on GPUs without bf16, e.g. V100)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="intra-op threads (default: the cores this process may use)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="CPU only. wall: elapsed time; thread: CPU time of this thread, immune to other load on "
                             "a shared machine (needs --threads 1: with one intra-op thread all work runs here)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="CUDA: the device's peak for MFU")
    parser.add_argument("--sample", action=argparse.BooleanOptionalAction, default=None,
                        help="CUDA: also time greedy KV-cache sampling of each variant (default on CUDA)")
    parser.add_argument("--sample-batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler table of MoD steps")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.steps < 1 or args.warmup < 0:
        parser.error("need --steps >= 1 and --warmup >= 0")
    if args.clock == "thread" and (args.threads != 1 or cuda):
        parser.error("--clock thread needs --threads 1 (and the CPU device)")
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device"
                     + (" (a CPU-only build)" if torch.version.cuda is None else ""))
    if cuda:
        bf16 = torch.cuda.get_device_capability() >= (8, 0)
        args.precision = args.precision or ["bf16" if bf16 else "fp16"]
        args.batch, args.seq_len = args.batch or [8, 16], args.seq_len or 1024
        args.sample = True if args.sample is None else args.sample
    else:
        if args.precision and "fp16" in args.precision:
            parser.error("--precision fp16 is for CUDA (CPU autocast runs bf16)")
        args.precision = args.precision or ["fp32", "bf16"]
        args.batch, args.seq_len = args.batch or [8], args.seq_len or 256
    variants = load_variants(args.shape or ("157m" if cuda else "small"), args.config)
    for name, (shape, _) in variants.items():
        if args.seq_len > shape.max_seq_len:
            parser.error(f"--seq-len {args.seq_len} exceeds {name}'s model.max_seq_len={shape.max_seq_len}")
    if cuda:
        run_cuda(args, variants)
        return 0

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if set(variants) != {"dense", "mod"}:
        parser.error(f"the CPU comparison needs one dense and one mod variant, got {sorted(variants)}")
    shape = variants["dense"][0]
    flops = {name: flops_per_token(s, r, args.seq_len) for name, (s, r) in variants.items()}
    flops_ratio = flops["mod"] / flops["dense"]
    mod = variants["mod"][1]
    for batch in args.batch:
        tokens = batch * args.seq_len
        print(f"shape: {shape.n_layers} layers, d_model {shape.d_model}, {shape.n_heads} heads, vocab {shape.vocab_size}; "
              f"batch {batch} x seq {args.seq_len}; MoD capacity {mod.capacity} every {mod.every}; "
              f"{args.threads} threads, {args.clock} clock, {args.warmup} warmup steps, torch {torch.__version__}")
        print(f"analytic train FLOPs/token: dense {flops['dense'] / 1e6:.1f} M, mod {flops['mod'] / 1e6:.1f} M, "
              f"ratio {flops_ratio:.3f}")
        for precision in args.precision:
            times = bench(precision, args.steps, args.warmup, batch, args.seq_len, clock, variants=variants)
            print("\n" + report(precision, times, tokens, flops_ratio))
            if args.profile:
                print(profile_mod(precision, batch, args.seq_len, shape=variants["mod"][0], routing=mod))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
