"""Tensor-parallel throughput and communication volume.

    python -m megaroute.bench.parallel [--steps 5 --warmup 2 --batch 4 --seq-len 256 --method none --tp 2 --dp 1]

1. Training-step tokens/s (forward + backward + AdamW) of the 6-layer/384 model at TP=1 (one
   process, 1 and 2 threads) vs TP=2 (two gloo processes, 1 thread each) on the same batch. On
   CPU this is only a sanity check: gloo all-reduces through TCP, and 2 shared cores bound
   everything (2 OpenMP threads on a loaded 2-core machine can be slower than 1).
2. Per-step communication estimated from the layout: the bytes each rank all-reduces for TP
   activations (routing-aware: a MoD block communicates for its k selected tokens only; an MoE
   block for its expert rows, plus its expert weight gradients, which TP peers all-reduce) and for
   DP gradients. "payload" is the tensor size handed to the collective; a ring all-reduce moves
   2 (n - 1) / n of it per rank over the wire.
3. MoE-family methods (--method moe, mode_staged, mode_integrated): TP=2 steps with the routed
   experts' rows split over the two ranks (moe.py) vs the experts repeated on both, interleaved in one
   process group: wall time, and the ranks' own CPU time (which leaves out waiting on gloo).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..argtypes import non_negative_int, positive_int
from ..config import ModelConfig, RoutingConfig
from ..inspect import param_counts
from ..model import build_model
from ..model.routing import METHODS, method_spec
from ..model.routing.moe import MoEFFN, expert_hidden, expert_rows
from ..parallel import collectives
from ..parallel.testing import run_distributed

SHAPE = ModelConfig(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, max_seq_len=256)
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class CommVolume:
    tp_activation_bytes: float  # per rank, per optimizer step
    tp_collectives: int
    dp_gradient_bytes: float
    dp_gather_bytes: float  # ZeRO-3 parameter all-gathers (forward + backward)

    @staticmethod
    def ring(payload: float, n: int) -> float:
        return 0.0 if n == 1 else payload * 2 * (n - 1) / n


def comm_volume(model: ModelConfig, routing: RoutingConfig, tp: int, dp: int, micro_batch: int, seq_len: int,
                accumulation: int = 1, zero_stage: int = 1, precision: str = "fp32") -> CommVolume:
    """All-reduce payloads of one optimizer step for one rank (see the module docstring)."""
    act = BYTES[precision]
    d, B = model.d_model, micro_batch
    tp_bytes, tp_ops = 0.0, 0
    spec = method_spec(routing.method)
    if tp > 1:
        for layer in range(model.n_layers):
            # Tokens a block's TP layers see (the spec's `tokens`): capacity routing runs its k tokens;
            # gates that train both paths (depth gate, halting, early exit) run every token.
            tokens = B * (spec.tokens(routing, seq_len) if routing.is_routed(layer) else seq_len)
            # forward: attention-out and FFN-down all-reduces; backward: the qkv and gate_up input grads.
            tp_bytes += 4 * tokens * d * act
            tp_ops += 4
            if spec.experts and routing.is_routed(layer):
                # The routed experts' rows replace FFN-down / gate_up: their outputs (forward) and input
                # grads (backward) are all-reduced, and so are the expert weight gradients (moe.py).
                tp_bytes += 2 * (B * expert_rows(routing, seq_len) - tokens) * d * act
                tp_bytes += routing.moe.num_experts * 3 * d * expert_hidden(model, routing.moe) * act
                tp_ops += 2
        # Embedding forward and LM-head input grad, [B, T, d] each; vocab-parallel CE: max, then
        # (target logit, sum of exp), fp32. Depth-gate oracle-label passes are not counted.
        tp_bytes += 2 * B * seq_len * d * act + 3 * B * seq_len * 4
        tp_ops += 4
        tp_bytes *= accumulation
        tp_ops *= accumulation

    # Attention, FFN, embedding and LM head are split over tp; routing controllers and norms are replicated.
    local = param_counts(build_model(model, routing, device="meta"), tp)["per_tp_rank"]
    dp_bytes = float(local * act) if dp > 1 else 0.0
    gather = 2.0 * local * act if dp > 1 and zero_stage == 3 else 0.0
    return CommVolume(tp_bytes, tp_ops, dp_bytes, gather)


def _trainer(world: int, method: str, batch: int, seq_len: int, threads: int):
    """(model, optimizer, batch, TP group) of one rank: the benchmark model over all `world` ranks."""
    torch.set_num_threads(threads)
    group = dist.new_group(list(range(world))) if world > 1 else None
    torch.manual_seed(0)
    model = build_model(SHAPE, _routing(method), tp_group=group)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, SHAPE.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return model, optim, data, group


def _timed_step(model, optim, data) -> tuple[float, float]:
    """One training step between barriers -> (wall s, this rank's CPU s)."""
    collectives.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    model(data[:, :-1], data[:, 1:]).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    collectives.barrier()
    return time.perf_counter() - t0, time.thread_time() - c0


def _train_steps(rank: int, world: int, method: str, batch: int, seq_len: int, steps: int, warmup: int,
                 threads: int) -> float:
    """Seconds per training step, measured on every rank between barriers."""
    model, optim, data, _ = _trainer(world, method, batch, seq_len, threads)
    times = [_timed_step(model, optim, data)[0] for _ in range(warmup + steps)][warmup:]
    return sorted(times)[len(times) // 2]


def _split_vs_repeat(rank: int, world: int, method: str, batch: int, seq_len: int, steps: int,
                     warmup: int) -> dict[str, tuple[float, float]]:
    """TP=2 step medians, {"split" | "repeat": (wall s, this rank's CPU s)}: the MoE layers' experts
    run a share of the rows per rank (their tp_group set) or every row on both (tp_group None)."""
    model, optim, data, group = _trainer(world, method, batch, seq_len, 1)
    moes = [m for m in model.modules() if isinstance(m, MoEFFN)]
    times: dict[str, list[tuple[float, float]]] = {"split": [], "repeat": []}
    for i in range(2 * (warmup + steps)):
        mode = "split" if i % 2 == 0 else "repeat"
        for m in moes:
            m.tp_group = group if mode == "split" else None
        timed = _timed_step(model, optim, data)
        if i >= 2 * warmup:
            times[mode].append(timed)
    return {mode: tuple(sorted(col)[len(col) // 2] for col in zip(*t)) for mode, t in times.items()}


def _routing(method: str) -> RoutingConfig:
    return RoutingConfig() if method == "none" else RoutingConfig(method=method, capacity=0.125, every=2, offset=1)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--method", default="none", choices=list(METHODS))
    p.add_argument("--tp", type=positive_int, default=2, help="TP size for the communication estimate")
    p.add_argument("--dp", type=positive_int, default=1, help="DP size for the communication estimate")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=1)
    p.add_argument("--precision", default="fp32", choices=sorted(BYTES))
    p.add_argument("--skip-timing", action="store_true", help="only the communication estimate")
    a = p.parse_args(argv)

    routing = _routing(a.method)
    tokens = a.batch * a.seq_len
    print(f"model: d {SHAPE.d_model}, {SHAPE.n_layers} layers, {SHAPE.n_heads} heads, vocab {SHAPE.vocab_size}; "
          f"routing {a.method}; batch {a.batch} x {a.seq_len} tokens")
    if not a.skip_timing:
        args = (a.method, a.batch, a.seq_len, a.steps, a.warmup)
        env = {"OMP_NUM_THREADS": "1"}
        # TP=1 with both thread counts: 2 threads is the fair core budget, 1 thread the per-core baseline.
        t1 = {n: run_distributed(_train_steps, 1, *args, n, env=env)[0] for n in (1, 2)}
        t2 = max(run_distributed(_train_steps, 2, *args, 1, env=env))
        for n, t in t1.items():
            label = f"TP=1 (1 process x {n} thread{'s' if n > 1 else ' '})"
            print(f"{label}: {t * 1e3:8.1f} ms/step  {tokens / t:9.0f} tokens/s")
        print(f"TP=2 (2 processes x 1 thread): {t2 * 1e3:8.1f} ms/step  {tokens / t2:9.0f} tokens/s  "
              f"(x{min(t1.values()) / t2:.2f} vs the faster TP=1)")
        if method_spec(a.method).experts:
            ranks = run_distributed(_split_vs_repeat, 2, *args, env=env)
            print(f"TP=2 MoE experts, interleaved medians of {a.steps} steps (wall / each rank's CPU, ms):")
            for mode, what in (("split", "rows split over TP"), ("repeat", "every row on both ranks")):
                cpu = " / ".join(f"{r[mode][1] * 1e3:.1f}" for r in ranks)
                print(f"  {what:<24}: wall {max(r[mode][0] for r in ranks) * 1e3:8.1f}   CPU {cpu}")
    v = comm_volume(SHAPE, routing, a.tp, a.dp, a.batch, a.seq_len, zero_stage=a.zero_stage, precision=a.precision)
    print(f"communication per optimizer step and rank (tp {a.tp} x dp {a.dp}, ZeRO-{a.zero_stage}, {a.precision}):")
    print(f"  TP activations : payload {_fmt_bytes(v.tp_activation_bytes)} in {v.tp_collectives} all-reduces, "
          f"ring traffic {_fmt_bytes(CommVolume.ring(v.tp_activation_bytes, a.tp))}")
    print(f"  DP gradients   : payload {_fmt_bytes(v.dp_gradient_bytes)}, "
          f"ring traffic {_fmt_bytes(CommVolume.ring(v.dp_gradient_bytes, a.dp))}")
    if v.dp_gather_bytes:
        print(f"  ZeRO-3 params  : all-gather payload {_fmt_bytes(v.dp_gather_bytes)} (forward + backward)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
