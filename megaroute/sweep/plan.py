"""Expands a sweep spec into points: one training run per (budget, size, variant, seed, lr multiplier).

Array index i is the i-th point in budget -> size -> variant -> seed -> lr multiplier order, so the
order is a function of the spec alone and every array task resolves the same point on any node.
With `design:` "size" is the rank in each (budget, variant)'s grid (smallest first): the shapes
come from megaroute/sweep/design.py's rules and differ by budget and variant; with `sizes:` they
are the spec's, the same at every budget.

Each point trains for a whole number of optimizer steps: steps = round(C / (F * B)) with F the
training FLOPs per token (megaroute.flops, routing-aware) and B tokens per step. Rounding misses
the budget by at most half a step; the plan refuses points where that exceeds the spec's
tolerance (1%) rather than silently comparing runs of unequal compute. It also refuses, naming
the point and the reason, a point that ends inside its warm-up, trains on fewer than
`min_tokens_per_param` tokens per parameter, or (design) whose model misses its target size by
more than design.shape.tolerance; all before anything is submitted.

With `hold: active_params` (spec.py) the first variant is the reference: its points are planned as
above, and at each (budget, size) every other variant trains on the reference's tokens (steps =
tokens / its tokens per step) with the reference's shape, and is refused when its active parameters
are more than `active_tolerance` off the reference's; its FLOPs are whatever those tokens cost it
(the table's "vs budget"), not the budget.

Per point the plan sets (design.py documents the rules): the shape (model.d_model, n_layers,
n_heads) with `design:`, optim.lr and optim.min_lr with `lr:` (times the point's `lr_sweep`
multiplier), train.global_batch_size with `batch: compute`, optim.warmup_steps (and
optim.decay_fraction) with `schedule:`, and always train.max_steps.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Optional

from ..config import Config, load_config
from ..flops import flops_per_token, peak_flops
from ..model import build_model
from ..model.routing.moe import active_params
from .design import Grid, decay_steps, design_grid, sbatch_ranks
from .spec import SweepSpec, SweepSpecError, Variant

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
    lr: float = 0.0               # peak learning rate (optim.lr) the point trains with
    lr_mult: float = 1.0          # its `lr_sweep` multiplier on the rule's (or config's) learning rate
    global_batch_size: int = 0    # sequences per optimizer step
    warmup_steps: int = 0
    decay_steps: int = 0          # steps of the LR decay (cosine: after warm-up; wsd: the final decay)
    target_params: Optional[float] = None   # design: the grid's target total parameters
    prior_params: Optional[float] = None    # design: the prior compute-optimal N* of (budget, variant)
    tags: tuple[tuple[str, str], ...] = ()  # the MLflow tags (also in the overrides)
    active_params: int = 0        # parameters one token uses (MoE: top-k experts; `megaroute inspect`)

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.n_params

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


def point_tags(spec: SweepSpec, variant: str, size: str, budget: float, seed: int, index: int, n_params: int,
               lr_mult: float = 1.0, prior_params: Optional[float] = None, n_active: Optional[int] = None):
    tags = {TAG_SWEEP: spec.name, "budget": f"{budget:.6g}", "size": size, "variant": variant, "seed": str(seed),
            "sweep_index": str(index), "n_params": str(n_params), "lr_mult": f"{lr_mult:g}"}
    if prior_params is not None:
        tags["prior_n_opt"] = str(round(prior_params))
    if spec.hold != "flops":  # the budget tag is then the reference variant's FLOPs, not this run's
        tags.update(hold=spec.hold, active_params=str(n_active))
    return tags


def _tag_overrides(tags: dict[str, str]) -> list[str]:
    # Quoted so YAML keeps "1e+19" and "0" as strings (tags are typed dict[str, str]).
    return [f'tracking.tags.{k}="{v}"' for k, v in tags.items()]


def _count_params(cfg: Config) -> tuple[int, int]:
    """(total, active) parameters of the config's model, built on the meta device."""
    model = build_model(cfg.model, cfg.routing, device="meta")
    return model.num_params(), active_params(model, cfg.routing, cfg.data.seq_len)


@dataclass(frozen=True)
class _Size:
    """One size of one variant at one budget."""
    name: str
    overrides: tuple[str, ...]
    target: Optional[float] = None
    prior: Optional[float] = None


def _ruled_keys(spec: SweepSpec) -> dict[str, str]:
    """Config keys the spec's rules set per point -> the spec section that sets them."""
    keys = {}
    if spec.design is not None:
        keys.update(dict.fromkeys(("model.d_model", "model.n_layers", "model.n_heads"), "design"))
        if spec.design.shape.ffn_ratio is not None:
            keys["model.d_ff"] = "design"
    if spec.lr is not None:
        keys.update(dict.fromkeys(("optim.lr", "optim.min_lr"), "lr"))
    if spec.batch is not None and spec.batch.rule != "fixed":
        keys["train.global_batch_size"] = "batch"
    if spec.schedule is not None:
        keys["optim.warmup_steps"] = "schedule"
        if spec.schedule.decay_fraction is not None:
            keys["optim.decay_fraction"] = "schedule"
    return keys


def _check_ruled(spec: SweepSpec, variant: Variant, extra_overrides: tuple[str, ...]) -> None:
    ruled = _ruled_keys(spec)
    for where, overrides in ((f"variants.{variant.name}.overrides", variant.overrides),
                             *((f"sizes.{s}", ov) for s, ov in spec.sizes.items()),
                             ("overrides", spec.overrides), ("command line", extra_overrides)):
        for o in overrides:
            key = o.partition("=")[0].strip()
            if key in ruled:
                raise SweepSpecError(spec.path, ruled[key] if where == "command line" else where,
                                     f"{key} is set per point by the spec's `{ruled[key]}:` rule; overriding it "
                                     f"({o!r}, {where}) would break the rule: change `{ruled[key]}:` instead")


def _grid_sizes(spec: SweepSpec, variant: Variant, budget: float, base: Config) -> list[_Size]:
    grid: Optional[Grid] = design_grid(budget, spec.design, base.model, base.routing, base.data.seq_len)
    if grid is None:
        raise SweepSpecError(spec.path, "budgets", f"variant {variant.name}, budget {budget:.3g}: the prior optimum "
                             f"is below the shape rule's smallest model (d_model={spec.design.shape.d_multiple}, "
                             f"{spec.design.shape.min_layers} layers); raise the budget or shrink design.shape")
    sizes = [_Size(g.shape.name, tuple(g.shape.overrides()), g.target, grid.n_star) for g in grid.points]
    names = [s.name for s in sizes]
    if len(set(names)) < len(names):
        raise SweepSpecError(spec.path, "design.span", f"variant {variant.name}, budget {budget:.3g}: grid targets "
                             f"{', '.join(_si(s.target) for s in sizes)} map to the shapes {', '.join(names)}, not "
                             f"{len(names)} distinct ones; widen design.span or refine design.shape.d_multiple")
    return sizes


def plan(spec: SweepSpec, extra_overrides: tuple[str, ...] = (), parent_run_id: str | None = None) -> list[Point]:
    """All points of the sweep; raises SweepSpecError naming the first point that is refused and why."""
    peak = peak_flops(spec.gpu)
    common_of = {v.name: [*v.overrides, *spec.overrides, *extra_overrides] for v in spec.variants}
    # sizes[budget][variant] -> list of _Size (the same list at every budget with `sizes:`)
    fixed = [_Size(s, ov) for s, ov in spec.sizes.items()]
    sizes: dict[float, dict[str, list[_Size]]] = {}
    ref = spec.variants[0]
    for variant in spec.variants:
        _check_ruled(spec, variant, extra_overrides)
        # hold: active_params -> every variant takes the reference's grid of shapes
        grid_of = ref if spec.hold == "active_params" else variant
        base = load_config(grid_of.config, common_of[grid_of.name]) if spec.design is not None else None
        for budget in spec.budgets:
            sizes.setdefault(budget, {})[variant.name] = (
                fixed if spec.design is None else _grid_sizes(spec, grid_of, budget, base))
    ranks = sbatch_ranks(spec.sbatch)
    cache: dict[tuple[str, str], tuple[Config, tuple[int, int], float]] = {}
    points = []
    n_sizes = len(fixed) if spec.design is None else spec.design.sizes
    for budget in spec.budgets:
        for rank in range(n_sizes):
            reference: Optional[Point] = None   # the first variant's point of this (budget, size)
            for variant in spec.variants:
                size = sizes[budget][variant.name][rank]
                common = [*size.overrides, *common_of[variant.name]]
                key = (variant.name, size.name)
                if key not in cache:  # the model does not depend on budget or seed
                    cfg = load_config(variant.config_path(size.name), common)
                    fpt = flops_per_token(cfg.model, cfg.routing, cfg.data.seq_len, training=True)
                    cache[key] = (cfg, _count_params(cfg), fpt)
                cfg, n_params, fpt = cache[key]
                for seed in spec.seeds:
                    for lr_mult in spec.lr_sweep:
                        points.append(_point(spec, len(points), variant, size, budget, seed, lr_mult, cfg, n_params,
                                             fpt, common, ranks, peak, parent_run_id,
                                             reference if spec.hold == "active_params" else None))
                reference = reference or points[-1]
    return points


def _point(spec: SweepSpec, index: int, variant: Variant, size: _Size, budget: float, seed: int, lr_mult: float,
           cfg: Config, params: tuple[int, int], fpt: float, common: list[str], ranks: Optional[int], peak: float,
           parent_run_id: Optional[str], reference: Optional[Point] = None) -> Point:
    """One point; `reference` (hold: active_params, every variant but the first): the first variant's point
    at this (budget, size), whose tokens this one trains on and whose active parameters it must match."""
    n_params, n_active = params
    suffix = f"-lr{lr_mult:g}" if len(spec.lr_sweep) > 1 or lr_mult != 1 else ""
    name = f"{spec.name}-{variant.name}-{size.name}-C{budget_label(budget)}-s{seed}{suffix}"
    where = f"{name} (index {index})"

    def refuse(key: str, why: str):
        raise SweepSpecError(spec.path, key, f"{where}: {why}")

    if reference is not None:
        if abs(n_active / reference.active_params - 1) > spec.active_tolerance:
            refuse("active_tolerance", f"{n_active} active parameters, {n_active / reference.active_params - 1:+.1%} "
                   f"off {reference.variant}'s {reference.active_params} at this size (hold: active_params, "
                   f"tolerance {spec.active_tolerance:.0%}); give this variant a config of the same active size")
    elif size.target is not None and abs(n_params / size.target - 1) > spec.design.shape.tolerance:
        refuse("design.shape.tolerance", f"the shape rule's nearest model has {n_params} parameters, "
               f"{n_params / size.target - 1:+.1%} off the grid's target {_si(size.target)} (tolerance "
               f"{spec.design.shape.tolerance:.0%}); refine design.shape (d_multiple, aspect_range)")
    rules = []   # per-point overrides of the spec's rules, after the common ones
    global_batch = cfg.train.global_batch_size
    if spec.batch is not None and spec.batch.rule != "fixed":
        dp = spec.batch.data_parallel or cfg.parallel.dp or max(1, (ranks or 1) // cfg.parallel.tp)
        global_batch = spec.batch.sequences(budget, cfg.data.seq_len, cfg.train.micro_batch_size * dp)
        rules.append(f"train.global_batch_size={global_batch}")
    tokens_per_step = global_batch * cfg.data.seq_len
    if reference is not None:  # the reference's tokens, whatever they cost this variant
        steps = max(1, round(reference.tokens / tokens_per_step))
        error = steps * tokens_per_step / reference.tokens - 1
        if abs(error) > spec.budget_tolerance:
            refuse("hold", f"{steps} steps of {tokens_per_step} tokens miss {reference.variant}'s {reference.tokens} "
                   f"tokens by {error:+.2%} (hold: active_params, tolerance {spec.budget_tolerance:.0%}); make "
                   f"train.global_batch_size x data.seq_len divide them")
    else:
        steps = round(budget / (fpt * tokens_per_step))
    if steps < 1:
        refuse("budgets", f"budget {budget:.3g} is less than one optimizer step ({fpt * tokens_per_step:.3g} FLOPs)")
    error = steps * tokens_per_step * fpt / budget - 1
    if reference is None and abs(error) > spec.budget_tolerance:
        refuse("budgets", f"{steps} steps of {tokens_per_step} tokens miss budget {budget:.3g} by {error:+.2%} "
               f"(tolerance {spec.budget_tolerance:.0%}); raise the budget or lower train.global_batch_size")
    decay_fraction = cfg.optim.decay_fraction
    if spec.schedule is not None:
        warmup = spec.schedule.warmup_steps(steps)
        rules.append(f"optim.warmup_steps={warmup}")
        if spec.schedule.decay_fraction is not None:
            decay_fraction = spec.schedule.decay_fraction
            rules.append(f"optim.decay_fraction={decay_fraction}")
    else:
        warmup = cfg.optim.warmup_steps
    if warmup >= steps:
        source = ("schedule.min_warmup_steps" if spec.schedule
                  else "optim.warmup_steps; a `schedule:` section sets it per run")
        refuse("schedule", f"ends inside its warm-up: {steps} steps, warm-up {warmup} steps ({source}); a run that "
               f"never reaches its peak learning rate is not comparable")
    tokens_per_param = steps * tokens_per_step / n_params
    if spec.min_tokens_per_param is not None and tokens_per_param < spec.min_tokens_per_param:
        refuse("min_tokens_per_param", f"{tokens_per_param:.2g} tokens per parameter ({_si(steps * tokens_per_step)} "
               f"tokens, {_si(n_params)} parameters) is below min_tokens_per_param={spec.min_tokens_per_param:g}: "
               f"too far from compute-optimal to inform the fit")
    if spec.lr is not None:
        lr = float(f"{spec.lr.lr(cfg.model.d_model, budget) * lr_mult:.4g}")
        min_lr = float(f"{spec.lr.min_lr_ratio * lr:.4g}")
    else:
        lr, min_lr = cfg.optim.lr * lr_mult, cfg.optim.min_lr * lr_mult
    if spec.lr is not None or lr_mult != 1:
        rules += [f"optim.lr={lr:.4g}", f"optim.min_lr={min_lr:.4g}"]
    tags = point_tags(spec, variant.name, size.name, budget, seed, index, n_params, lr_mult, size.prior, n_active)
    # runs_dir before the common overrides so a command-line runs_dir=... wins.
    overrides = (f"runs_dir={spec.run_root}", *common, *rules, f"name={name}", f"variant={variant.name}",
                 f"size={size.name}", f"train.seed={seed}", f"train.max_steps={steps}",
                 "train.max_tokens=null", "train.max_flops=null",
                 f"tracking.experiment={spec.experiment}", *_tag_overrides(tags),
                 *([f"tracking.parent_run_id={parent_run_id}"] if parent_run_id else []))
    # Fail here, on the login node, rather than in array task `index` hours later.
    final = load_config(variant.config_path(size.name), overrides)
    gpu_hours = steps * tokens_per_step * fpt / (peak * spec.mfu) / 3600
    return Point(index, variant.name, size.name, budget, seed, name, os.path.relpath(variant.config_path(size.name)),
                 overrides, n_params, fpt, tokens_per_step, steps, gpu_hours, final.optim.lr, lr_mult, global_batch,
                 warmup, decay_steps(final.optim.schedule, decay_fraction, warmup, steps), size.target, size.prior,
                 tuple(tags.items()), n_active)


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_table(points: list[Point]) -> str:
    """One row per point (tokens/param, steps, warm-up and decay steps, learning rate, batch), then per
    (budget, variant) the prior optimum and where the grid lies around it. With hold: active_params the
    "vs target" column compares ACTIVE parameters with the target (the reference's grid)."""
    sweep = any(p.lr_mult != 1 for p in points)
    design = any(p.target_params is not None for p in points)
    hold_active = any(dict(p.tags).get("hold") == "active_params" for p in points)
    routed_width = hold_active or any(p.active_params not in (0, p.n_params) for p in points)
    held = (lambda p: p.active_params) if hold_active else (lambda p: p.n_params)
    head = ("idx", "variant", "size", "params", *(("active",) if routed_width else ()),
            *(("vs target",) if design else ()), "budget", "tokens", "tok/param",
            "steps", "warm-up", "decay", "LR", *(("LR x",) if sweep else ()), "batch", "FLOPs/tok", "vs budget",
            "GPU-h", "run")
    rows = [(str(p.index), p.variant, p.size, _si(p.n_params), *((_si(p.active_params),) if routed_width else ()),
             *((f"{held(p) / p.target_params - 1:+.1%}",) if design else ()), f"{p.budget:.3g}", _si(p.tokens),
             f"{p.tokens_per_param:.3g}", str(p.steps), str(p.warmup_steps), str(p.decay_steps), f"{p.lr:.3g}",
             *((f"{p.lr_mult:g}",) if sweep else ()), str(p.global_batch_size), _si(p.flops_per_token),
             f"{p.budget_error:+.2%}", f"{p.gpu_hours:.3g}", p.run_name) for p in points]
    left = {head.index(c) for c in ("variant", "size", "run")}
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in (head, *rows)]
    if design:
        lines.append("prior optimum N* per budget and variant (design: tokens/param prior, routing-aware FLOPs), "
                     f"grid sizes in {'ACTIVE ' if hold_active else ''}parameters:")
        groups: dict[tuple[float, str], list[Point]] = {}
        for p in points:
            groups.setdefault((p.budget, p.variant), []).append(p)
        for (budget, variant), ps in groups.items():
            sizes = sorted({held(p) for p in ps})
            n_star = ps[0].prior_params
            below = sum(n < n_star for n in sizes)
            lines.append(f"  C={budget:.3g} {variant}: N*={_si(n_star)}, grid {' '.join(_si(n) for n in sizes)} "
                         f"({below} below N*, {len(sizes) - below} above)")
    if hold_active:
        lines.append(f"hold: active_params: at each (budget, size) every variant has {points[0].variant}'s active "
                     f"parameters and trains on its tokens; the budget is {points[0].variant}'s training FLOPs, "
                     "\"vs budget\" what the others spend")
    total = sum(p.gpu_hours for p in points)
    return "\n".join([*lines, f"{len(points)} points, {total:.3g} GPU-hours estimated"])


def pretrain_command(spec: SweepSpec, point: Point) -> str:
    """What array task `point.index` runs (slurm/isoflop_sweep.sh execs slurm/pretrain.sh)."""
    return shlex.join(["slurm/pretrain.sh", "--gpu", spec.gpu, *point.launcher_args()])
