"""Sweep spec: the YAML file that describes an isoFLOP sweep (configs/sweeps/*.yaml).

    name: isoflop-v2                 # sweep id: tags every run, names run directories
    experiment: isoflop              # MLflow experiment of all runs and the parent run
    budgets: [1.0e19, 3.0e19]        # training FLOPs per run (with `hold: active_params`: the first variant's)
    hold: flops                      # what the variants share at a (budget, size): flops | active_params
    variants:                        # variant name -> base config (+ overrides)
      dense: {config: ../base_sweep.yaml}
      mod:   {config: ../base_sweep.yaml, overrides: [routing.method=mod, routing.capacity=0.125]}
    design:                          # sizes per (budget, variant) from rules (megaroute/sweep/design.py)
      sizes: 5                       # >= 5 per budget, evenly spaced in log N ...
      span: 4.0                      # ... the largest `span` x the smallest, centred on the prior optimum N*
      tokens_per_param: 20           # prior: C = FLOPs/token(N) x 20 x N, N = TOTAL parameters
      shape: {d_multiple: 64, head_dim: 64, aspect: 48, aspect_range: [24, 96], min_layers: 4, tolerance: 0.03,
              ffn_ratio: null}     # [lo, hi]: d_ff free in lo..hi x d_model (tiny models)
    lr: {rule: width, base: 6.0e-4, d_ref: 768, power: 1.0, min_lr_ratio: 0.1}   # or {rule: compute, coef, exponent}
    batch: {rule: compute, coef: 0.292, exponent: 0.3271}                     # or {rule: fixed}; data_parallel: N
    schedule: {warmup_fraction: 0.05, min_warmup_steps: 0, decay_fraction: 0.2}
    lr_sweep: [0.5, 1.0, 2.0]        # optional: a point per lr multiplier; the analysis keeps the best
    min_tokens_per_param: 2          # refuse points below (default 2 with `design:`, none with `sizes:`)
    seeds: [0]
    overrides: [tracking.uri=http://mlflow:5000]   # applied to every point
    gpu: a100                        # slurm/pretrain.sh --gpu: a100 (bf16), v100 (fp16), cpu
    sbatch: [--nodes=1, --ntasks-per-node=8, --gpus-per-node=8]   # resources of one array task
    mfu: 0.4                         # assumed utilisation for the GPU-hour estimate

Instead of `design:`, `sizes:` lists fixed sizes, the same at every budget (size name -> overrides;
`{size}` in a variant's config path picks configs/<variant>_<size>.yaml):

    sizes: {157m: [], 350m: []}
    variants: {dense: {config: ../dense_{size}.yaml}}

With `sizes:`, an absent `lr:`, `batch:` or `schedule:` section leaves the configs' values (optim.lr,
train.global_batch_size, optim.warmup_steps); with `design:` each defaults to its documented rule
(every constant has the default shown above: megaroute/sweep/design.py). A section's keys depend on
its rule (lr width: base, d_ref, power; lr compute: coef, exponent; batch compute: coef, exponent).
A key a rule sets per point (model.d_model/n_layers/n_heads with `design:`, optim.lr and
optim.min_lr with `lr:`, train.global_batch_size with `batch: compute`, optim.warmup_steps with
`schedule:`) may not also be overridden by the spec or the command line.

`hold:` says what every variant holds equal at one (budget, size) cell, the first variant being the
reference (usually dense):
  - flops (default): each point trains for the budget's training FLOPs (megaroute.flops, routing-aware):
    a variant that is cheaper per token (MoD, MoDE) trains on more tokens. With `design:` each variant
    gets its own grid around its own prior optimum.
  - active_params: each variant has the reference's ACTIVE parameters (megaroute.model.routing.moe
    .active_params, what `megaroute inspect` prints: an MoE FFN counts its top-k experts, not all E) and
    trains on the reference's tokens; the budget is the reference's training FLOPs, the other variants
    spend what those tokens cost them (the plan's "vs budget" column). With `design:` every variant takes
    the reference's grid of shapes. The plan refuses a variant whose active parameters are more than
    `active_tolerance` (default 0.03) off the reference's at the same cell, or whose tokens per step do
    not divide the reference's tokens within `budget_tolerance`.

Paths are relative to the spec file. Unknown keys are errors, like in run configs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

import yaml

from ..config import ConfigError
from .design import BATCH_KEYS, BATCH_RULES, LR_KEYS, LR_RULES, BatchRule, Design, LrRule, Schedule, ShapeRule

GPUS = ("a100", "v100", "cpu")
HOLDS = ("flops", "active_params")   # spec key `hold`: what the variants share at a (budget, size) cell


class SweepSpecError(ConfigError):
    """A sweep spec value is missing, unknown or invalid; the message names the file and key."""

    def __init__(self, file: str, key: str, message: str):
        self.path = key
        ValueError.__init__(self, f"{file}: sweep key '{key}': {message}")


@dataclass(frozen=True)
class Variant:
    name: str
    config: str  # absolute path template; may contain {size}
    overrides: tuple[str, ...] = ()

    def config_path(self, size: str) -> str:
        return self.config.format(size=size)


@dataclass(frozen=True)
class SweepSpec:
    path: str
    name: str
    experiment: str
    budgets: tuple[float, ...]
    sizes: dict[str, tuple[str, ...]]    # fixed sizes (empty with `design:`)
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...] = (0,)
    overrides: tuple[str, ...] = ()
    runs_dir: Optional[str] = None
    gpu: str = "a100"
    sbatch: tuple[str, ...] = ()
    mfu: float = 0.4
    # How far tokens x FLOPs/token may miss a budget (whole optimizer steps quantize tokens).
    budget_tolerance: float = 0.01
    # Rule-based sizes (megaroute/sweep/design.py) instead of `sizes`; None with `sizes`.
    design: Optional[Design] = None
    # Per-point learning rate, batch and warm-up rules; None: the configs' values (`sizes:` specs only).
    lr: Optional[LrRule] = None
    batch: Optional[BatchRule] = None
    schedule: Optional[Schedule] = None
    lr_sweep: tuple[float, ...] = (1.0,)
    min_tokens_per_param: Optional[float] = None
    hold: str = "flops"              # HOLDS; active_params: the first variant's active parameters and tokens
    active_tolerance: float = 0.03   # hold: active_params: |active / reference's active - 1| allowed

    @property
    def run_root(self) -> str:
        return self.runs_dir or os.path.join("runs", self.name)


_KEYS = {"name", "experiment", "budgets", "sizes", "design", "variants", "seeds", "overrides", "runs_dir", "gpu",
         "sbatch", "mfu", "budget_tolerance", "lr", "batch", "schedule", "lr_sweep", "min_tokens_per_param", "hold",
         "active_tolerance"}
MIN_DESIGN_SIZES = 5   # per budget: the parabola of `sweep analyze` needs points on both sides of the optimum


def load_spec(path: str) -> SweepSpec:
    if not os.path.isfile(path):
        raise SweepSpecError(path, "", "sweep spec file not found")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise SweepSpecError(path, "", f"invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SweepSpecError(path, "", "must be a mapping")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise SweepSpecError(path, unknown[0], f"unknown key (known: {', '.join(sorted(_KEYS))})")
    here = os.path.dirname(os.path.abspath(path))

    def need(key: str):
        if key not in raw:
            raise SweepSpecError(path, key, "required")
        return raw[key]

    name = need("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise SweepSpecError(path, "name", f"must be a non-empty name without '/', got {name!r}")
    budgets = need("budgets")
    if not isinstance(budgets, list) or not budgets:
        raise SweepSpecError(path, "budgets", "must be a non-empty list of FLOP budgets")
    budgets = [_flops(path, f"budgets[{i}]", b) for i, b in enumerate(budgets)]
    if ("sizes" in raw) == ("design" in raw):
        raise SweepSpecError(path, "design", "give exactly one of `design:` (sizes from rules) and `sizes:` "
                             "(fixed sizes)" + (", not both" if "sizes" in raw else ""))
    design = _design(path, raw["design"]) if "design" in raw else None
    sizes = raw.get("sizes") if design is None else {}
    if design is None and (not isinstance(sizes, dict) or not sizes):
        raise SweepSpecError(path, "sizes", "must map size names to lists of overrides")
    for s, ov in sizes.items():
        _check_overrides(path, f"sizes.{s}", ov)
    variants_raw = need("variants")
    if not isinstance(variants_raw, dict) or not variants_raw:
        raise SweepSpecError(path, "variants", "must map variant names to {config: ..., overrides: [...]}")
    variants = []
    for v, body in variants_raw.items():
        if not isinstance(body, dict) or "config" not in body or set(body) - {"config", "overrides"}:
            raise SweepSpecError(path, f"variants.{v}", "must be {config: FILE, overrides: [...]}")
        variant = Variant(v, os.path.join(here, body["config"]),
                          tuple(_check_overrides(path, f"variants.{v}.overrides", body.get("overrides", []))))
        if design is not None:
            if "{size}" in variant.config:
                raise SweepSpecError(path, f"variants.{v}.config", "with `design:` a variant names one base config "
                                     "(the design sets the shape), not a {size} template")
            if not os.path.isfile(variant.config):
                raise SweepSpecError(path, f"variants.{v}.config", f"{variant.config} not found")
        for s in sizes:
            if not os.path.isfile(variant.config_path(s)):
                raise SweepSpecError(path, f"variants.{v}.config", f"{variant.config_path(s)} not found (size {s})")
        variants.append(variant)
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise SweepSpecError(path, "seeds", f"must be a non-empty list of integers, got {seeds!r}")
    gpu = raw.get("gpu", "a100")
    if gpu not in GPUS:
        raise SweepSpecError(path, "gpu", f"must be one of {', '.join(GPUS)}, got {gpu!r}")
    mfu = raw.get("mfu", 0.4)
    if not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise SweepSpecError(path, "mfu", f"must be in (0, 1], got {mfu!r}")
    tol = raw.get("budget_tolerance", 0.01)
    if not isinstance(tol, (int, float)) or not 0 < tol < 1:
        raise SweepSpecError(path, "budget_tolerance", f"must be in (0, 1), got {tol!r}")
    hold = raw.get("hold", "flops")
    if hold not in HOLDS:
        raise SweepSpecError(path, "hold", f"must be one of {', '.join(HOLDS)} (what the variants share at a "
                             f"(budget, size)), got {hold!r}")
    active_tol = raw.get("active_tolerance", 0.03)
    if not (_number(active_tol) and 0 < active_tol < 0.5):
        raise SweepSpecError(path, "active_tolerance", f"must be a number in (0, 0.5), got {active_tol!r}")
    if "active_tolerance" in raw and hold != "active_params":
        raise SweepSpecError(path, "active_tolerance", "applies with `hold: active_params` only (this spec holds "
                             f"{hold} fixed)")
    if hold == "active_params" and len(variants) < 2:
        raise SweepSpecError(path, "hold", "active_params matches every variant to the first one's active "
                             "parameters: give at least two variants")
    runs_dir = raw.get("runs_dir")
    lr = _lr(path, raw["lr"]) if "lr" in raw else (LrRule() if design else None)
    batch = _batch(path, raw["batch"]) if "batch" in raw else (BatchRule() if design else None)
    schedule = (_section(path, "schedule", raw["schedule"], Schedule) if "schedule" in raw
                else (Schedule() if design else None))
    if schedule is not None:
        _check_schedule(path, schedule)
    lr_sweep = raw.get("lr_sweep", [1.0])
    if (not isinstance(lr_sweep, list) or not lr_sweep or not all(_number(m) and m > 0 for m in lr_sweep)
            or len(set(lr_sweep)) != len(lr_sweep)):
        raise SweepSpecError(path, "lr_sweep", f"must be a non-empty list of distinct positive learning-rate "
                             f"multipliers, got {lr_sweep!r}")
    min_tpp = raw.get("min_tokens_per_param", 2.0 if design else None)
    if min_tpp is not None and not (_number(min_tpp) and min_tpp >= 0):
        raise SweepSpecError(path, "min_tokens_per_param", f"must be a number >= 0, got {min_tpp!r}")
    return SweepSpec(
        path=os.path.abspath(path), name=name, experiment=str(raw.get("experiment", name)),
        budgets=tuple(budgets), sizes={str(s): tuple(ov or ()) for s, ov in sizes.items()},
        variants=tuple(variants), seeds=tuple(seeds),
        overrides=tuple(_check_overrides(path, "overrides", raw.get("overrides", []))),
        runs_dir=runs_dir, gpu=gpu, sbatch=tuple(_check_overrides(path, "sbatch", raw.get("sbatch", []), "--")),
        mfu=float(mfu), budget_tolerance=float(tol), design=design, lr=lr, batch=batch, schedule=schedule,
        lr_sweep=tuple(float(m) for m in lr_sweep), min_tokens_per_param=None if min_tpp is None else float(min_tpp),
        hold=hold, active_tolerance=float(active_tol),
    )


# Examples of the type of keys whose default is None (unset).
_NONE_DEFAULTS = {"ffn_ratio": (2.0, 4.0), "decay_fraction": 0.2, "data_parallel": 8}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _section(path: str, key: str, raw, cls, allowed: Optional[set[str]] = None, extra: Optional[dict] = None):
    """A mapping of the dataclass `cls`'s fields, type-checked against their defaults' types."""
    if not isinstance(raw, dict):
        raise SweepSpecError(path, key, f"must be a mapping, got {raw!r}")
    names = {f.name for f in fields(cls)} if allowed is None else allowed
    unknown = sorted(set(raw) - names)
    if unknown:
        raise SweepSpecError(path, f"{key}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(names))})")
    values = dict(extra or {})
    defaults = cls()
    for name, value in raw.items():
        default = getattr(defaults, name)
        sub = f"{key}.{name}"
        if name in (extra or {}):
            continue
        like = _NONE_DEFAULTS.get(name, default) if default is None else default
        if value is None and default is None:
            ok = True
        elif isinstance(like, str):
            ok = isinstance(value, str)
        elif isinstance(like, bool):
            ok = isinstance(value, bool)
        elif isinstance(like, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(like, float):
            ok = _number(value)
            value = float(value) if ok else value
        elif isinstance(like, tuple):
            ok = isinstance(value, list) and len(value) == len(like) and all(_number(x) for x in value)
            value = tuple(float(x) for x in value) if ok else value
        else:
            ok = True
        if not ok:
            raise SweepSpecError(path, sub, f"must be like {list(like) if isinstance(like, tuple) else like!r}, "
                                 f"got {value!r}")
        values[name] = value
    return cls(**values)


def _positive(path: str, key: str, value, what: str = "> 0") -> None:
    if not value > 0:
        raise SweepSpecError(path, key, f"must be {what}, got {value!r}")


def _design(path: str, raw) -> Design:
    if not isinstance(raw, dict):
        raise SweepSpecError(path, "design", f"must be a mapping, got {raw!r}")
    shape = _section(path, "design.shape", raw.get("shape", {}), ShapeRule)
    design = _section(path, "design", raw, Design, extra={"shape": shape})
    if design.sizes < MIN_DESIGN_SIZES:
        raise SweepSpecError(path, "design.sizes", f"must be >= {MIN_DESIGN_SIZES} (sizes per budget, so the fit "
                             f"brackets the optimum), got {design.sizes}")
    _positive(path, "design.span", design.span - 1, "> 1 (largest / smallest size)")
    _positive(path, "design.tokens_per_param", design.tokens_per_param)
    for name in ("d_multiple", "head_dim", "min_layers", "aspect", "tolerance"):
        _positive(path, f"design.shape.{name}", getattr(shape, name))
    if shape.head_dim % 2 or shape.d_multiple % shape.head_dim:
        raise SweepSpecError(path, "design.shape.head_dim", f"must be even (RoPE) and divide d_multiple="
                             f"{shape.d_multiple}, got {shape.head_dim}")
    lo, hi = shape.aspect_range
    if not 0 < lo <= shape.aspect <= hi:
        raise SweepSpecError(path, "design.shape.aspect_range", f"must be [lo, hi] with 0 < lo <= aspect="
                             f"{shape.aspect:g} <= hi, got {[lo, hi]}")
    if not shape.tolerance < 0.5:
        raise SweepSpecError(path, "design.shape.tolerance", f"must be in (0, 0.5), got {shape.tolerance}")
    if shape.ffn_ratio is not None and not 0 < shape.ffn_ratio[0] <= shape.ffn_ratio[1]:
        raise SweepSpecError(path, "design.shape.ffn_ratio", f"must be [lo, hi] with 0 < lo <= hi, "
                             f"got {list(shape.ffn_ratio)}")
    return design


def _ruled_section(path: str, key: str, raw, cls, rules, keys: dict, default: str):
    """A `{rule: ..., <that rule's keys>}` section: the rule checked first, then its keys."""
    rule = raw.get("rule", default) if isinstance(raw, dict) else None
    if rule not in rules:
        raise SweepSpecError(path, f"{key}.rule", f"must be one of {', '.join(rules)}, got {rule!r}")
    return _section(path, key, raw, cls, keys[rule]), rule


def _lr(path: str, raw) -> LrRule:
    lr, rule = _ruled_section(path, "lr", raw, LrRule, LR_RULES, LR_KEYS, "width")
    for name in ("base", "d_ref") if rule == "width" else ("coef",):
        _positive(path, f"lr.{name}", getattr(lr, name))
    if not 0 <= lr.min_lr_ratio <= 1:
        raise SweepSpecError(path, "lr.min_lr_ratio", f"must be in [0, 1], got {lr.min_lr_ratio}")
    return lr


def _batch(path: str, raw) -> BatchRule:
    batch, _ = _ruled_section(path, "batch", raw, BatchRule, BATCH_RULES, BATCH_KEYS, "compute")
    _positive(path, "batch.coef", batch.coef)
    if batch.data_parallel is not None and not (isinstance(batch.data_parallel, int) and batch.data_parallel >= 1):
        raise SweepSpecError(path, "batch.data_parallel", f"must be an integer >= 1, got {batch.data_parallel!r}")
    return batch


def _check_schedule(path: str, s: Schedule) -> None:
    if not 0 <= s.warmup_fraction < 1:
        raise SweepSpecError(path, "schedule.warmup_fraction", f"must be in [0, 1), got {s.warmup_fraction}")
    if s.min_warmup_steps < 0:
        raise SweepSpecError(path, "schedule.min_warmup_steps", f"must be >= 0, got {s.min_warmup_steps}")
    if s.decay_fraction is not None and not (0 < s.decay_fraction <= 1 and s.warmup_fraction + s.decay_fraction < 1):
        raise SweepSpecError(path, "schedule.decay_fraction", f"must be in (0, 1 - warmup_fraction="
                             f"{1 - s.warmup_fraction:g}), got {s.decay_fraction}")


def _flops(path: str, key: str, value) -> float:
    # PyYAML reads 1.0e19 as a float but 1e19 and 3.0e18 as strings (YAML 1.1 wants a sign).
    try:
        flops = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        flops = -1.0
    if not flops > 0:
        raise SweepSpecError(path, key, f"must be a positive number of FLOPs, got {value!r}")
    return flops


def _check_overrides(path: str, key: str, value, must_start: str = "") -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SweepSpecError(path, key, f"must be a list of strings, got {value!r}")
    for i, v in enumerate(value):
        if must_start and not v.startswith(must_start):
            raise SweepSpecError(path, f"{key}[{i}]", f"must be an option starting with {must_start!r}, got {v!r}")
        if not must_start and "=" not in v:
            raise SweepSpecError(path, f"{key}[{i}]", f"override must look like key.path=value, got {v!r}")
    return value
