"""Sampling speed of a converted MoD model against dense of the same shape, and conversion cost.

    python -m megaroute.bench.convert [--shape char|157m] [--steps N] [--new-tokens 64] [--threads 1]
                                      [--dense CONFIG --mod CONFIG] [--workdir DIR]

1. Prepares the bundled corpus with the character tokenizer in the workdir (character-level Tiny
   Shakespeare, ids below every config's vocabulary; the 90/10 train/val split of `data prepare`) and
   trains a dense and a MoD model of the same shape (--shape char: configs/experiments/char_dense.yaml
   and char_mod.yaml, 6 blocks of d 128; --shape 157m: configs/dense_157m.yaml and mod_157m.yaml) on it
   for --steps steps through launcher/pretrain.py (the real DeepSpeed engine and trainer: the
   launcher's optimizer, warm-up over a tenth of the steps then cosine decay, fp32, one CPU rank;
   same seed, so same data order for both). Default: 200 steps for char, 0 for 157m (too slow on a
   CPU: the 157m figures are of UNTRAINED weights, which the output says; those are written as a
   checkpoint directly).
2. The trainer's final evaluation calibrates MoD's causal decider on CALIBRATION_BATCHES batches of
   training text (each routed layer's threshold passes the capacity's fraction, 12.5%, of tokens) and
   reports eval/loss: the causal validation loss (as many held-out batches). Untrained: the same
   calibration and loss, in process.
3. Converts each run's checkpoint in a subprocess (launcher/convert_checkpoint.py code, --format
   megaroute for both, so dense runs through the same remote code as MoD) and reports the wall time
   and the converter's peak RSS (VmHWM) against the bound 1.5x fp32 size + 1 GB.
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

from ..argtypes import non_negative_int, positive_int
from ..config import ConfigError, load_config
from ..data.loader import PackedDataset, SequenceLoader
from ..data.prepare import prepare
from ..data.tokenizers import load_tokenizer
from ..hf.synthetic import write_checkpoint
from ..model import ForwardOptions, build_model
from ..model.routing import calibrate_thresholds
from ..model.routing.calibration import QuantileCut
from ..paths import dir_problem
from .launch import REPO, last_records, run_launcher

CHAR_DATA = os.path.join(REPO, "configs/data/tinyshakespeare_char.yaml")   # how the corpus is prepared
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


def batches(data_dir: str, split: str, n: int, batch: int, seq_len: int, vocab_size: int,
            seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n micro-batches (inputs, next-token targets) [batch, seq_len] of a prepared split, in the loader's order."""
    loader = iter(SequenceLoader(PackedDataset(data_dir, split, seq_len=seq_len, vocab_size=vocab_size),
                                 batch, batch, 0, 1, seed=seed))
    return [next(loader) for _ in range(n)]


def prepare_char_data(out_dir: str) -> str:
    """The bundled corpus prepared with the character tokenizer into out_dir (seconds) -> out_dir."""
    cfg = load_config(CHAR_DATA, [f"data.output_dir={out_dir}"])
    prepare(cfg.data, progress=False)
    return out_dir


@torch.no_grad()
def causal_loss(model, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return statistics.mean(float(model(x, y, options=ForwardOptions(mode="causal")).lm_loss) for x, y in data)


def launcher_overrides(label: str, args, workdir: str, data_dir: str, seq_len: int) -> list[str]:
    """One training run through the launcher on the prepared character data, evaluated (calibration +
    causal loss) and checkpointed at its last step."""
    steps = args.steps
    return [f"runs_dir={workdir}", f"name=bench_{label}", f"data.output_dir={data_dir}", "data.tokenizer.kind=char",
            f"data.seq_len={seq_len}", "train.precision=fp32", "model.dtype=float32",
            f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
            f"train.max_steps={steps}", "train.max_tokens=null", "train.max_flops=null", "train.seed=0",
            f"optim.warmup_steps={max(1, steps // 10)}", f"train.eval_interval={steps}",
            f"train.eval_batches={CALIBRATION_BATCHES}", f"train.log_interval={steps}",
            f"checkpoint.interval={steps}", "checkpoint.dir=checkpoints", "checkpoint.resume=none",
            "tracking.enabled=false"]


def make_run(label: str, config: str, args, workdir: str, data_dir: str, tokenizer_hash: str
             ) -> tuple[str, int, str]:
    """Trains (launcher) or builds (--steps 0) one model, calibrated; returns (run dir, parameters, summary)."""
    cfg = load_config(config, ["checkpoint.dir=checkpoints", "model.dtype=float32", f"name=bench_{label}"])
    seq_len = min(args.seq_len, cfg.model.max_seq_len)
    run = os.path.join(workdir, cfg.name)
    meta = build_model(cfg.model, cfg.routing, device="meta")
    n = meta.num_params()
    has_cut = any(isinstance(m, QuantileCut) for m in meta.modules())
    calibrated = (f"causal thresholds calibrated on {CALIBRATION_BATCHES}x{args.batch} windows of real text; "
                  if has_cut else "")
    if args.steps:
        t0 = time.perf_counter()
        run_launcher(config, launcher_overrides(label, args, workdir, data_dir, seq_len),
                     os.path.join(workdir, f"{cfg.name}.log"), args.threads, f"training {label} ({config})")
        last = last_records(run)
        summary = (f"trained {args.steps} steps through the launcher (batch {args.batch}x{seq_len}) in "
                   f"{time.perf_counter() - t0:.0f} s, train loss at the last step {last['train']['train/loss']:.3f}; "
                   f"{calibrated}causal val loss (eval/loss, {CALIBRATION_BATCHES} batches) "
                   f"{last['eval']['eval/loss']:.3f}")
        return run, n, summary
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.routing).eval()
    vocab = cfg.model.vocab_size
    with torch.no_grad():
        calibrate_thresholds(model, lambda x: model(x, options=ForwardOptions(mode="causal", calibrate=True)),
                             [x for x, _ in batches(data_dir, "train", CALIBRATION_BATCHES, args.batch, seq_len,
                                                    vocab, seed=0)])
    val = causal_loss(model, batches(data_dir, "val", CALIBRATION_BATCHES, args.batch, seq_len, vocab, seed=0))
    write_checkpoint(model, cfg, run, tokenizer_hash, step=0)
    return run, n, f"UNTRAINED (random init); {calibrated}causal val loss {val:.3f}"


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
    p.add_argument("--steps", type=non_negative_int, help="training steps of each model (default: 200 for char, 0 for 157m)")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1: a loaded machine)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    dense_cfg, mod_cfg, steps = SHAPES[args.shape]
    args.dense = args.dense or os.path.join(REPO, dense_cfg)
    args.mod = args.mod or os.path.join(REPO, mod_cfg)
    args.steps = steps if args.steps is None else args.steps
    for flag, config in (("--dense", args.dense), ("--mod", args.mod)):  # both, before the first one trains
        try:
            load_config(config, ["model.dtype=float32"])
        except ConfigError as e:
            p.error(f"{flag}: {e}")
    problem = args.workdir and dir_problem(args.workdir)
    if problem:
        p.error(f"--workdir: {problem}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    work = args.workdir or tempfile.mkdtemp(prefix="megaroute-bench-convert-")
    os.makedirs(work, exist_ok=True)
    data_dir = prepare_char_data(os.path.join(work, "char"))
    tok = load_tokenizer(data_dir)
    tok_path = data_dir   # the converter takes the prepared data dir as the tokenizer
    print(f"shape {args.shape}; torch {torch.get_num_threads()} thread(s); fp32; workdir {work}", flush=True)
    outs = {}
    for label, config in (("dense", args.dense), ("mod", args.mod)):
        run, n, summary = make_run(label, config, args, work, data_dir, tok.hash)
        out = os.path.join(work, f"hf_{label}")
        wall, peak = convert_timed(run, out, tok_path)
        fp32 = 4 * n
        bound = 1.5 * fp32 + 2**30
        print(f"{label:6s} {n / 1e6:7.1f}M params: {summary}", flush=True)
        print(f"{label:6s} convert {wall:5.1f} s, peak RSS {peak / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB, "
              f"{'ok' if peak <= bound else 'OVER'})", flush=True)
        outs[label] = out
    # Held-out text: a window of the validation split (character ids, below any model's vocabulary).
    prompt = batches(data_dir, "val", 1, 1, args.prompt_len, tok.vocab_size, seed=0)[0][0]
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
