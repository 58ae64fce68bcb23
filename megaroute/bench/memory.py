"""Measured peak memory of real training runs beside megaroute.memory's estimate.

    python -m megaroute.bench.memory [--quick] [--steps 2] [--no-157m] [--only TEXT] [--json out.json]
    python -m megaroute.bench.memory --reestimate out.json

Each case runs the real launcher (`launcher/pretrain.py`'s `main`, one process, or `deepspeed
--num_gpus N` with DS_ACCELERATOR=cpu for several ranks) for `--steps` optimizer steps plus one
evaluation (`train.eval_batches=1`), with tracking and checkpoints off, on the bundled corpus
prepared with the character tokenizer (ids < every config's vocabulary; the model shapes are
the configs'). Each rank reports its own peak at exit: CPU `VmHWM` from /proc/self/status (peak
resident set), CUDA `torch.cuda.max_memory_allocated` and `max_memory_reserved`. The table shows
the largest rank's peak, the estimate (megaroute.memory.estimate_for_config for the same config,
layout and device kind; on CUDA without the context, which the allocator does not see) and
estimate / measured. `--reestimate FILE` prints the table of an earlier `--json FILE` with the
current estimate (no training).

Cases: the tiny dense model and the routing methods of TINY_METHODS at tiny shape (ZeRO 1, one
rank); a ~30M-parameter "small" dense model at ZeRO 0-3 on two ranks, with and without activation checkpointing;
the small shape as an MoE model (routing.method=moe, 4 experts in every 2nd block, ~56M parameters of
which 35M routed experts) on two ranks at ZeRO 1 with parallel.ep=1 (each rank holds all experts) and
ep=2 (each holds 2 of each layer's 4, their ZeRO states unpartitioned: dp / ep = 1); and
dense_157m in fp32 at micro-batch 1 on one rank (the issue's case; `--no-157m` skips it, it
needs ~8 GiB and minutes of CPU). `--quick`: tiny dense, tiny MoD and small ZeRO-2 on two ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megaroute.argtypes import positive_int
from megaroute.config import load_config
from megaroute.data.prepare import prepare
from megaroute.memory import estimate_for_config
from megaroute.paths import dir_problem
from megaroute.train.run import main as pretrain_main

REPO = Path(__file__).resolve().parents[2]
# Where each rank writes its peak (set by the runner for the worker processes it launches).
OUT_ENV = "MEGAROUTE_MEMORY_OUT"
SMALL = ["model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.vocab_size=8192",
         "model.max_seq_len=256", "data.seq_len=256", "train.micro_batch_size=4", "train.global_batch_size=8"]
MOE4 = ["routing.method=moe", "routing.moe.num_experts=4", "routing.every=2"]
TINY_METHODS = ["mod", "random", "stride", "first_k", "depth_gate", "halting", "early_exit"]


@dataclass(frozen=True)
class Case:
    name: str
    config: str
    overrides: tuple[str, ...] = ()
    ranks: int = 1


def cases(quick: bool, with_157m: bool) -> list[Case]:
    tiny = [Case("tiny dense z1", "configs/tiny.yaml"),
            *(Case(f"tiny {m} z1", "configs/tiny.yaml", (f"routing.method={m}",)) for m in TINY_METHODS)]
    small = [Case(f"small dense z{z} x2", "configs/tiny.yaml", (*SMALL, f"optim.zero_stage={z}"), 2) for z in range(4)]
    small += [Case(f"small dense z{z} x2 ckpt", "configs/tiny.yaml",
                   (*SMALL, f"optim.zero_stage={z}", "parallel.activation_checkpointing=true"), 2) for z in (1, 3)]
    # MoE (4 experts in every 2nd block) at ZeRO 1 on two ranks, experts replicated (ep 1) or split (ep 2).
    moe = [Case(f"small moe4 ep{ep} z1 x2", "configs/tiny.yaml",
                (*SMALL, *MOE4, "optim.zero_stage=1", f"parallel.ep={ep}"), 2) for ep in (1, 2)]
    big = [Case("dense_157m fp32 mb1 z1", "configs/dense_157m.yaml",
                ("train.precision=fp32", "train.micro_batch_size=1", "train.global_batch_size=1"))]
    if quick:
        return [tiny[0], tiny[1], small[2]]
    return tiny + small + moe + (big if with_157m else [])


def _common(data_dir: str, runs: str, steps: int) -> list[str]:
    return [f"data.output_dir={data_dir}", "data.tokenizer.kind=char", f"runs_dir={runs}",
            "tracking.enabled=false", f"train.max_steps={steps}", f"train.eval_interval={steps}",
            "train.eval_batches=1", "train.log_interval=1", "checkpoint.interval=1000000", "checkpoint.resume=none",
            "optim.warmup_steps=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: Case, data_dir: str, workdir: str, steps: int) -> dict:
    """Trains the case in subprocesses -> {"ranks": [per-rank peaks], "estimate": bytes, "seconds": s}."""
    out = tempfile.mkdtemp(dir=workdir)
    args = ["--config", str(REPO / case.config), f"name=m{time.monotonic_ns()}",
            *_common(data_dir, os.path.join(workdir, "runs"), steps), *case.overrides]
    env = {**os.environ, OUT_ENV: out,
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    if case.ranks == 1:
        cmd = [sys.executable, __file__, *args]
    else:
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(case.ranks),
               "--master_port", str(_free_port()), __file__, *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    if len(ranks) != case.ranks:
        raise RuntimeError(f"{case.name}: {len(ranks)} of {case.ranks} ranks reported their peak")
    estimate = case_estimate(case, data_dir, steps, "cuda" if torch.cuda.is_available() else "cpu")
    return {"ranks": ranks, "estimate": estimate, "seconds": seconds}


def case_estimate(case: Case, data_dir: str, steps: int, device: str) -> dict:
    cfg = load_config(str(REPO / case.config), [*_common(data_dir, "runs", steps), *case.overrides])
    return estimate_for_config(cfg, dp=case.ranks, device=device, local_ranks=case.ranks).as_dict()


def reestimate(path: str) -> list[tuple[Case, dict]]:
    """A --json file's cases with their measured peaks and the current model's estimate."""
    known = {c.name: c for c in cases(False, True)}
    with open(path) as f:
        saved = json.load(f)
    device = "cuda" if "cuda_allocated" in saved[0]["ranks"][0] else "cpu"
    return [(known[r["case"]], {**r, "estimate": case_estimate(known[r["case"]], "unused", 2, device)})
            for r in saved]


def _peak(status: str, key: str) -> int:
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(argv: list[str]) -> int:
    """One training rank: the launcher's main, then this process's peaks into $MEGAROUTE_MEMORY_OUT."""
    code = pretrain_main(argv)
    with open("/proc/self/status") as f:
        status = f.read()
    peaks = {"rank": int(os.environ.get("RANK", "0")), "vm_hwm": _peak(status, "VmHWM")}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peaks["cuda_allocated"] = torch.cuda.max_memory_allocated()
        peaks["cuda_reserved"] = torch.cuda.max_memory_reserved()
    with open(os.path.join(os.environ[OUT_ENV], f"rank{peaks['rank']:04d}.json"), "w") as f:
        json.dump(peaks, f)
    return code


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def table(results: list[tuple[Case, dict]], cuda: bool) -> str:
    """CPU: peak RSS against the whole estimate. CUDA: max_memory_allocated (and reserved) against the
    estimate without its framework term (the CUDA context is outside torch's allocator)."""
    key = "cuda_allocated" if cuda else "vm_hwm"
    label = "max allocated GiB" if cuda else "peak RSS (VmHWM) GiB"
    lines = [f"{'case':<28}{'ranks':>6}{label:>22}" + (f"{'reserved GiB':>14}" if cuda else "")
             + f"{'estimate GiB':>14}{'est/meas':>10}  peak phase", "-" * (96 + 14 * cuda)]
    for case, r in results:
        measured = max(rank[key] for rank in r["ranks"])
        est = r["estimate"]["total_bytes"] - (r["estimate"]["framework_bytes"] if cuda else 0)
        reserved = f"{_gib(max(rank['cuda_reserved'] for rank in r['ranks'])):>14}" if cuda else ""
        lines.append(f"{case.name:<28}{case.ranks:>6}{_gib(measured):>22}{reserved}{_gib(est):>14}"
                     f"{est / measured:>10.3f}  {r['estimate']['peak_phase']}")
    return "\n".join(lines)


def _prepare(data_dir: str) -> None:
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [f"data.output_dir={data_dir}"])
    prepare(cfg.data, progress=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="three cases (tiny dense, tiny MoD, small ZeRO-2 x 2)")
    p.add_argument("--steps", type=positive_int, default=2, help="optimizer steps per case (one evaluation after them)")
    p.add_argument("--no-157m", action="store_true", help="skip dense_157m (needs ~8 GiB of RAM and minutes)")
    p.add_argument("--only", help="run the cases whose name contains this text")
    p.add_argument("--json", help="also write the per-rank results here")
    p.add_argument("--reestimate", metavar="JSON",
                   help="no training: the table of a --json file's measured peaks beside the current estimate")
    args = p.parse_args(argv)
    if args.reestimate:
        try:
            rows = reestimate(args.reestimate)
        except (OSError, ValueError, LookupError, TypeError) as e:  # missing, a directory, not --json's format
            p.error(f"--reestimate {args.reestimate}: not a results file written by --json ({type(e).__name__}: {e})")
        print(table(rows, torch.cuda.is_available()))
        return 0
    if args.json:  # found now, not after the runs
        problem = "is a directory" if os.path.isdir(args.json) else dir_problem(os.path.dirname(args.json) or ".")
        if problem:
            p.error(f"--json {args.json}: {problem}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    available = cases(args.quick, not args.no_157m)
    todo = [c for c in available if not args.only or args.only in c.name]
    if not todo:
        p.error(f"--only {args.only!r}: no case's name contains it (cases: {', '.join(c.name for c in available)})")
    results = []
    with tempfile.TemporaryDirectory(prefix="megaroute-mem-") as work:
        data_dir = os.path.join(work, "char")
        _prepare(data_dir)
        for case in todo:
            r = run_case(case, data_dir, work, args.steps)
            results.append((case, r))
            print(table([(case, r)], torch.cuda.is_available()).splitlines()[-1] + f"   ({r['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
    cuda = torch.cuda.is_available()
    print(table(results, cuda))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"case": c.name, "ranks": c.ranks, **r} for c, r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    if OUT_ENV in os.environ:  # a rank launched by run_case (deepspeed puts --local_rank first)
        sys.stdout.flush()
        code = worker(sys.argv[1:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as launcher/pretrain.py: no interpreter teardown after the process group
    sys.exit(main())
