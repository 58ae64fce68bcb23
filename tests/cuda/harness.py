"""The CUDA smoke suite's launcher harness: the case matrix, the one-GPU launch command and the
checks every run must pass. Plain functions, importable on a CPU-only machine, so
tests/cuda/test_harness.py can check them there without a device.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..integration.conftest import BIN, FAST, REPO, Job, free_port, read_metrics

# Each case: steps 1-2, evaluation and checkpoint at 2, exit_interval stops the first job there
# (exit 75, "requeue me"); the second job resumes from step 2 and finishes step 3 (eval + save).
MAX_STEPS, STOP_AT = 3, 2
EXIT_OK, EXIT_REQUEUE = 0, 75  # megaroute.train.signals
# The same overrides for both jobs (an unchanged config hash), after the case's own.
SCHEDULE = (f"train.max_steps={MAX_STEPS}", f"train.exit_interval={STOP_AT}", f"train.eval_interval={STOP_AT}",
            f"checkpoint.interval={STOP_AT}", "checkpoint.resume=auto")

METHODS = {  # name -> overrides on configs/tiny.yaml (+ FAST: 2 layers, block 1 routed)
    "dense": (),
    "mod": ("routing.method=mod", "routing.capacity=0.25"),
    "depth_gate_mlp": ("routing.method=depth_gate", "routing.depth_gate.gate=mlp"),
    "depth_gate_jepa": ("routing.method=depth_gate", "routing.depth_gate.gate=jepa",
                        "routing.depth_gate.utility_weight=1.0", "routing.depth_gate.rank_weight=1.0"),
    "halting": ("routing.method=halting", "routing.halting.penalty=0.01"),
    "early_exit": ("routing.method=early_exit",),
}
# Evaluation keys each method must log (megaroute.model.routing.context.eval_modes).
EVAL_KEYS = {"dense": ("eval/loss",), "halting": ("eval/loss", "val/loss_soft")}


@dataclass(frozen=True)
class Case:
    method: str
    precision: str = "bf16"  # bf16: the A100/H100 path; fp16: the V100 path (dynamic loss scaling)
    zero: int = 1
    act_ckpt: bool = False

    @property
    def id(self) -> str:
        return f"{self.method}-{self.precision}-z{self.zero}" + ("-ckpt" if self.act_ckpt else "")

    def overrides(self) -> list[str]:
        return [*METHODS[self.method], f"train.precision={self.precision}", f"optim.zero_stage={self.zero}",
                f"parallel.activation_checkpointing={str(self.act_ckpt).lower()}"]

    def eval_keys(self) -> tuple[str, ...]:
        return EVAL_KEYS.get(self.method, ("eval/loss", "val/loss_topk"))


# Every method once (bf16, ZeRO-1); precision x ZeRO stage on dense and MoD; activation
# checkpointing at each ZeRO stage (fp16 included); fp16 on the routed layers whose
# gates/scores could overflow first.
CASES: list[Case] = [
    *(Case(m) for m in METHODS),
    *(Case(m, p, z) for m in ("dense", "mod") for p in ("bf16", "fp16") for z in (1, 2, 3)
      if (p, z) != ("bf16", 1)),
    Case("dense", "bf16", 1, act_ckpt=True),
    Case("mod", "bf16", 3, act_ckpt=True),
    Case("depth_gate_mlp", "fp16", 2, act_ckpt=True),
    Case("depth_gate_jepa", "fp16", 1),
    Case("halting", "fp16", 2),
    Case("early_exit", "fp16", 1),
]


def run_args(workdir: Path, data_dir: str, name: str, *overrides: str, config: str = "configs/tiny.yaml") -> list[str]:
    """pretrain.py's arguments: the integration tests' FAST tiny model, this case's overrides last."""
    runs = workdir / "runs"
    return ["--config", str(REPO / config), f"name={name}", f"runs_dir={runs}", f"data.output_dir={data_dir}",
            "tracking.enabled=false", *FAST, *overrides]


def gpu_launch_command(script: str, args: list[str], environ: Optional[dict] = None) -> tuple[list[str], dict]:
    """`deepspeed` on one GPU: -> (argv, env).

    With CUDA_VISIBLE_DEVICES=3,5 the job runs on GPU 3 (`--include localhost:3`: the deepspeed
    launcher would otherwise use every visible device); without it (or with device UUIDs, which
    --include cannot name), `--num_gpus 1`: GPU 0. DS_ACCELERATOR and TRITON_INTERPRET are removed:
    a CPU accelerator or interpreted kernels inherited from a CPU test session would defeat the point.
    """
    env = dict(os.environ if environ is None else environ)
    for key in ("DS_ACCELERATOR", "TRITON_INTERPRET"):
        env.pop(key, None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "4")})
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and visible[0].isdigit():
        select = ["--include", f"localhost:{visible[0]}"]
        env.pop("CUDA_VISIBLE_DEVICES")  # the launcher sets it for the rank from --include
    else:
        select = ["--num_gpus", "1"]
    return [str(BIN / "deepspeed"), *select, "--master_port", str(free_port()), script, *args], env


def start_gpu_job(workdir: Path, data_dir: str, name: str, *overrides: str,
                  config: str = "configs/tiny.yaml") -> Job:
    cmd, env = gpu_launch_command(str(REPO / "launcher/pretrain.py"),
                                  run_args(workdir, data_dir, name, *overrides, config=config))
    workdir.mkdir(parents=True, exist_ok=True)
    return Job(cmd, env, workdir / f"{name}-{time.monotonic_ns()}.log")


def peak_override() -> list[str]:
    """train.peak_flops for a GPU megaroute.flops does not know (pretrain refuses to guess its MFU)."""
    import torch

    from megaroute.flops import peak_flops

    try:
        peak_flops(torch.cuda.get_device_name())
        return []
    except ValueError:
        return ["train.peak_flops=1e14"]


def storage_locations(path: Path) -> set[str]:
    """Devices the tensors in a torch.save file were saved from ('cuda:0', 'cpu'), read without
    putting anything on a device."""
    import torch

    seen: set[str] = set()

    def keep(storage, location):
        seen.add(location)
        return storage

    torch.load(path, map_location=keep, weights_only=False)
    return seen


def check_first_job(run_dir: Path, case: Case, output: str) -> None:
    """After the first job: steps 1-2 logged, an evaluation at 2, committed checkpoint step 2,
    the engine configured as the case says, and the state saved from a CUDA device."""
    train = read_metrics(run_dir)
    assert sorted(train) == list(range(1, STOP_AT + 1)), output[-3000:]
    _check_finite(train, "train/loss")
    evals = read_metrics(run_dir, "eval")
    assert STOP_AT in evals, f"no evaluation at step {STOP_AT}"
    for key in case.eval_keys():
        assert key in evals[STOP_AT] and math.isfinite(evals[STOP_AT][key]), (key, evals[STOP_AT])
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{STOP_AT:08d}"
    assert (ckpts / f"step_{STOP_AT:08d}" / "manifest.json").is_file()
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == case.zero
    if case.precision == "fp16":
        assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0, ds  # dynamic loss scaling
    else:
        assert ds["bf16"]["enabled"] and "fp16" not in ds, ds
    tag = ckpts / f"step_{STOP_AT:08d}"
    locations = set().union(*(storage_locations(p) for p in tag.glob("*_states.pt")))
    assert any(loc.startswith("cuda") for loc in locations), f"checkpoint tensors saved from {locations}, not a GPU"


def check_resumed_job(run_dir: Path, case: Case, output: str) -> None:
    """After the second job: it resumed at step 2, ran to MAX_STEPS, evaluated and saved there."""
    assert "resumed from" in output and f"at step {STOP_AT}" in output, output[-3000:]
    train = read_metrics(run_dir)
    assert sorted(train) == list(range(1, MAX_STEPS + 1))
    _check_finite(train, "train/loss")
    evals = read_metrics(run_dir, "eval")
    assert MAX_STEPS in evals
    for key in case.eval_keys():
        assert math.isfinite(evals[MAX_STEPS][key]), (key, evals[MAX_STEPS])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{MAX_STEPS:08d}"
    if case.precision == "bf16":  # fp16 may skip its first steps while the loss scale comes down
        assert train[MAX_STEPS]["train/skipped_steps"] == 0


def _check_finite(metrics: dict[int, dict], key: str) -> None:
    bad = {s: m[key] for s, m in metrics.items() if not math.isfinite(m[key])}
    assert not bad, f"non-finite {key}: {bad}"
