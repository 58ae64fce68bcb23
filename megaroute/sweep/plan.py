"""Expands a sweep spec into points: one training run per (budget, size, variant, seed).

Array index i is the i-th point in budget -> size -> variant -> seed order, so the order is a
function of the spec alone and every array task resolves the same point on any node.

Each point trains for a whole number of optimizer steps: steps = round(C / (F * B)) with F the
training FLOPs per token (megaroute.flops, routing-aware) and B tokens per step. Rounding misses
the budget by at most half a step; the plan refuses points where that exceeds the spec's
tolerance (1%) rather than silently comparing runs of unequal compute.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from ..config import Config, load_config
from ..flops import flops_per_token, peak_flops
from ..model import build_model
from .spec import SweepSpec, SweepSpecError

# Tags every sweep run carries; `sweep analyze` groups by them.
TAG_SWEEP, TAG_ROLE, ROLE_PARENT = "sweep_id", "sweep_role", "parent"


@dataclass(frozen=True)
class Point:
    index: int
    variant: str
    size: str
    budget: float
    seed: int
    run_name: str
    config_path: str
    overrides: tuple[str, ...]   # everything launcher/pretrain.py needs after --config
    n_params: int
    flops_per_token: float
    tokens_per_step: int
    steps: int
    gpu_hours: float

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def flops(self) -> float:
        return self.tokens * self.flops_per_token

    @property
    def budget_error(self) -> float:
        return self.flops / self.budget - 1.0

    def launcher_args(self) -> list[str]:
        return ["--config", self.config_path, *self.overrides]


def budget_label(budget: float) -> str:
    """3e+19 -> "3e19": short, unique to 3 significant digits, safe in run names."""
    return f"{budget:.3g}".replace("+", "")


def point_tags(spec: SweepSpec, variant: str, size: str, budget: float, seed: int, index: int, n_params: int):
    return {TAG_SWEEP: spec.name, "budget": f"{budget:.6g}", "size": size, "variant": variant, "seed": str(seed),
            "sweep_index": str(index), "n_params": str(n_params)}


def _tag_overrides(tags: dict[str, str]) -> list[str]:
    # Quoted so YAML keeps "1e+19" and "0" as strings (tags are typed dict[str, str]).
    return [f'tracking.tags.{k}="{v}"' for k, v in tags.items()]


def _count_params(cfg: Config) -> int:
    return build_model(cfg.model, cfg.routing, device="meta").num_params()


def plan(spec: SweepSpec, extra_overrides: tuple[str, ...] = (), parent_run_id: str | None = None) -> list[Point]:
    """All points of the sweep; raises SweepSpecError naming the first point that cannot meet its budget."""
    peak = peak_flops(spec.gpu)
    cache: dict[tuple[str, str], tuple[Config, int, float]] = {}
    points = []
    for budget in spec.budgets:
        for size, size_overrides in spec.sizes.items():
            for variant in spec.variants:
                for seed in spec.seeds:
                    index = len(points)
                    name = f"{spec.name}-{variant.name}-{size}-C{budget_label(budget)}-s{seed}"
                    common = [*size_overrides, *variant.overrides, *spec.overrides, *extra_overrides]
                    key = (variant.name, size)
                    if key not in cache:  # the model does not depend on budget or seed
                        cfg = load_config(variant.config_path(size), common)
                        fpt = flops_per_token(cfg.model, cfg.routing, cfg.data.seq_len, training=True)
                        cache[key] = (cfg, _count_params(cfg), fpt)
                    cfg, n_params, fpt = cache[key]
                    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
                    steps = round(budget / (fpt * tokens_per_step))
                    where = f"{name} (index {index})"
                    if steps < 1:
                        raise SweepSpecError(spec.path, "budgets", f"{where}: budget {budget:.3g} is less than one "
                                             f"optimizer step ({fpt * tokens_per_step:.3g} FLOPs)")
                    error = steps * tokens_per_step * fpt / budget - 1
                    if abs(error) > spec.budget_tolerance:
                        raise SweepSpecError(spec.path, "budgets", f"{where}: {steps} steps of {tokens_per_step} "
                                             f"tokens miss budget {budget:.3g} by {error:+.2%} (tolerance "
                                             f"{spec.budget_tolerance:.0%}); raise the budget or lower "
                                             f"train.global_batch_size")
                    tags = point_tags(spec, variant.name, size, budget, seed, index, n_params)
                    # runs_dir before the common overrides so a command-line runs_dir=... wins.
                    overrides = (f"runs_dir={spec.run_root}", *common, f"name={name}", f"variant={variant.name}",
                                 f"size={size}", f"train.seed={seed}", f"train.max_steps={steps}",
                                 "train.max_tokens=null", "train.max_flops=null",
                                 f"tracking.experiment={spec.experiment}", *_tag_overrides(tags),
                                 *([f"tracking.parent_run_id={parent_run_id}"] if parent_run_id else []))
                    # Fail here, on the login node, rather than in array task `index` hours later.
                    load_config(variant.config_path(size), overrides)
                    gpu_hours = steps * tokens_per_step * fpt / (peak * spec.mfu) / 3600
                    points.append(Point(index, variant.name, size, budget, seed, name,
                                        os.path.relpath(variant.config_path(size)), overrides, n_params, fpt,
                                        tokens_per_step, steps, gpu_hours))
    return points


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_table(points: list[Point]) -> str:
    head = ("idx", "variant", "size", "params", "budget", "tokens", "steps", "FLOPs/tok", "vs budget", "GPU-h", "run")
    rows = [(str(p.index), p.variant, p.size, _si(p.n_params), f"{p.budget:.3g}", _si(p.tokens), str(p.steps),
             _si(p.flops_per_token), f"{p.budget_error:+.2%}", f"{p.gpu_hours:.3g}", p.run_name) for p in points]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i not in (1, 2, 10) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in (head, *rows)]
    total = sum(p.gpu_hours for p in points)
    return "\n".join([*lines, f"{len(points)} points, {total:.3g} GPU-hours estimated"])


def pretrain_command(spec: SweepSpec, point: Point) -> str:
    """What array task `point.index` runs (slurm/isoflop_sweep.sh execs slurm/pretrain.sh)."""
    return shlex.join(["slurm/pretrain.sh", "--gpu", spec.gpu, *point.launcher_args()])
