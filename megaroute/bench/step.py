"""Training-step speed: dense vs MoD vs each routed method, against the FLOPs and the machine's matmul peak.

    python -m megaroute.bench.step [--steps 10 --warmup 2 --precision fp32 bf16 --threads 1 --clock thread]
    python -m megaroute.bench.step --variants reference dense mod     # today's dense step vs the optimised one
    python -m megaroute.bench.step --variants dense mod --compile     # eager vs torch.compile'd blocks
    python -m megaroute.bench.step --device cuda [--shape 157m --batch 8 16 --seq-len 1024]
    python -m megaroute.bench.step --device cuda --config configs/dense_350m.yaml configs/mod_350m.yaml
    python -m megaroute.bench.step --device cuda --variants dense gpt2 --profile   # where the gap is, op by op
    python -m megaroute.bench.step --device cuda --compile --compile-mode reduce-overhead  # + CUDA graphs

Times full training steps (forward + backward + AdamW step) of each variant and prints, per
precision: the median (and best) step time, step/dense beside the analytic FLOPs share
(megaroute.flops; "vs FLOPs" = (step/dense) / (FLOPs/dense), 1.00x = the time saved matches the
FLOPs saved), tokens/s, achieved model GFLOP/s and MFU of the median step against the matmul peak
measured in the same run (the best of one n^3 fp32 or bf16 matmul per round, `--peak-size`, timed
with the same clock between the rounds of steps; in fp32 the faster of torch's mm and oneDNN's GEMM,
the other printed beside it).

Variants (CPU default: all of them): `reference` is today's dense step kept for comparison - the
reference math (`Transformer.set_fused(False)`: float32 RoPE via chunk/cat, torch's SDPA kernel,
F.cross_entropy on a float32 copy of the logits) and torch's default (for-loop) AdamW; `dense` is
the optimised step (fused RoPE, CPU bf16 attention as one function over blocked matmuls, fused
RMSNorm and SwiGLU, the LM head inside a chunked loss, float32 linears through oneDNN's GEMM
(kernels/cpu_linear.py), fused AdamW), with the training loop's forward (no logits returned,
train.loop.TRAIN_FORWARD), as every megaroute variant here; `dense_torch_gemm` is dense with its
float32 linears and LM head through torch's mm (MKL's sgemm), the GEMM gpt2 and reference use: it
tells the model's share of dense's lead from the GEMM library's (in bf16 it is dense: autocast's
matmuls run through oneDNN in every variant);
`gpt2` is an independent baseline, not megaroute code: nanoGPT's architecture (LayerNorm, GELU
MLP, learned positions, tied head, SDPA, torch's AdamW; megaroute/bench/gpt2.py) at the same shape,
the same FLOPs by FlopCounterMode; `mod` (capacity 0.125), the capacity baselines `random` /
`stride` / `first_k` (same capacity), `depth_gate` (budget 0.5), `halting` (soft training forward)
and `early_exit`, each routing every 2nd block. Targets: dense (and, with --compile,
dense+compile) >= 1.3x faster than reference in fp32 and >= 1.2x in bf16, and at most 0.9x the
gpt2 step; MoD's step/dense at most 1.05x its FLOPs ratio. A verdict (HOLDS / MISSED) is marked
"within the noise" when the per-round ratios' interquartile range spans the target, or their median
is on its other side (noise.verdict): another run may then flip it. `--compile` adds a `<variant>+compile`
twin of each variant (but reference and dense_torch_gemm), its blocks compiled (`Transformer.compile_blocks`, what
`train.compile: true` runs; gpt2+compile: the whole model, as nanoGPT compiles it), interleaved
with the rest; compilation happens in the warmup steps, so it is not timed. `--compile-mode` picks
torch.compile's mode for them: `reduce-overhead` and `max-autotune` record CUDA graphs of the
compiled blocks on a GPU, for the host-bound steps there (README, CUDA), recorded in the second
warmup step (so they need --warmup >= 2), and each step then marks its start
(torch.compiler.cudagraph_mark_step_begin); on CPU tensors no graphs are recorded. On CUDA the
report says whether inductor recorded every compiled graph of those variants; a variant with graphs
it skipped (and so ran kernel by kernel) is flagged CUDA GRAPHS SKIPPED on its line, with the reasons
inductor logged (GraphSkips).

CPU (default): the 6-layer/384 shape (nanoGPT's: 6 heads, T 256, batch 8, vocab 8192); the
variants' steps are interleaved round by round (each round in its own shuffled order) so machine
noise hits all alike. Each comparison also prints its ratio per round (the two variants' steps of one round side by side): the median and
interquartile range of those ratios say how much of a difference the noise could make. On a shared
machine wall-clock times swing with other load; `--threads 1 --clock thread` measures this
thread's CPU time instead, which other processes barely disturb. `--sample` adds greedy KV-cache
sampling speed after the steps (as on CUDA, below; weights in the first --precision's dtype).

CPU step times depend on the allocator, and the header names it (bench/allocator.py). With glibc's
defaults, freed large blocks go back to the OS, so every fresh large tensor is page-faulted in again,
each step: megaroute's fused paths reuse buffers, nanoGPT's autograd graph allocates, so those
defaults flatter megaroute against nanoGPT. `--allocator keep` (the default) has glibc keep freed
memory and fault a heap reserve in up front, the same state in every process: it makes every
variant faster and gives nanoGPT's step most of what the fused paths saved. `--allocator defaults`
measures glibc's defaults (README, step-time benchmark: both are reported). Each variant's line
prints the median minor page faults of its steps (the whole process's), and a PAGE-FAULTED line
names every variant at allocator.FAULTED_PAGES or more: with glibc's defaults one process's bf16
dense steps faulted 8,000-49,000 pages each, MoD's none and nanoGPT's 33,000-103,000, which
flattered MoD against dense and dense against nanoGPT.

CUDA (`--device cuda`): dense_157m and mod_157m (configs/, or `--shape`/`--config`; `--variants`
adds the others on the dense config's shape) at realistic micro-batches, bf16 autocast over fp32
weights with fused AdamW (fp16 + GradScaler where the GPU has no bf16), timed with CUDA events.
Prints step time, tokens/s, achieved model TFLOP/s and MFU against the device's datasheet peak
(megaroute.flops, `--peak-tflops` overrides), with the measured matmul peak beside it, and each
variant's step/dense beside its FLOPs share; dense against reference and gpt2 as measured (the
0.9 / 1.3x targets are CPU ones), MoD's target judged; then greedy KV-cache sampling tokens/s of
MoD vs dense (`--no-sample` skips).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import time
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ..argtypes import non_negative_int, positive_float, positive_int
from ..config import ConfigError, ModelConfig, RoutingConfig, load_config
from ..flops import PRECISION_DTYPES, cpu_gemms, flops_per_token, measure_matmul_flops, peak_flops
from ..kernels import cpu_linear
from ..model import COMPILE_MODES, CUDA_GRAPH_MODES, ForwardOptions, build_model
from ..model.routing import calibrate_thresholds, honest_routing_mode
from ..parallel import ColumnParallelLinear, RowParallelLinear
from ..train.loop import TRAIN_FORWARD
from ..train.optim import GuardedAdamW, param_groups
from . import allocator, gpt2
from .noise import against, describe as describe_rounds, per_round, round_order, verdict as noisy_verdict

TARGET = 1.05  # MoD step / dense step at most this times the FLOPs ratio
SPEEDUP_TARGETS = {"fp32": 1.3, "bf16": 1.2}  # dense over reference (today's step)
BASELINE_TARGET = 0.9  # dense step at most this times the gpt2 (nanoGPT architecture) step
SHAPE = ModelConfig(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, max_seq_len=256)
TARGET_RUN = (SHAPE, 8, 256)  # the speedup targets are set at nanoGPT's shape, batch 8 x 256
REFERENCE = "reference"  # dense, reference math and torch's default AdamW: today's step
BASELINE = "gpt2"  # nanoGPT's architecture (bench/gpt2.py), same shape and FLOPs: an independent baseline
TORCH_GEMM = "dense_torch_gemm"  # dense with its float32 linears through torch's mm (gpt2's GEMM), not oneDNN
COMPILED = "+compile"  # suffix of a variant whose blocks are torch.compile'd (--compile)
_ROUTED = dict(every=2, offset=1)
VARIANTS = {
    "dense": RoutingConfig(),
    "mod": RoutingConfig(method="mod", capacity=0.125, **_ROUTED),
    "random": RoutingConfig(method="random", capacity=0.125, **_ROUTED),
    "stride": RoutingConfig(method="stride", capacity=0.125, **_ROUTED),
    "first_k": RoutingConfig(method="first_k", capacity=0.125, **_ROUTED),
    "depth_gate": RoutingConfig(method="depth_gate", **_ROUTED),
    "halting": RoutingConfig(method="halting", **_ROUTED),  # train_forward "soft": every block runs
    "early_exit": RoutingConfig(method="early_exit", **_ROUTED),
}
VARIANT_NAMES = (REFERENCE, BASELINE, TORCH_GEMM, *VARIANTS)
PHASES = ("forward", "backward", "optimizer")
PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # megaroute/: host_report names call sites under it
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CUDAGRAPH_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"  # where inductor logs why it skipped a graph
SHAPES = ("small", "157m", "350m", "760m", "1b")  # small = SHAPE; the others: configs/{dense,mod}_<size>.yaml
AMP_DTYPES = {name: dtype for name, dtype in PRECISION_DTYPES.items() if name != "fp32"}  # autocast's


@dataclass
class Trainer:
    """One model, its optimizer and a fixed batch; `step()` runs one full training step."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    tokens: torch.Tensor
    targets: torch.Tensor
    precision: str
    scaler: Optional[torch.amp.GradScaler] = field(default=None)  # fp16 on CUDA
    # megaroute models: the training loop's forward (no logits returned: the LM head runs inside the loss)
    forward_kwargs: dict = field(default_factory=dict)
    # compiled with CUDA graphs (--compile-mode): each step starts a new graph generation
    mark_steps: bool = False
    # the last step's, detached: read it before the next step (a whole-model CUDA graph, gpt2+compile's,
    # reuses its output memory there)
    loss: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def autocast(self):
        if self.precision not in AMP_DTYPES:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=AMP_DTYPES[self.precision])

    def _begin(self) -> None:
        """The last step's outputs are dead: CUDA-graph trees may reuse their memory."""
        if self.mark_steps:
            torch.compiler.cudagraph_mark_step_begin()

    def step(self, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
        """Runs one step; returns seconds per phase (CPU ops are synchronous; CUDA uses events)."""
        if self.device.type == "cuda":
            return self._cuda_step()
        t0 = clock()
        self._begin()
        with self.autocast():
            loss = self.model(self.tokens, targets=self.targets, **self.forward_kwargs).loss
        t1 = clock()
        loss.backward()
        t2 = clock()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        t3 = clock()
        self.loss = loss.detach()  # outside the timed phases
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}

    def _cuda_step(self, host: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Device time per phase (CUDA events); `host` (when given) gets the seconds the CPU took to
        issue each phase and the whole step's wall time to the final sync ("step")."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        marks = [time.perf_counter()]
        events[0].record()
        self._begin()
        with self.autocast():
            loss = self.model(self.tokens, targets=self.targets, **self.forward_kwargs).loss
        events[1].record()
        marks.append(time.perf_counter())
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        events[2].record()
        marks.append(time.perf_counter())
        if self.scaler is not None:
            self.scaler.step(self.optim)
            self.scaler.update()
        else:
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        events[3].record()
        marks.append(time.perf_counter())
        self.loss = loss.detach()  # outside the timed phases
        events[3].synchronize()
        if host is not None:
            host.update({ph: marks[i + 1] - marks[i] for i, ph in enumerate(PHASES)},
                        step=time.perf_counter() - marks[0])
        return {ph: events[i].elapsed_time(events[i + 1]) / 1e3 for i, ph in enumerate(PHASES)}


def make_trainer(routing: RoutingConfig, precision: str, batch: int, seq_len: int, seed: int = 0,
                 device: str = "cpu", shape: Optional[ModelConfig] = None, reference: bool = False,
                 compile: bool = False, baseline: bool = False, torch_gemm: bool = False,
                 compile_mode: str = "default") -> Trainer:
    """A trainer with the training loop's optimizer (GuardedAdamW, decay on matrices); `reference`:
    the reference math and torch's default AdamW implementation, i.e. the step before issue 19;
    `compile`: the blocks torch.compile'd (Transformer.compile_blocks), compiled at the first step;
    `baseline`: the gpt2 baseline (nanoGPT's architecture and AdamW; `compile` compiles the whole
    model, as nanoGPT does) instead of a megaroute model; `torch_gemm`: the linears (and the LM head
    inside the loss) through F.linear / torch's mm instead of oneDNN (kernels/cpu_linear.py), the
    rest of the fused math unchanged. `compile_mode`: torch.compile's mode for `compile`
    (transformer.COMPILE_MODES; those recording CUDA graphs mark each step's start)."""
    shape = shape or SHAPE
    graphs = compile and compile_mode in CUDA_GRAPH_MODES
    torch.manual_seed(seed)
    cuda = torch.device(device).type == "cuda"
    data = torch.randint(0, shape.vocab_size, (batch, seq_len + 1)).to(device)
    scaler = torch.amp.GradScaler("cuda") if cuda and precision == "fp16" else None
    if baseline:
        model = gpt2.GPT2(shape).to(device)
        optim = gpt2.optimizer(model)
        if compile:
            model = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
        return Trainer(model, optim, data[:, :-1], data[:, 1:], precision, scaler, mark_steps=graphs)
    model = build_model(shape, routing, device=device)  # fp32 weights: autocast runs the math in 16 bits
    # GuardedAdamW picks torch's fused kernel; foreach=None is torch's default (a loop on CPU)
    impl = {"foreach": None} if reference else {}
    model.set_fused(not reference)
    for module in model.modules() if torch_gemm else ():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, cpu_linear.Linear)):
            module.fused = False
    if compile:
        model.compile_blocks(mode=compile_mode)  # the blocks keep the math set_fused chose
    optim = GuardedAdamW(param_groups(model, 0.1), lr=1e-4, **impl)
    return Trainer(model, optim, data[:, :-1], data[:, 1:], precision, scaler, {"options": TRAIN_FORWARD}, graphs)


def variant_trainer(name: str, shape: ModelConfig, routing: RoutingConfig, precision: str, batch: int,
                    seq_len: int, device: str = "cpu", compile_mode: str = "default") -> Trainer:
    """make_trainer for a variant by its name (reference, gpt2, `<variant>+compile`)."""
    base = name.removesuffix(COMPILED)
    return make_trainer(routing, precision, batch, seq_len, device=device, shape=shape, reference=base == REFERENCE,
                        baseline=base == BASELINE, compile=name.endswith(COMPILED), torch_gemm=base == TORCH_GEMM,
                        compile_mode=compile_mode)


def variant_flops(variants: dict[str, tuple[ModelConfig, RoutingConfig]], seq_len: int) -> dict[str, float]:
    """Training FLOPs per token of each variant: megaroute.flops' analytic count; the gpt2 baseline's
    is dense's scaled by the two models' FlopCounterMode counts at this shape (equal at 8/3 d SwiGLU),
    counted on the meta device (no memory, no arithmetic: instant even at 1B)."""
    flops = {name: flops_per_token(s, r, seq_len) for name, (s, r) in variants.items()}
    if BASELINE in variants:  # counted once: its compiled twin (--compile) has the same shape
        shape = variants[BASELINE][0]
        with torch.device("meta"):
            models = (gpt2.GPT2(shape), build_model(shape, VARIANTS["dense"], device="meta"))
        counted = [gpt2.train_flops(model, seq_len, shape.vocab_size) for model in models]
        for name in (BASELINE, f"{BASELINE}{COMPILED}"):
            if name in flops:
                flops[name] *= counted[0] / counted[1]
    return flops


def resolve_variants(names: Optional[list[str]], shape: str = "small", configs: Optional[list[str]] = None,
                     device: str = "cpu") -> dict[str, tuple[ModelConfig, RoutingConfig]]:
    """name -> (model shape, routing). Small shape: the named VARIANT_NAMES (default all on CPU,
    dense and mod on CUDA). Otherwise the configs (load_variants), plus any named variants on the
    dense config's shape."""
    if shape == "small" and not configs:
        names = names or (list(VARIANT_NAMES) if device == "cpu" else ["dense", "mod"])
        return {name: (SHAPE, VARIANTS.get(name, VARIANTS["dense"])) for name in names}
    loaded = load_variants(shape, configs)
    if names:
        base = loaded.get("dense", next(iter(loaded.values())))[0]
        loaded.update({name: (base, VARIANTS.get(name, VARIANTS["dense"])) for name in names if name not in loaded})
    return loaded


def load_variants(shape: str = "small", configs: Optional[list[str]] = None) -> dict[str, tuple[ModelConfig, RoutingConfig]]:
    """name -> (model shape, routing): the built-in small pair, configs/{dense,mod}_<shape>.yaml, or
    explicit config files (named by their `variant`, else their `name`)."""
    if shape == "small" and not configs:
        return {name: (SHAPE, VARIANTS[name]) for name in ("dense", "mod")}
    paths = configs or [str(CONFIGS / f"dense_{shape}.yaml"), str(CONFIGS / f"mod_{shape}.yaml")]
    out: dict[str, tuple[ModelConfig, RoutingConfig]] = {}
    for path in paths:
        if not configs and not os.path.isfile(path):
            raise ConfigError("", f"--shape {shape} reads {path}: the configs/ directory of a source checkout")
        cfg = load_config(path, [])
        out[cfg.variant if cfg.variant not in out else cfg.name] = (cfg.model, cfg.routing)
    return out


class GraphSkips:
    """While active (re-entrant: counts add up): how many compiled graphs inductor declined to record
    as CUDA graphs (its `cudagraph_skips` counter) and the reasons it logged. A graph mode's step times
    are then those of compiled kernels issued one by one, and its report must say so. On CPU tensors
    every graph is skipped (counted, no reason logged)."""

    def __init__(self) -> None:
        self.count = 0
        self.reasons: list[str] = []
        self._handler = _ReasonHandler(self.reasons)

    def __enter__(self) -> "GraphSkips":
        self._counters = torch._dynamo.utils.counters["inductor"]  # torch loads dynamo (~1 s) on first use
        self._start = self._counters["cudagraph_skips"]
        logging.getLogger(CUDAGRAPH_LOGGER).addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(CUDAGRAPH_LOGGER).removeHandler(self._handler)
        self.count += self._counters["cudagraph_skips"] - self._start


class _ReasonHandler(logging.Handler):
    def __init__(self, reasons: list[str]) -> None:
        super().__init__(logging.WARNING)
        self._reasons = reasons

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().strip()
        if message not in self._reasons:
            self._reasons.append(message)


class Measured(NamedTuple):
    times: dict[str, list[dict[str, float]]]  # per-step phase times of each variant
    peaks: dict[str, list[float]]  # CPU: matmul FLOP/s samples per GEMM (flops.cpu_gemms)
    faults: dict[str, list[int]]  # CPU: the process's minor page faults in each timed step of each variant
    graph_skips: dict[str, GraphSkips]  # CUDA: each graph-mode (--compile-mode) variant's skipped graphs


def bench(precision: str, steps: int, warmup: int, batch: int, seq_len: int,
          clock: Callable[[], float] = time.perf_counter, device: str = "cpu",
          variants: Optional[dict[str, tuple[ModelConfig, RoutingConfig]]] = None, peak_size: int = 2048,
          compile_mode: str = "default") -> Measured:
    """Times each variant's steps (Measured).

    CPU: one step of every variant per round, rounds repeated, and one timed matmul of each GEMM
    (the peak, in the step's compute dtype) per timed round, all with `clock`. CUDA: one variant after the other (a GPU is
    not shared with other load, and two large models need not fit at once); no matmul samples (run_cuda
    measures the peak)."""
    variants = variants or {name: (SHAPE, VARIANTS.get(name, VARIANTS["dense"])) for name in VARIANT_NAMES}
    times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    if torch.device(device).type == "cuda":
        skips: dict[str, GraphSkips] = {}
        for name, (shape, routing) in variants.items():
            trainer = variant_trainer(name, shape, routing, precision, batch, seq_len, device, compile_mode)
            watch = skips.setdefault(name, GraphSkips()) if trainer.mark_steps else nullcontext()
            for i in range(warmup + steps):
                with watch:
                    phases = trainer.step()
                if i >= warmup:
                    times[name].append(phases)
            del trainer
            torch.cuda.empty_cache()
        return Measured(times, {}, {}, skips)
    trainers = {name: variant_trainer(name, shape, r, precision, batch, seq_len, compile_mode=compile_mode)
                for name, (shape, r) in variants.items()}
    dtype = PRECISION_DTYPES[precision]
    gemms = cpu_gemms(dtype)
    peaks: dict[str, list[float]] = {gemm: [] for gemm in gemms}
    faults: dict[str, list[int]] = {name: [] for name in variants}
    for i in range(warmup + steps):
        for name in round_order(list(trainers), i):
            before = allocator.process_page_faults()
            phases = trainers[name].step(clock)
            if i >= warmup:
                times[name].append(phases)
                faults[name].append(allocator.process_page_faults() - before)
        for gemm, matmul in gemms.items() if i >= warmup else ():
            peaks[gemm].append(measure_matmul_flops(dtype, n=peak_size, iters=1, clock=clock, matmul=matmul))
    return Measured(times, peaks, faults, {})


class Profiled(NamedTuple):
    table: str  # torch.profiler's operator table (plus, on CUDA, host_report)
    ops: dict[str, tuple[float, float]]  # op_times


def profile_steps(precision: str, batch: int, seq_len: int, steps: int = 3, rows: int = 25, device: str = "cpu",
                  shape: Optional[ModelConfig] = None, routing: Optional[RoutingConfig] = None,
                  name: str = "mod", compile_mode: str = "default") -> Profiled:
    """Operator table (self CPU time; self device time on CUDA) of training steps of variant `name`,
    to see where time goes, and its op_times for profile_diff."""
    trainer = variant_trainer(name, shape or SHAPE, routing or VARIANTS["mod"], precision, batch, seq_len, device,
                              compile_mode)
    for _ in range(2 if trainer.mark_steps else 1):  # allocator, kernels, compilation (and recording CUDA graphs)
        trainer.step()
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.step()
    averages = prof.key_averages()
    table = averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    return Profiled(table + ("\n" + host_report(trainer) if cuda else ""), op_times(averages, steps, cuda))


def op_times(averages, steps: int, cuda: bool) -> dict[str, tuple[float, float]]:
    """op -> (self time per step in ms, calls per step), from profiler key averages. Host-side events
    only (operators, autograd nodes, record_function ranges): on CUDA each kernel's device time counts
    once, for the operator that launched it (self_device_time), where the kernel rows and the device
    copies of record_function ranges would count it again; on CPU self CPU time."""
    out = {}
    for e in averages:
        if e.device_type == DeviceType.CPU:
            us = e.self_device_time_total if cuda else e.self_cpu_time_total
            out[e.key] = (us / 1e3 / steps, e.count / steps)
    return out


def profile_diff(ops: dict[str, dict[str, tuple[float, float]]], base: str = "dense", rows: int = 20) -> str:
    """Each profiled variant against `base`, op by op (op_times of each): the `rows` ops whose time
    per step differs most, then the sums over all ops. Says where one variant's step time goes that
    the other's does not (the dense vs gpt2 gap, a routed method's glue)."""
    if base not in ops:
        return f"(no {base} variant profiled to compare against)"
    theirs, absent = ops[base], (0.0, 0.0)
    lines = []
    for name, mine in ops.items():
        if name == base:
            continue
        keys = sorted(set(mine) | set(theirs), key=lambda k: -abs(mine.get(k, absent)[0] - theirs.get(k, absent)[0]))
        width = max(24, *(len(k) for k in keys[:rows]))
        lines += [f"{name} against {base}, ms per step (calls per step), the {min(rows, len(keys))} largest differences:",
                  f"  {'op':<{width}} {base:>18} {name:>18} {'difference':>10}"]
        for k in keys[:rows]:
            (a, na), (b, nb) = theirs.get(k, absent), mine.get(k, absent)
            lines.append(f"  {k:<{width}} {f'{a:.2f} ({na:g})':>18} {f'{b:.2f} ({nb:g})':>18} {b - a:+10.2f}")
        total_a, total_b = (sum(t for t, _ in d.values()) for d in (theirs, mine))
        lines.append(f"  {'sum over all ops':<{width}} {total_a:18.2f} {total_b:18.2f} {total_b - total_a:+10.2f}")
    return "\n".join(lines)


def print_profiles(precision: str, batch: int, seq_len: int, variants: dict[str, tuple[ModelConfig, RoutingConfig]],
                   device: str = "cpu", compile_mode: str = "default") -> None:
    """--profile: each variant's profile_steps table, then profile_diff of them all against dense."""
    cuda = device == "cuda"
    ops = {}
    for name, (shape, routing) in variants.items():
        what = "device time per op; host time and syncs" if cuda else "wall time per op"
        print(f"\n[{precision}] profile of {name} steps ({what})")
        profiled = profile_steps(precision, batch, seq_len, device=device, shape=shape, routing=routing, name=name,
                                 compile_mode=compile_mode)
        print(profiled.table)
        ops[name] = profiled.ops
    print(f"\n[{precision}] {'device' if cuda else 'CPU'} time per op, each variant against dense\n" + profile_diff(ops))


def host_report(trainer: Trainer) -> str:
    """CUDA: how long the CPU takes to issue a step's phases (no sync between them) against the
    step's wall time, and where the step makes the CPU wait for the GPU (torch.cuda's sync debug
    mode, each site named by its innermost megaroute frames). A step whose issue time is close to its
    wall time is host-bound: fewer, larger kernels or torch.compile help it, faster kernels do not."""
    host: dict[str, float] = {}
    trainer._cuda_step(host)
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE_DIR + os.sep)]
        where = [f"{os.path.relpath(f.filename, PACKAGE_DIR)}:{f.lineno}" for f in ours[-3:][::-1]]
        sites[" <- ".join(where) or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer._cuda_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"host: issuing forward {host['forward'] * 1e3:.1f} ms, backward {host['backward'] * 1e3:.1f}, "
             f"optimizer {host['optimizer'] * 1e3:.1f}; step {host['step'] * 1e3:.1f} ms to the final sync",
             f"host syncs in one step: {sum(sites.values())}"]
    lines += [f"  {n:4d}  {where}" for where, n in sites.most_common()]
    return "\n".join(lines)


def report(precision: str, times: dict[str, list[dict[str, float]]], tokens: int, flops: dict[str, float],
           peaks: dict[str, list[float]], peak_size: int = 2048, speedup_targets: bool = True,
           faults: Optional[dict[str, list[int]]] = None, kept: bool = True) -> str:
    """Per variant: median (and best) step time, step/dense beside the FLOPs share, achieved model
    GFLOP/s and MFU (of the median step, against the best matmul of any GEMM in `peaks`, bench's
    samples per GEMM), the median page faults of a step (`faults`, when given) and a PAGE-FAULTED line
    naming the variants that fault allocator.FAULTED_PAGES or more (with the remedy for the allocator in
    use: `kept`, freed memory kept); then the targets, and each
    compiled variant against its eager twin."""
    total = {name: [sum(p.values()) for p in steps] for name, steps in times.items()}
    med = {name: statistics.median(t) for name, t in total.items()}
    best = {gemm: max(samples) for gemm, samples in peaks.items()}
    fastest = max(best, key=best.get)
    peak = best[fastest]
    dtype = "bf16" if precision == "bf16" else "fp32"
    width = max(11, *map(len, total))
    others = "".join(f"; {gemm} {flops_per_s / 1e9:.1f}" for gemm, flops_per_s in best.items() if gemm != fastest)
    lines = [f"[{precision}] {len(next(iter(total.values())))} timed steps per variant, interleaved; measured "
             f"{dtype} matmul peak ({peak_size}^3, best of {len(peaks[fastest])}): {peak / 1e9:.1f} GFLOP/s "
             f"({fastest}{others})",
             f"  {'variant':<{width}} {'FLOPs/dense':>11} {'step ms':>9} {'(best)':>8} {'step/dense':>10} "
             f"{'vs FLOPs':>8} {'tokens/s':>8} {'GFLOP/s':>8} {'MFU':>6}"
             + (f" {'faults':>7}" if faults else "") + "   median ms: fwd / bwd / optim"]
    dense = med.get("dense")
    paged = {name: statistics.median(f) for name, f in (faults or {}).items()}
    for name, t in total.items():
        share = flops[name] / flops["dense"]
        gflops = tokens * flops[name] / med[name] / 1e9
        rel = f"{med[name] / dense:10.3f} {med[name] / dense / share:7.2f}x" if dense else f"{'':>10} {'':>8}"
        phases = " / ".join(f"{statistics.median(p[ph] for p in times[name]) * 1e3:.0f}" for ph in PHASES)
        pages = f" {paged[name]:7.0f}" if paged else ""
        lines.append(f"  {name:<{width}} {share:11.3f} {med[name] * 1e3:9.1f} {min(t) * 1e3:8.1f} {rel} "
                     f"{tokens / med[name]:8.0f} {gflops:8.1f} {gflops * 1e9 / peak:6.1%}{pages}   {phases}")
    faulted = {name: pages for name, pages in paged.items() if pages >= allocator.FAULTED_PAGES}
    if faulted:
        lines.append("  PAGE-FAULTED: " + ", ".join(f"{name} {pages:,.0f}" for name, pages in faulted.items())
                     + " pages a step (median): fresh memory faulted in inside the timed steps is in their "
                       f"times and in every ratio they enter; {allocator.fault_remedy(kept)}")
    if dense and REFERENCE in med:
        target = SPEEDUP_TARGETS.get(precision) if speedup_targets else None
        for name in ("dense", f"dense{COMPILED}"):
            rounds = per_round(total[REFERENCE], total[name]) if name in total else None
            for stat in (statistics.median, min) if name in total else ():
                speedup = stat(total[REFERENCE]) / stat(total[name])
                verdict = "" if target is None else \
                    f" (target >= {target}) {noisy_verdict(speedup, target, rounds, at_most=False, n=len(total[name]))}"
                lines.append(f"  {stat.__name__:<6} {name} step vs reference (today's step): "
                             f"{against(speedup, target, digits=3)}x faster{verdict}")
            if name in total:
                lines.append(f"         reference / {name}, {describe_rounds(total[REFERENCE], total[name])}")
    # TORCH_GEMM: dense through the baseline's own GEMM (torch's mm), the model's share of the lead; no target
    pairs = [(name, base) for name in ("dense", f"dense{COMPILED}") for base in (BASELINE, f"{BASELINE}{COMPILED}")]
    for name, base in [*pairs, (TORCH_GEMM, BASELINE), ("dense", TORCH_GEMM)]:
        if name not in total or base not in total:
            continue
        target = BASELINE_TARGET if speedup_targets and TORCH_GEMM not in (name, base) else None
        ratios = ", ".join(f"{stat.__name__} {against(stat(total[name]) / stat(total[base]), target, digits=3)}"
                           for stat in (statistics.median, min))
        ratio = statistics.median(total[name]) / statistics.median(total[base])
        verdict = "" if target is None else (
            f" (target <= {target}) {noisy_verdict(ratio, target, per_round(total[name], total[base]), n=len(total[name]))}")
        what = ("oneDNN's float32 GEMMs against torch's mm, the rest the same" if base == TORCH_GEMM else
                f"nanoGPT's architecture, FLOPs ratio {flops[name] / flops[base]:.3f}"
                + (", both through torch's mm" if name == TORCH_GEMM else ""))
        lines.append(f"  {name} step / {base} step ({what}): {ratios}{verdict}")
        lines.append(f"         {name} / {base}, {describe_rounds(total[name], total[base])}")
    if dense and "mod" in med:
        flops_ratio = flops["mod"] / flops["dense"]
        rounds = per_round(total["mod"], total["dense"])
        for stat in (statistics.median, min):
            ratio = stat(total["mod"]) / stat(total["dense"])
            verdict = noisy_verdict(ratio, TARGET * flops_ratio, rounds, n=len(total["mod"]))
            lines.append(f"  {stat.__name__:<6} step-time ratio mod/dense {ratio:.3f} vs FLOPs ratio {flops_ratio:.3f}: "
                         f"{against(ratio / flops_ratio, TARGET)} x (target <= {TARGET}) {verdict}")
        lines.append(f"         mod / dense, {describe_rounds(total['mod'], total['dense'])}")
        # The optimizer step costs the same for both (same parameters) and is not in the FLOPs.
        fwd_bwd = {name: statistics.median(p["forward"] + p["backward"] for p in times[name]) for name in ("mod", "dense")}
        ratio = fwd_bwd["mod"] / fwd_bwd["dense"]
        lines.append(f"  forward+backward only (median): mod/dense {ratio:.3f} = {ratio / flops_ratio:.2f} x FLOPs ratio")
    for name in total:
        eager = name.removesuffix(COMPILED)
        if name.endswith(COMPILED) and eager in total:
            speedups = "; ".join(f"{stat.__name__} {stat(total[eager]) / stat(total[name]):.3f}x" for stat in (statistics.median, min))
            lines.append(f"  {name} vs eager {eager}: {speedups} faster (eager step / compiled step)")
    mod_c, dense_c = f"mod{COMPILED}", f"dense{COMPILED}"
    if mod_c in med and dense_c in med:
        ratio, flops_ratio = med[mod_c] / med[dense_c], flops["mod"] / flops["dense"]
        lines.append(f"  median step-time ratio {mod_c}/{dense_c} {ratio:.3f} vs FLOPs ratio {flops_ratio:.3f}: "
                     f"{ratio / flops_ratio:.2f} x")
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


def report_cuda(precision: str, batch: int, seq_len: int, times: dict[str, list[dict[str, float]]],
                flops: dict[str, float], peak: Optional[float], matmul: float,
                graph_skips: Optional[dict[str, GraphSkips]] = None) -> str:
    """Per variant: median step time, tokens/s, achieved model TFLOP/s and MFU, and (with dense) its
    FLOPs share and step/dense; then dense against reference and gpt2, and the MoD target. The CPU
    targets for dense (vs reference, vs gpt2) are not judged here: their ratios print as measured.
    `graph_skips` (graph modes): a variant some of whose compiled graphs ran without CUDA graphs is
    flagged on its line, with the reasons inductor gave."""
    tokens = batch * seq_len
    medians = {name: statistics.median(sum(p.values()) for p in steps) for name, steps in times.items()}
    dense = medians.get("dense")
    width = max(6, *map(len, medians))
    lines = [f"[{precision}] micro-batch {batch} x {seq_len} ({tokens} tokens/step), "
             f"{len(next(iter(times.values())))} timed steps per variant"]
    for name, steps in times.items():
        med = medians[name]
        phases = ", ".join(f"{ph} {statistics.median(p[ph] for p in steps) * 1e3:.1f}" for ph in PHASES)
        tflops = tokens / med * flops[name] / 1e12
        mfu = f"MFU {tflops / peak:6.1%}" if peak else "MFU    n/a"
        share = flops[name] / flops["dense"] if dense else None
        rel = (f"  FLOPs/dense {share:.3f}, step/dense {med / dense:.3f} = {med / dense / share:.2f}x its FLOPs share"
               if dense else "")
        skipped = graph_skips.get(name) if graph_skips else None
        flag = f"  [CUDA GRAPHS SKIPPED: {skipped.count}]" if skipped and skipped.count else ""
        lines.append(f"  {name:<{width}} step {med * 1e3:8.1f} ms  {tokens / med:9,.0f} tokens/s  {tflops:6.1f} TFLOP/s  "
                     f"{mfu}  ({tflops / matmul:5.1%} of measured matmul)  [median ms: {phases}]{rel}{flag}")
    lines += graph_lines(graph_skips or {})
    if dense and REFERENCE in medians:
        lines.append(f"  dense step vs reference (today's step): {medians[REFERENCE] / dense:.3f}x faster")
    if dense and BASELINE in medians:
        lines.append(f"  dense step / {BASELINE} step (nanoGPT's architecture, FLOPs ratio "
                     f"{flops['dense'] / flops[BASELINE]:.3f}): {dense / medians[BASELINE]:.3f}")
    if dense and "mod" in medians:
        ratio, flops_ratio = medians["mod"] / dense, flops["mod"] / flops["dense"]
        verdict = "HOLDS" if ratio <= TARGET * flops_ratio else "MISSED"
        lines.append(f"  step-time ratio mod/dense {ratio:.3f} vs FLOPs ratio {flops_ratio:.3f}: "
                     f"{against(ratio / flops_ratio, TARGET)} x (target <= {TARGET}) {verdict}")
    return "\n".join(lines)


def graph_lines(graph_skips: dict[str, GraphSkips]) -> list[str]:
    """What became of the graph-mode variants' CUDA graphs: recorded throughout, or which variants'
    times include compiled graphs run without them, and why."""
    clean = [name for name, skips in graph_skips.items() if not skips.count]
    lines = [f"  CUDA graphs: recorded for every compiled graph of {', '.join(clean)} (no skips)"] if clean else []
    for name, skips in graph_skips.items():
        if skips.count:
            why = "; ".join(skips.reasons) or "no reason logged (TORCH_LOGS=cudagraphs shows them)"
            lines.append(f"  CUDA GRAPHS SKIPPED for {name}: {skips.count} compiled graph(s) ran without them, so its "
                         f"times are of kernels issued one by one there: {why}")
    return lines


@torch.no_grad()
def sampling_speed(shape: ModelConfig, routing: RoutingConfig, dtype: torch.dtype, batch: int, prompt_len: int,
                   new_tokens: int, calibrate: bool = False, device: str = "cuda"
                   ) -> Optional[tuple[float, Optional[float]]]:
    """Greedy decoding with the KV cache, in the routing mode of the method's eval/loss (causal; hard for
    halting, whose causal forward is the soft one that runs every block) -> (new tokens/s over the batch,
    the fraction of the decoded tokens that took the routed layers' budgeted path: ModelOutput.executed,
    averaged over the decoding steps and the routed layers, None for a dense model); None for a model
    that cannot decode with a cache (Transformer.decodes_incrementally: first_k). Random weights; with
    `calibrate`, the causal thresholds are set as training sets them before every evaluation
    (calibrate_thresholds, on four random sequences), so causal routing runs the configured budget as a
    trained model's does."""
    torch.manual_seed(0)
    model = build_model(shape, routing).eval()
    if not model.decodes_incrementally:
        return None
    if calibrate:
        x = torch.randint(0, shape.vocab_size, (4, min(512, shape.max_seq_len)),
                          generator=torch.Generator().manual_seed(1))
        calibrate_thresholds(model, lambda t: model(t, options=ForwardOptions(mode="causal", calibrate=True)), [x])
    model = model.to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, shape.vocab_size, (batch, prompt_len), device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    mode = honest_routing_mode(routing.method)

    def decode() -> tuple[float, list[torch.Tensor]]:
        cache = model.new_cache()
        logits = model(prompt, options=ForwardOptions(mode=mode, cache=cache)).logits[:, -1]
        executed = []  # per decoding step, its routed layers' fractions (read after the clock stops)
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(logits.argmax(-1, keepdim=True), options=ForwardOptions(mode=mode, cache=cache))
            logits = out.logits[:, -1]
            executed.extend(out.executed.values())
        sync()
        return time.perf_counter() - t0, executed

    decode()  # warm-up (kernel compilation, allocator)
    elapsed, executed = min((decode() for _ in range(2)), key=lambda r: r[0])
    return batch * new_tokens / elapsed, (float(torch.stack(executed).mean()) if executed else None)


def layout_line(variants: dict[str, tuple[ModelConfig, RoutingConfig]]) -> str:
    """The header's model shape (each variant's, where --config models differ) and the blocks each
    routed variant routes (RoutingConfig.is_routed; --config files set their own)."""
    base = {name.removesuffix(COMPILED): v for name, v in variants.items()}  # a +compile twin is its variant's
    shapes: dict[str, list[str]] = {}
    placements: dict[str, list[str]] = {}
    for name, (shape, routing) in base.items():
        shapes.setdefault(f"{shape.n_layers} layers, d_model {shape.d_model}, {shape.n_heads} heads, "
                          f"vocab {shape.vocab_size}", []).append(name)
        blocks = [i for i in range(shape.n_layers) if routing.is_routed(i)]
        if blocks:
            where = (f"all {len(blocks)} blocks" if len(blocks) == shape.n_layers else
                     f"blocks {', '.join(map(str, blocks))} of {shape.n_layers} (0-based)")
            placements.setdefault(where, []).append(name)
    parts = [f"shape: {next(iter(shapes))}"] if len(shapes) == 1 else \
        [f"{', '.join(names)}: {shape}" for shape, names in shapes.items()]
    if len(placements) == 1:
        parts.append(f"routed variants route {next(iter(placements))}")
    else:
        parts += [f"{', '.join(names)} route{'s' if len(names) == 1 else ''} {where}"
                  for where, names in placements.items()]
    return "; ".join(parts)


def compile_line(mode: str, cuda: bool) -> str:
    """The header's line on the `+compile` variants' torch.compile mode."""
    if mode not in CUDA_GRAPH_MODES:
        return f"+compile variants: torch.compile mode {mode}"
    return f"+compile variants: torch.compile mode {mode} " + ("(records CUDA graphs)" if cuda else
                                                              "(CUDA graphs: none on CPU tensors)")


def run_cuda(args, variants: dict[str, tuple[ModelConfig, RoutingConfig]]) -> None:
    props = torch.cuda.get_device_properties(0)
    peak, source = device_peak_tflops(args.peak_tflops)
    print(f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    print(f"{layout_line(variants)}; variants {', '.join(variants)}; {args.warmup} warmup + {args.steps} timed "
          f"steps; fp32 weights, autocast, fused AdamW")
    if args.compile:
        print(compile_line(args.compile_mode, cuda=True))
    for precision in args.precision:
        dtype = PRECISION_DTYPES[precision]
        matmul = measure_matmul_flops(dtype, "cuda", n=8192, iters=20) / 1e12
        peak_text = f"{peak:.0f} TFLOP/s ({source})" if peak else source
        print(f"\npeak (dense 16-bit tensor cores): {peak_text}; measured {precision} matmul 8192^3: "
              f"{matmul:.0f} TFLOP/s" + (f" ({matmul / peak:.0%} of peak)" if peak else ""))
        flops = variant_flops(variants, args.seq_len)
        for batch in args.batch:
            try:
                measured = bench(precision, args.steps, args.warmup, batch, args.seq_len, device="cuda",
                                 variants=variants, compile_mode=args.compile_mode)
            except torch.cuda.OutOfMemoryError:
                print(f"[{precision}] micro-batch {batch} x {args.seq_len}: out of memory")
                torch.cuda.empty_cache()
                continue
            print(report_cuda(precision, batch, args.seq_len, measured.times, flops, peak, matmul,
                              measured.graph_skips), flush=True)
            if args.profile:
                print_profiles(precision, batch, args.seq_len, variants, device="cuda", compile_mode=args.compile_mode)
    if args.sample:
        print_sampling(args, variants, PRECISION_DTYPES[args.precision[0]], "cuda")


def print_sampling(args, variants: dict[str, tuple[ModelConfig, RoutingConfig]], dtype: torch.dtype,
                   device: str) -> None:
    """Greedy KV-cache sampling speed of each variant (sampling_speed), and of MoD with its thresholds
    calibrated, against dense's."""
    print(f"\ngreedy sampling with the KV cache ({str(dtype).removeprefix('torch.')} weights, each method's eval/loss "
          "routing: causal, hard for halting; "
          f"batch {args.sample_batch}, {args.prompt_len}-token prompt + {args.new_tokens} new tokens; random weights; "
          f"{device})")
    # megaroute's own models: sampling_speed builds each variant's model anew (eager, fused math), so gpt2,
    # reference and the compiled or torch-GEMM twins would be dense again under another name
    rows = [(name, shape, r, False) for name, (shape, r) in variants.items()
            if name not in (REFERENCE, BASELINE, TORCH_GEMM) and not name.endswith(COMPILED)]
    if "mod" in variants:  # a trained MoD passes ~capacity of the tokens; a random router's sign ~half
        shape, r = variants["mod"]
        rows.append(("mod_calibrated", shape, r, True))
    speeds = {}
    for name, shape, r, calibrate in rows:
        speed = sampling_speed(shape, r, dtype, args.sample_batch, args.prompt_len, args.new_tokens, calibrate,
                               device)
        if speed is None:
            print(f"  {name:<14} skipped: it cannot decode with a KV cache (its choice depends on the length of "
                  "each call)", flush=True)
            continue
        tps, frac = speed
        speeds[name] = tps
        extra = f", routed layers' budgeted path ran {frac:.0%} of the decoded tokens" if frac is not None else ""
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
    parser.add_argument("--variants", nargs="+", choices=VARIANT_NAMES, default=None,
                        help="which variants to time (default: all on CPU; the configs' dense and mod on CUDA)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps per variant")
    parser.add_argument("--batch", type=positive_int, nargs="+", default=None,
                        help="micro-batch size(s) (default: 8 on CPU, 8 and 16 on CUDA)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="default: 256 on CPU, 1024 on CUDA, or the shortest model.max_seq_len compared")
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: fp32 bf16 on CPU; bf16 on CUDA (fp16 on GPUs without bf16, e.g. V100)")
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="intra-op threads (default: the cores this process may use)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="CPU only. wall: elapsed time; thread: CPU time of this thread, immune to other load on "
                             "a shared machine (needs --threads 1: with one intra-op thread all work runs here)")
    allocator.add_option(parser)
    parser.add_argument("--peak-tflops", type=positive_float, default=None, help="CUDA: the device's peak for MFU")
    parser.add_argument("--peak-size", type=positive_int, default=2048,
                        help="CPU: n of the n x n x n matmul timed once per round as the measured peak")
    parser.add_argument("--sample", action=argparse.BooleanOptionalAction, default=None,
                        help="also time greedy KV-cache sampling of each variant, after the steps (default: on "
                             "CUDA, off on CPU; weights in the first --precision's dtype)")
    parser.add_argument("--sample-batch", type=positive_int, default=1)
    parser.add_argument("--prompt-len", type=positive_int, default=32)
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--compile", action="store_true",
                        help="also time each variant (but reference) with its blocks torch.compile'd, as "
                             "`<variant>+compile` (train.compile: true)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile's mode for --compile; reduce-overhead and max-autotune record CUDA "
                             "graphs of the compiled blocks on a GPU (the host then issues a block's kernels at once)")
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler tables of each variant's steps (CUDA: with the host's issue "
                             "time per phase and the step's host syncs, by call site), then each variant against "
                             "dense op by op: the ops whose time per step differs most")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.clock == "thread" and (args.threads != 1 or cuda):
        parser.error("--clock thread needs --threads 1 (and the CPU device)")
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device"
                     + (" (a CPU-only build)" if torch.version.cuda is None else ""))
    if cuda:
        bf16 = torch.cuda.get_device_capability() >= (8, 0)
        args.precision = args.precision or ["bf16" if bf16 else "fp16"]
        args.batch = args.batch or [8, 16]
        args.sample = True if args.sample is None else args.sample
    else:
        if args.precision and "fp16" in args.precision:
            parser.error("--precision fp16 is for CUDA (CPU autocast runs bf16)")
        args.precision = args.precision or ["fp32", "bf16"]
        args.batch = args.batch or [8]
    try:
        variants = resolve_variants(args.variants, args.shape or ("157m" if cuda else "small"), args.config, args.device)
    except ConfigError as e:
        parser.error(str(e))
    if args.variants and "dense" not in variants:  # a dense --config counts: its variant is dense
        parser.error("--variants must include dense (ratios are to dense), or --config a dense model")
    if args.compile_mode != "default" and not args.compile:
        parser.error(f"--compile-mode {args.compile_mode} needs --compile")
    if args.compile:
        if args.warmup < 1:
            parser.error("--compile needs --warmup >= 1 (the first step compiles)")
        if args.compile_mode in CUDA_GRAPH_MODES and args.warmup < 2:
            parser.error(f"--compile-mode {args.compile_mode} needs --warmup >= 2 "
                         "(the second step records the CUDA graphs)")
        # no compiled twin of dense_torch_gemm: its comparison of GEMM libraries is made eagerly
        variants.update({f"{name}{COMPILED}": v for name, v in list(variants.items()) if name not in (REFERENCE, TORCH_GEMM)})
    if args.seq_len is None:  # the device's default, or the shortest context among the models compared
        args.seq_len = min(1024 if cuda else 256, *(shape.max_seq_len for shape, _ in variants.values()))
    for name, (shape, _) in variants.items():
        if args.seq_len > shape.max_seq_len:
            parser.error(f"--seq-len {args.seq_len} exceeds {name}'s model.max_seq_len={shape.max_seq_len}")
        if args.sample and args.prompt_len + args.new_tokens > shape.max_seq_len:
            parser.error(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds {name}'s "
                         f"model.max_seq_len={shape.max_seq_len}")
    if cuda:
        run_cuda(args, variants)
        return 0

    if "dense" not in variants:
        parser.error(f"the CPU comparison needs a dense variant, got {sorted(variants)}")
    applied = allocator.apply(args.allocator)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    shape = variants["dense"][0]
    flops = variant_flops(variants, args.seq_len)
    for batch in args.batch:
        tokens = batch * args.seq_len
        print(f"{layout_line(variants)}; batch {batch} x seq {args.seq_len}; "
              f"{args.threads} threads, {args.clock} clock, {args.warmup} warmup steps, torch {torch.__version__}")
        print(applied.line)
        if args.compile:
            print(compile_line(args.compile_mode, cuda=False))
        print("train FLOPs/token (analytic; gpt2: counted relative to dense): " + ", ".join(f"{name} {f / 1e6:.1f} M" for name, f in flops.items()))
        if "mod" in flops:
            print(f"MoD FLOPs ratio {flops['mod'] / flops['dense']:.3f} (capacity {variants['mod'][1].capacity})")
        for precision in args.precision:
            times, peaks, faults, _ = bench(precision, args.steps, args.warmup, batch, args.seq_len, clock,
                                            variants=variants, peak_size=args.peak_size,
                                            compile_mode=args.compile_mode)
            at_target = (shape, batch, args.seq_len) == TARGET_RUN
            print("\n" + report(precision, times, tokens, flops, peaks, args.peak_size, at_target, faults,
                                      applied.kept), flush=True)
            if args.profile:
                print_profiles(precision, batch, args.seq_len, variants, compile_mode=args.compile_mode)
    if args.sample:
        print_sampling(args, variants, PRECISION_DTYPES[args.precision[0]], "cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
