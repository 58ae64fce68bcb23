"""Sampling speed of a converted MoD model against dense of the same shape, and conversion cost.

    python -m megaroute.bench.convert [--shape char|157m] [--steps N] [--new-tokens 64] [--threads 1]
                                      [--dense CONFIG --mod CONFIG] [--workdir DIR]

1. Builds a dense and a MoD model of the same shape (--shape char: configs/experiments/char_dense.yaml
   and char_mod.yaml, 6 blocks of d 128; --shape 157m: configs/dense_157m.yaml and mod_157m.yaml) and
   trains both for --steps AdamW steps on the bundled corpus (character-level Tiny Shakespeare, 90% of
   it; same batches for both, top-k routing as in training). Default: 200 steps for char, 0 for 157m
   (too slow on a CPU: the 157m figures are of UNTRAINED weights, which the output says).
2. Calibrates MoD's causal decider on real text (calibration.calibrate_thresholds over batches of the
   training text): each routed layer's threshold passes the capacity's fraction (12.5%) of tokens, as
   evaluation does after training. Reports each model's causal validation loss (the held-out 10%).
3. Writes each as a checkpoint, converts it in a subprocess (launcher/convert_checkpoint.py code,
   --format megaroute for both, so dense runs through the same remote code as MoD) and reports the
   wall time and the converter's peak RSS (VmHWM) against the bound 1.5x fp32 size + 1 GB.
4. Loads both exports with AutoModelForCausalLM (trust_remote_code) and times greedy generate() with
   the KV cache, batch 1, a prompt of held-out text, dense and MoD interleaved (--repeats rounds,
   median per model): tokens/s of each, MoD / dense, and the executed fraction beside it: the share of
   the generated tokens MoD's routed blocks ran (causal decisions recorded on the generated sequence,
   mean over routed blocks). On CPU, and on CUDA too when a GPU is available.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ..config import load_config
from ..data.tokenizers import CharTokenizer
from ..hf.synthetic import write_checkpoint
from ..model import ForwardOptions, build_model
from ..model.routing import calibrate_thresholds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "data/tinyshakespeare.txt")
SHAPES = {  # name: (dense config, MoD config, default training steps)
    "char": ("configs/experiments/char_dense.yaml", "configs/experiments/char_mod.yaml", 200),
    "157m": ("configs/dense_157m.yaml", "configs/mod_157m.yaml", 0),
}
CALIBRATION_BATCHES = 8


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM).

    Not ru_maxrss: Linux carries the forked parent's high-water mark across exec into it, so a
    converter started from a large process (a test session) would report the parent's size.
    """
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def batches(tokens: torch.Tensor, n: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """n random windows [batch, seq_len + 1] of `tokens` (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (n, batch), generator=g)
    return [torch.stack([tokens[s:s + seq_len + 1] for s in row.tolist()]) for row in starts]


def train(model, cfg, data: list[torch.Tensor]) -> float:
    """AdamW (the config's lr, betas, weight decay, clipping; linear warm-up over a tenth of the steps)
    in top-k routing mode, as training runs it. Returns the mean loss of the last 10 steps."""
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    warmup = max(1, len(data) // 10)
    losses = []
    model.train()
    for step, batch in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = o.lr * min(1.0, (step + 1) / warmup)
        out = model(batch[:, :-1], batch[:, 1:], options=ForwardOptions(mode="topk"))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.lm_loss.detach()))
    model.eval()
    return statistics.mean(losses[-10:]) if losses else float("nan")


@torch.no_grad()
def causal_loss(model, data: list[torch.Tensor]) -> float:
    return statistics.mean(float(model(b[:, :-1], b[:, 1:], options=ForwardOptions(mode="causal")).lm_loss)
                           for b in data)


def make_run(label: str, config: str, args, workdir: str, tok: CharTokenizer, text: torch.Tensor,
             tokenizer_hash: str) -> tuple[str, int, str]:
    """Builds, trains, calibrates and checkpoints one model; returns (run dir, parameters, summary)."""
    cfg = load_config(config, ["checkpoint.dir=checkpoints", "model.dtype=float32", f"name=bench_{label}"])
    seq_len = min(args.seq_len, cfg.model.max_seq_len)
    split = int(0.9 * len(text))
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.routing)
    t0 = time.perf_counter()
    train_loss = train(model, cfg, batches(text[:split], args.steps, args.batch, seq_len, seed=1))
    trained = (f"trained {args.steps} steps (batch {args.batch}x{seq_len}) in {time.perf_counter() - t0:.0f} s, "
               f"last train loss {train_loss:.3f}" if args.steps else "UNTRAINED (random init)")
    calibration = batches(text[:split], CALIBRATION_BATCHES, args.batch, seq_len, seed=2)
    calibrated = calibrate_thresholds(model, lambda b: model(b[:, :-1], options=ForwardOptions(
        mode="causal", calibrate=True)), calibration)
    val = causal_loss(model, batches(text[split:], 4, args.batch, seq_len, seed=3))
    summary = (f"{trained}; " + (f"causal thresholds calibrated on {CALIBRATION_BATCHES}x{args.batch} windows of "
                                 "real text; " if calibrated else "") + f"causal val loss {val:.3f}")
    n = sum(p.numel() for p in model.parameters())
    run = os.path.join(workdir, cfg.name)
    write_checkpoint(model, cfg, run, tokenizer_hash, step=args.steps)
    return run, n, summary


def convert_timed(run: str, out: str, tokenizer: str) -> tuple[float, int]:
    script = ("import sys; from megaroute.hf.convert import main; from megaroute.bench.convert import peak_rss_bytes; "
              "rc = main(sys.argv[1:]); print('PEAK', peak_rss_bytes()); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    # --format megaroute: dense runs through the same remote code as MoD, so the comparison is like with like.
    res = subprocess.run([sys.executable, "-c", script, run, out, "--tokenizer", tokenizer, "--no-progress",
                          "--format", "megaroute", "--force"],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"conversion of {run} failed:\n{res.stderr[-3000:]}")
    peak = int(next(line for line in res.stdout.splitlines() if line.startswith("PEAK")).split()[1])
    return wall, peak


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def sampling_speed(outs: dict[str, str], prompt: torch.Tensor, new_tokens: int, repeats: int,
                   device: str) -> dict[str, tuple[float, float | None, str]]:
    """label -> (median tokens/s, executed fraction of the generated tokens or None, text), interleaved."""
    from transformers import AutoModelForCausalLM

    models = {label: AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
              .to(device).eval() for label, out in outs.items()}
    prompt = prompt.to(device)
    times: dict[str, list[float]] = {label: [] for label in models}
    seqs = {}
    for label, model in models.items():  # warm-up
        model.generate(prompt, max_new_tokens=4, do_sample=False)
    for _ in range(repeats):
        for label, model in models.items():
            _sync(device)
            t0 = time.perf_counter()
            seqs[label] = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            _sync(device)
            times[label].append(time.perf_counter() - t0)
    out = {}
    for label, model in models.items():
        seq = seqs[label]
        decisions = model.model(seq, options=ForwardOptions(mode="causal", record_decisions=True)).decisions
        gen = [d[:, prompt.shape[1]:].float().mean().item() for d in decisions.values()]
        out[label] = (new_tokens / statistics.median(times[label]), statistics.mean(gen) if gen else None,
                      seq[0, prompt.shape[1]:].tolist())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="char")
    p.add_argument("--dense", help="dense config (default: the shape's)")
    p.add_argument("--mod", help="MoD config of the same shape (default: the shape's)")
    p.add_argument("--steps", type=int, help="training steps of each model (default: 200 for char, 0 for 157m)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a loaded machine)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    dense_cfg, mod_cfg, steps = SHAPES[args.shape]
    args.dense = args.dense or os.path.join(REPO, dense_cfg)
    args.mod = args.mod or os.path.join(REPO, mod_cfg)
    args.steps = steps if args.steps is None else args.steps
    for name in ("batch", "seq_len", "prompt_len", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps < 0:
        p.error("--steps must be >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    work = args.workdir or tempfile.mkdtemp(prefix="megaroute-bench-convert-")
    os.makedirs(work, exist_ok=True)
    with open(CORPUS) as f:
        corpus = f.read()
    tok = CharTokenizer(corpus)
    tok_path = os.path.join(work, "tokenizer.json")
    with open(tok_path, "wb") as f:
        f.write(tok.to_bytes())
    text = torch.tensor(tok.encode(corpus))
    print(f"shape {args.shape}; torch {torch.get_num_threads()} thread(s); fp32; workdir {work}", flush=True)
    outs = {}
    for label, config in (("dense", args.dense), ("mod", args.mod)):
        run, n, summary = make_run(label, config, args, work, tok, text, tok.hash)
        out = os.path.join(work, f"hf_{label}")
        wall, peak = convert_timed(run, out, tok_path)
        fp32 = 4 * n
        bound = 1.5 * fp32 + 2**30
        print(f"{label:6s} {n / 1e6:7.1f}M params: {summary}", flush=True)
        print(f"{label:6s} convert {wall:5.1f} s, peak RSS {peak / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB, "
              f"{'ok' if peak <= bound else 'OVER'})", flush=True)
        outs[label] = out
    split = int(0.9 * len(text))
    prompt = text[split:split + args.prompt_len].unsqueeze(0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        res = sampling_speed(outs, prompt, args.new_tokens, args.repeats, device)
        for label, (tps, frac, _) in res.items():
            extra = (f"; MoD's routed blocks ran {100 * frac:.1f}% of the generated tokens" if frac is not None else "")
            print(f"{label:6s} {device}: greedy generate (KV cache, batch 1, {args.prompt_len}+{args.new_tokens} "
                  f"tokens, median of {args.repeats}): {tps:7.1f} tokens/s{extra}", flush=True)
        frac = res["mod"][1]
        print(f"{device}: MoD / dense sampling speed {res['mod'][0] / res['dense'][0]:.2f}x at executed fraction "
              f"{100 * frac:.1f}% ({'trained' if args.steps else 'UNTRAINED'} weights)", flush=True)
        if args.steps:  # an untrained model's tokens are mostly ids above the characters
            print(f"{device}: MoD sample: {tok.decode([t for t in res['mod'][2] if t < tok.vocab_size])!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
