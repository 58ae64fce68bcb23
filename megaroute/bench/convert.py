"""Conversion and sampling benchmark at the 157M size (random weights; CPU is fine).

    python -m megaroute.bench.convert [--dense configs/dense_157m.yaml] [--mod configs/mod_157m.yaml]
                                      [--new-tokens 64] [--workdir DIR]

1. Writes a checkpoint-shaped run directory for each config (random init, no training), converts it
   in a subprocess (launcher/convert_checkpoint.py) and reports wall time and the converter's peak RSS
   (the kernel's VmHWM of the converter process) against the bound 1.5x fp32 size + 1 GB.
2. Loads both converted models with AutoModelForCausalLM and times greedy generate() with the KV
   cache, batch 1: tokens/s of MoD vs dense, with the fraction of tokens MoD's causal router sent
   through its routed blocks (with random weights a router's sign is a coin flip: about 50%, not the
   trained capacity). "mod_calibrated" uses MoD's causal predictor with its output bias set so it
   passes the configured capacity (12.5%) of tokens, as a trained one does: the speed a trained
   MoD model samples at.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from ..config import load_config
from ..data.tokenizers import CharTokenizer
from ..hf.synthetic import write_checkpoint
from ..model import ForwardOptions, build_model
from ..model.routing import MoDLayer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM).

    Not ru_maxrss: Linux carries the forked parent's high-water mark across exec into it, so a
    converter started from a large process (a test session) would report the parent's size.
    """
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def make_run(config: str, workdir: str, tokenizer_path: str, tokenizer_hash: str,
             overrides: list[str] = ()) -> tuple[str, int]:
    cfg = load_config(config, ["checkpoint.dir=checkpoints", "model.dtype=float32", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.routing)
    calibrate_predictors(model, cfg.routing.capacity, cfg.model.vocab_size)
    n = sum(p.numel() for p in model.parameters())
    run = os.path.join(workdir, cfg.name)
    write_checkpoint(model, cfg, run, tokenizer_hash)
    return run, n


@torch.no_grad()
def calibrate_predictors(model, capacity: float, vocab: int, tokens: int = 512) -> None:
    """Shifts each MoD causal predictor's output bias so it passes `capacity` of the tokens of a
    random sequence, as a trained predictor does (random weights pass about half). Layer by layer:
    a layer's inputs depend on the decisions before it. A model without predictors is left as it is."""
    x = torch.randint(0, vocab, (1, min(tokens, model.cfg.max_seq_len)), generator=torch.Generator().manual_seed(1))
    for layer in model.layers:
        if not isinstance(layer, MoDLayer) or layer.predictor is None:
            continue
        seen = []
        handle = layer.predictor.register_forward_hook(lambda m, inp, out: seen.append(out.flatten()))
        model(x, options=ForwardOptions(mode="causal"))
        handle.remove()
        layer.predictor.net[-1].bias -= torch.quantile(seen[0].float(), 1 - capacity)


def convert_timed(run: str, out: str, tokenizer: str) -> tuple[float, int]:
    script = ("import sys; from megaroute.hf.convert import main; from megaroute.bench.convert import peak_rss_bytes; "
              "rc = main(sys.argv[1:]); print('PEAK', peak_rss_bytes()); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    # --format megaroute: dense runs through megaroute's own forward too, so MoD vs dense compares like with like.
    res = subprocess.run([sys.executable, "-c", script, run, out, "--tokenizer", tokenizer, "--no-progress",
                          "--format", "megaroute"],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"conversion of {run} failed:\n{res.stderr[-3000:]}")
    peak = int(next(line for line in res.stdout.splitlines() if line.startswith("PEAK")).split()[1])
    return wall, peak


@torch.no_grad()
def sampling_speed(out: str, prompt_len: int, new_tokens: int, repeats: int = 2) -> tuple[float, float | None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, max_new_tokens=4, do_sample=False)  # warm-up
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        seq = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        best = max(best, new_tokens / (time.perf_counter() - t0))
    stats = model.model(seq, options=ForwardOptions(mode="causal")).routing_stats
    fracs = [float(v) for k, v in stats.items() if k.endswith("/selected_frac")]
    return best, (sum(fracs) / len(fracs) if fracs else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", default=os.path.join(REPO, "configs/dense_157m.yaml"))
    p.add_argument("--mod", default=os.path.join(REPO, "configs/mod_157m.yaml"))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    work = args.workdir or tempfile.mkdtemp(prefix="megaroute-bench-convert-")
    tok = CharTokenizer(open(os.path.join(REPO, "data/tinyshakespeare.txt")).read())
    tok_path = os.path.join(work, "tokenizer.json")
    os.makedirs(work, exist_ok=True)
    with open(tok_path, "wb") as f:
        f.write(tok.to_bytes())
    print(f"torch threads: {torch.get_num_threads()}; workdir {work}")
    rows = []
    for label, config, overrides in (("dense", args.dense, []), ("mod", args.mod, []),
                                     ("mod_calibrated", args.mod, ["routing.causal_method=predictor",
                                                                   "name=mod_157m_predictor"])):
        run, n = make_run(config, work, tok_path, tok.hash, overrides)
        out = os.path.join(work, f"hf_{label}")
        wall, peak = convert_timed(run, out, tok_path)
        fp32 = 4 * n
        bound = 1.5 * fp32 + 2**30
        print(f"{label:14s} {n / 1e6:7.1f}M params ({fp32 / 2**20:.0f} MiB fp32): convert {wall:5.1f} s, "
              f"peak RSS {peak / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB, {'ok' if peak <= bound else 'OVER'})",
              flush=True)
        rows.append((label, out))
    speeds = {}
    for label, out in rows:
        tps, frac = sampling_speed(out, args.prompt_len, args.new_tokens)
        speeds[label] = tps
        extra = f", routed blocks ran {100 * frac:.0f}% of tokens" if frac is not None else ""
        print(f"{label:14s} greedy generate (KV cache, batch 1, {args.prompt_len}+{args.new_tokens} tokens): "
              f"{tps:6.1f} tokens/s{extra}", flush=True)
    for label in ("mod", "mod_calibrated"):
        print(f"{label} / dense sampling speed: {speeds[label] / speeds['dense']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
