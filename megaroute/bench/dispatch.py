"""Routed savings on the clock: a hard-halting forward vs a dense forward at the same shape.

    python -m megaroute.bench.dispatch [--shapes nanogpt,char] [--fracs 1.0,0.8,0.5] [--repeats 15]
                                       [--methods halting,mod] [--precision fp32,bf16]
                                       [--allocator keep|defaults]

Per shape and executed fraction f: a halting model (gates before every block) runs in hard mode
with each layer's decision replaced by a random mask executing f of the batch's tokens, so f is the
fraction of token-layer ops executed (the gates still run): "even" masks pick tokens anywhere in
the batch, "spread" masks give the sequences different fractions around f (see random_masks). Every
round draws fresh masks, each layer's fraction uniform in f +- JITTER (0.02), as real gates' counts
move from layer to layer and batch to batch: one fixed set of masks let per-shape caches (oneDNN's
primitive per row count) flatter the hard forward. At f = 1
every token runs, and the hard layer runs its block as a dense layer does (ragged.update_rows): that
row measures the gates, not the ragged dispatch.
The dense model has the same shape. Reported: median forward time of each (no grad, eval, one
torch thread, this thread's CPU time, dense and hard interleaved in one process, each round in its
own shuffled order), their ratio, the interquartile range of the per-round ratios
(bench/noise.py), the FLOPs ratio of the two forwards (the mean over the timed rounds' masks) and
the time ratio over it ("vs FLOPs": 1.00x =
time saved matches FLOPs saved). A forward's FLOPs: its matmuls by FlopCounterMode (the gates, the
embedding and the LM head run on every token) plus attention's scores over each sequence's executed
tokens (4 c^2 d per layer for c tokens, megaroute.flops' convention; torch's counter has no formula
for CPU attention). Target
(issue 19): ratio <= 0.88 at f = 0.8; the verdict says "within the noise" when the per-round
interquartile range spans it, or the per-round ratios' median is on its other side.

`--precision fp32,bf16` times the models in each precision (bf16: both models' weights cast to
bf16, as sampling runs them), a table each under its name; the target applies to each. The default
is float32 alone.

`--methods mod` adds causal MoD's inference forward (a router before every block, the ragged path of
execute.update_selected), timed the same way against its own dense forward, decisions replaced by
the same kind of masks, in a table of its own without a target. Its router and its own decision
still run and the replaced decision is re-laid out (dispatch.mask_indices once more per layer), which
real causal inference does not pay: if anything the line is against MoD.

Each line also prints the median minor page faults of a dense and of a hard forward (allocator.py):
a forward that faults in fresh pages (memory freed back to the OS, or a heap growing into pages never
touched) pays for it in its time, and when either side faults `allocator.FAULTED_PAGES` or more the verdict
says so. `--allocator keep` (the default) keeps freed memory and faults a heap reserve in up front,
so neither side does (without the reserve, the hard forwards' varying tensor sizes grew the heap
for many rounds); `--allocator defaults` measures glibc's defaults, where whether a forward's large
tensors come back from the heap or from the OS differs from process to process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..argtypes import comma_list, one_of, positive_int, unit_interval
from ..config import load_config
from ..flops import PRECISION_DTYPES
from ..model import ForwardOptions, build_model
from . import allocator
from .noise import against, per_round, round_order, verdict

aten = torch.ops.aten

SHAPES = {
    # nanoGPT's comparison shape (issue 19): 6 layers, d 384, 6 heads, T 256, batch 8, vocab 8192
    "nanogpt": (8, ["model.d_model=384", "model.n_layers=6", "model.n_heads=6", "data.seq_len=256",
                    "model.max_seq_len=256", "model.vocab_size=8192", "data.tokenizer.vocab_size=8192"]),
    # the char experiments (configs/experiments/char_dense.yaml): 6 layers, d 128, T 128, batch 16
    "char": (16, ["model.d_model=128", "model.n_layers=6", "model.n_heads=4", "data.seq_len=128",
                  "model.max_seq_len=128", "model.vocab_size=128", "data.tokenizer.vocab_size=128"]),
}
TARGET = 0.88
# Each layer's executed fraction varies by this much around f, and every round draws fresh masks: a
# real gate's counts change from layer to layer and batch to batch, and per-shape costs (oneDNN builds a
# primitive per new row count, kernels/cpu_linear.py) must show, not hide behind one fixed set of masks.
JITTER = 0.02


def random_masks(n_layers: int, B: int, T: int, frac: float, generator: torch.Generator,
                 spread: bool = False, jitter: float = 0.0) -> dict[str, torch.Tensor]:
    """Per layer, a random [B, T] mask executing `frac` of the tokens. Even: exactly round(frac * B * T)
    True entries anywhere in the batch (row counts differ by chance only). Spread: row r executes
    round(f_r * T) random tokens, f_r evenly spaced over [2 frac - 1, 1] (or [0, 2 frac] below 0.5),
    mean frac: sequences that need more or less depth, as content-dependent gates give. `jitter`:
    each layer's fraction is drawn uniformly from frac +- jitter instead (clipped to [0, 1]), so the
    executed counts change from layer to layer, as real gates' do."""
    masks = {}
    for i in range(n_layers):
        f = frac
        if jitter:
            f = min(1.0, max(0.0, frac + jitter * (2 * torch.rand((), generator=generator).item() - 1)))
        if spread:
            lo, hi = (2 * f - 1, 1.0) if f >= 0.5 else (0.0, 2 * f)
            counts = [round(x * T) for x in torch.linspace(lo, hi, B).tolist()]
            rows = [torch.zeros(T, dtype=torch.bool).index_fill_(0, torch.randperm(T, generator=generator)[:c], True)
                    for c in counts]
            masks[f"layer_{i}"] = torch.stack(rows)
        else:
            mask = torch.zeros(B * T, dtype=torch.bool)
            mask[torch.randperm(B * T, generator=generator)[: round(f * B * T)]] = True
            masks[f"layer_{i}"] = mask.view(B, T)
    return masks


def _cpu_time(fn) -> tuple[float, int]:
    """fn's CPU time on this thread and the page faults it took."""
    faults, t0 = allocator.page_faults(), time.thread_time()
    fn()
    return time.thread_time() - t0, allocator.page_faults() - faults


def _matmul_flops(fn) -> int:
    """FLOPs of the projections, gates and LM head fn runs: FlopCounterMode's mm and addmm. Attention is
    left to `attention_flops`, whatever the counter makes of it (torch 2.13 has no formula for CPU
    attention; the math backend would show it as bmm's; under the counter the ragged path's eager
    fallback pads into buckets, which the kernels do not). Any other counted op is an error."""
    with FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts()["Global"]
    other = sorted(str(op) for op in counts
                   if op not in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm) and "attention" not in str(op))
    if other:
        raise RuntimeError(f"bench.dispatch: FlopCounterMode counted {other}, which this count does not model")
    return counts.get(aten.mm, 0) + counts.get(aten.addmm, 0)


def attention_flops(executed: list[torch.Tensor], d_model: int) -> int:
    """Attention scores of one forward, as megaroute.flops counts them: QK^T and AV over the full c x c
    matrix of a sequence that runs c tokens, 4 c^2 d per layer. executed: per layer, [B, T] bool."""
    return sum(4 * d_model * int((mask.sum(dim=1) ** 2).sum()) for mask in executed)


# Routed models timed against dense: routing.method -> the forward mode whose ragged dispatch is timed
METHODS = {"halting": "hard", "mod": "causal"}
PRECISIONS = ("fp32", "bf16")


@torch.no_grad()
def bench_shape(shape: str, fracs: list[float], repeats: int, warmup: int = 2, method: str = "halting",
                dtype: torch.dtype = torch.float32) -> list[dict]:
    """A dict per (executed fraction, mask kind): the routed model's (`method`, in METHODS' mode) forward
    against dense's, both models' weights in `dtype`; "hard_s" and "hard_faults" are the routed side's,
    whichever the mode."""
    B, overrides = SHAPES[shape]
    base = load_config(None, overrides)
    routed = load_config(None, [*overrides, f"routing.method={method}", "routing.every=1", "routing.offset=0"])
    mode = METHODS[method]
    torch.manual_seed(0)
    dense_model = build_model(base.model, base.routing).eval().to(dtype)
    routed_model = build_model(routed.model, routed.routing).eval().to(dtype)
    T, V = base.data.seq_len, base.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, T), generator=g)
    cases = [(f, spread) for f in fracs for spread in (False, True) if not (spread and f in (0.0, 1.0))]  # same masks
    # fresh masks every round (JITTER); f = 1 stays every token
    masks = {c: [random_masks(base.model.n_layers, B, T, c[0], g, spread=c[1], jitter=JITTER if c[0] < 1 else 0.0)
                 for _ in range(warmup + repeats)] for c in cases}

    def dense():
        dense_model(tokens)

    def routed_forward(m: dict[str, torch.Tensor]):
        return lambda: routed_model(tokens, options=ForwardOptions(mode=mode, masks=m))

    for r in range(warmup):
        dense()
        for c in cases:
            routed_forward(masks[c][r])()
    times: dict = {name: [] for name in ("dense", *cases)}
    faults: dict = {name: [] for name in ("dense", *cases)}
    for r in range(repeats):  # interleaved: machine load drifts over all variants alike
        fns = {"dense": dense, **{c: routed_forward(masks[c][warmup + r]) for c in cases}}
        for name in round_order(list(fns), r):
            seconds, pages = _cpu_time(fns[name])
            times[name].append(seconds)
            faults[name].append(pages)
    d = base.model.d_model
    full = [torch.ones(B, T, dtype=torch.bool)] * base.model.n_layers
    dense_s = statistics.median(times["dense"])
    dense_flops = _matmul_flops(dense) + attention_flops(full, d)

    def flops_ratio(case) -> float:  # the timed rounds' mean
        timed = masks[case][warmup:]
        return statistics.fmean(_matmul_flops(routed_forward(m)) + attention_flops(list(m.values()), d)
                                for m in timed) / dense_flops

    return [{"shape": f"{shape} ({base.model.n_layers}L d{base.model.d_model} T{T} B{B} V{V})", "frac": c[0],
             "masks": "spread" if c[1] else "even", "dense_s": dense_s, "hard_s": statistics.median(times[c]),
             "ratio": statistics.median(times[c]) / dense_s, "rounds": per_round(times[c], times["dense"]),
             "flops_ratio": flops_ratio(c), "dense_faults": statistics.median(faults["dense"]),
             "hard_faults": statistics.median(faults[c])}
            for c in cases]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaroute.bench.dispatch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=comma_list(one_of(SHAPES, "shape")), default=list(SHAPES),
                   help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--fracs", type=comma_list(unit_interval), default=[1.0, 0.8, 0.5],
                   help="executed fractions, comma-separated (default 1.0,0.8,0.5)")
    p.add_argument("--repeats", type=positive_int, default=15)
    p.add_argument("--methods", type=comma_list(one_of(METHODS, "method")), default=["halting"],
                   help="routed models, comma-separated: halting (hard mode; the target's), mod (causal)")
    p.add_argument("--precision", type=comma_list(one_of(PRECISIONS, "precision")), default=["fp32"],
                   help="weights' precisions, comma-separated, of fp32, bf16 (default fp32)")
    allocator.add_option(p)
    args = p.parse_args(argv)
    applied = allocator.apply(args.allocator)
    print(applied.line)
    torch.set_num_threads(1)
    for method in args.methods:
        if method != "halting":
            print(f"\n{method}, {METHODS[method]} mode (decisions replaced by the masks; no target):")
        for precision in dict.fromkeys(args.precision):
            if args.precision != ["fp32"]:
                print(f"[{precision}] {'float32' if precision == 'fp32' else 'bf16'} weights, both models")
            print_method(args, method, applied.kept, PRECISION_DTYPES[precision])
    return 0


def print_method(args, method: str, kept: bool, dtype: torch.dtype = torch.float32) -> None:
    """The table of one routed method against dense: a line per shape, executed fraction and mask kind."""
    mode = METHODS[method]  # hard (halting) or causal (MoD): the columns name it
    print(f"{'shape':<34} {'executed':>8} {'masks':>6} {'dense fwd':>10} {mode + ' fwd':>10} {mode + '/dense':>10} "
          f"{'per-round IQR':>13} {'FLOPs ratio':>11} {'vs FLOPs':>8} {'faults/fwd':>13}")
    for s in args.shapes:
        for r in bench_shape(s, args.fracs, args.repeats, method=method, dtype=dtype):
            judged = r["frac"] == 0.8 and method == "halting"
            note = "" if not judged else "  " + verdict(
                r["ratio"], TARGET, r["rounds"], met="OK", missed=f"ABOVE {TARGET} TARGET", n=args.repeats)
            ratio = against(r["ratio"], TARGET if judged else None, digits=3)
            print(f"{r['shape']:<34} {r['frac']:>8.0%} {r['masks']:>6} {r['dense_s'] * 1e3:>8.1f}ms "
                  f"{r['hard_s'] * 1e3:>8.1f}ms "
                  f"{ratio:>10} {r['rounds'][1]:>6.3f}-{r['rounds'][2]:.3f} {r['flops_ratio']:>11.3f} "
                  f"{r['ratio'] / r['flops_ratio']:>7.2f}x {r['dense_faults']:>6.0f}/{r['hard_faults']:<6.0f}"
                  f"{note}{faulted(r['dense_faults'], r['hard_faults'], kept, mode)}")


def faulted(dense_pages: float, hard_pages: float, kept: bool = True, mode: str = "hard") -> str:
    """The warning a line carries when a side's median forward faulted in allocator.FAULTED_PAGES or more
    (`hard_pages`, `mode`: the routed side's, whichever mode the table times: the keys and names
    predate causal MoD's table)."""
    if max(dense_pages, hard_pages) < allocator.FAULTED_PAGES:
        return ""
    return (f"  PAGE-FAULTED (dense {dense_pages:.0f}, {mode} {hard_pages:.0f} pages a forward: fresh memory is "
            f"faulted in inside the timed forwards; {allocator.fault_remedy(kept)})")


if __name__ == "__main__":
    raise SystemExit(main())
