"""Engine overhead: the same model stepped by DeepSpeed (1 process, ZeRO 0) and by a plain loop.

    python -m megaroute.bench.engine [--steps 20] [--models tiny,384] [--threads 1] [--allocator keep|defaults]

Both loops do the training loop's forward (no logits returned), backward, gradient clipping and an
AdamW step on the same batches; their steps are interleaved (each round in its own shuffled order,
noise.round_order) so load on a shared machine hits both alike. Reported per
step: the process's CPU time (all its threads) and wall time, medians, and the engine/plain ratio
per round (median and interquartile range: what the noise could make of it). Also reports what
MLflow logging costs the loop: the enqueue time per step next to the step.
Target: engine overhead under 5% (CPU time; "within the noise" when the per-round interquartile range
spans it or their median is on its other side), logging under 5%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from ..argtypes import comma_list, non_negative_int, one_of, positive_int
from ..config import load_config
from ..model import build_model
from ..train import engine as ds
from ..train.engine import init_distributed
from ..train.env import detect_env, release
from ..train.loop import TRAIN_FORWARD
from ..train.optim import GuardedAdamW, param_groups
from ..train.tracking import MLflowTracker
from . import allocator
from .noise import against, describe, per_round, round_order, verdict

TARGET = 0.05  # at most this overhead over the plain loop (CPU time), and MLflow logging's share of a step
ABOVE = f"ABOVE {TARGET:.0%} TARGET"
SHAPES = {
    "tiny": ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "data.seq_len=128", "model.max_seq_len=128",
             "model.vocab_size=128", "data.tokenizer.vocab_size=128"],
    "384": ["model.d_model=384", "model.n_layers=6", "model.n_heads=6", "data.seq_len=256", "model.max_seq_len=256",
            "model.vocab_size=8192"],
}


def _interleaved(step_fns: dict, batches, warmup: int) -> dict[str, tuple[list, list]]:
    """name -> (process CPU s, wall s) of each timed step, the variants stepped in turn."""
    times: dict[str, tuple[list, list]] = {name: ([], []) for name in step_fns}
    for i, (x, y) in enumerate(batches):
        for name in round_order(list(step_fns), i):
            c0, w0 = time.process_time(), time.perf_counter()
            step_fns[name](x, y)
            if i >= warmup:
                times[name][0].append(time.process_time() - c0)
                times[name][1].append(time.perf_counter() - w0)
    return times


def bench_model(shape: str, steps: int, warmup: int, batch: int) -> dict:
    cfg = load_config(None, [*SHAPES[shape], f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
                             "optim.zero_stage=0", "optim.warmup_steps=0"])
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len), generator=g),) * 2
               for _ in range(steps + warmup)]

    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.routing)
    opt = GuardedAdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr)

    def plain_step(x, y):
        model(x, y, options=TRAIN_FORWARD).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    engine, _, _ = ds.initialize(build_model(cfg.model, cfg.routing), cfg, ds.deepspeed_config(cfg, 1), steps)

    def engine_step(x, y):
        engine.backward(engine(x, y, options=TRAIN_FORWARD).loss)
        engine.step()

    t = _interleaved({"plain": plain_step, "engine": engine_step}, batches, warmup)
    (plain_cpu, plain_wall), (engine_cpu, engine_wall) = t["plain"], t["engine"]
    med = statistics.median
    return {"shape": shape, "tokens": batch * cfg.data.seq_len, "plain_s": med(plain_cpu), "engine_s": med(engine_cpu),
            "overhead": med(engine_cpu) / med(plain_cpu) - 1.0, "plain_wall_s": med(plain_wall),
            "engine_wall_s": med(engine_wall), "wall_overhead": med(engine_wall) / med(plain_wall) - 1.0,
            "rounds": describe(engine_cpu, plain_cpu), "wall_rounds": describe(engine_wall, plain_wall),
            "per_round": per_round(engine_cpu, plain_cpu), "n": len(engine_cpu)}


def bench_logging(step_s: float, calls: int = 200) -> dict:
    """Per-step enqueue cost of MLflowTracker (a typical step's ~20 metrics) vs the step time."""
    with tempfile.TemporaryDirectory() as tmp:
        tracker = MLflowTracker(f"sqlite:///{tmp}/bench.db", "bench", "bench", params={"a": 1}, tags={},
                                artifact_root=os.path.join(tmp, "art"))
        metrics = {f"routing/layer_{i}/selected_frac": 0.125 for i in range(16)}
        metrics.update({"train/loss": 3.0, "train/lr": 1e-3, "perf/tokens_per_s": 1e4, "perf/mfu": 0.3})
        t0 = time.perf_counter()
        for step in range(calls):
            tracker.log_metrics(metrics, step)
        per_call = (time.perf_counter() - t0) / calls
        tracker.close(timeout=60)
    return {"log_s": per_call, "fraction": per_call / step_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaroute.bench.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--models", type=comma_list(one_of(SHAPES, "model")), default=["tiny", "384"],
                   help=f"comma-separated, of {', '.join(SHAPES)} (default tiny,384)")
    p.add_argument("--threads", type=non_negative_int, default=1, help="torch threads (0: one per CPU this process may use)")
    allocator.add_option(p)
    args = p.parse_args(argv)
    print(allocator.apply(args.allocator).line)
    env = detect_env()
    torch.set_num_threads(args.threads if args.threads > 0 else max(1, len(os.sched_getaffinity(0))))

    init_distributed(env)
    try:
        print(f"{'model':<6} {'tokens/step':>11} {'plain CPU':>10} {'engine CPU':>11} {'overhead':>9}   "
              f"{'plain wall':>10} {'engine wall':>11} {'overhead':>9}")
        rows = [bench_model(s, args.steps, args.warmup, args.batch) for s in args.models]
        for r in rows:
            print(f"{r['shape']:<6} {r['tokens']:>11} {r['plain_s'] * 1e3:>8.1f}ms {r['engine_s'] * 1e3:>9.1f}ms "
                  f"{against(100 * r['overhead'], 100 * TARGET, digits=1):>8}%   {r['plain_wall_s'] * 1e3:>8.1f}ms "
                  f"{r['engine_wall_s'] * 1e3:>9.1f}ms "
                  f"{100 * r['wall_overhead']:>8.1f}%  "
                  f"{verdict(1 + r['overhead'], 1 + TARGET, r['per_round'], met='OK', missed=ABOVE, n=r['n'])}")
            print(f"       engine / plain, CPU {r['rounds']}; wall {r['wall_rounds']}")
        log = bench_logging(rows[0]["engine_wall_s"])  # both wall clock
        print(f"MLflow logging: {log['log_s'] * 1e6:.0f} us per step = {100 * log['fraction']:.2f}% of the "
              f"{rows[0]['shape']} step ({'OK' if log['fraction'] < TARGET else ABOVE})")
    finally:
        release(env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
