"""Rule-based isoFLOP sweep design: which model sizes, learning rate, batch and schedule each point gets.

A spec with a `design:` section (configs/sweeps/isoflop.yaml, tiny.yaml) does not list sizes; per
(budget C, variant) the planner derives them with these rules, every constant a spec key with the
default given here (megaroute/sweep/spec.py parses them):

1. Prior optimum. N* solves C = F(N) x r x N: r = `design.tokens_per_param` (default 20, the
   Chinchilla rule of thumb, Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models",
   Table 3 / approach 1-2: ~20 tokens per parameter) and F(N) the training FLOPs per token of the
   rule's shape for N (megaroute.flops, routing-aware: a MoD variant does fewer FLOPs per token, so
   its N* is larger than the dense one's at the same C). N counts TOTAL parameters (untied input
   embedding and LM head included, as `megaroute inspect` and the run's `n_params` tag count them):
   Chinchilla's 20 tokens/param counts total parameters (Kaplan et al. 2020 count non-embedding
   ones; Pearce & Song 2024 trace part of the two papers' disagreement to that). The prior only:
   the fit of a previous budget is not fed forward (run `sweep analyze` and set tokens_per_param
   from its frontier if the prior turns out off).
2. Grid. `design.sizes` targets (>= 5) evenly spaced in log N, the largest `design.span` (default
   4) times the smallest, centred on N*: for 5 sizes N*/2, N*/sqrt2, N*, sqrt2 N*, 2 N*, so the
   prior optimum is interior with two sizes on each side (the parabola of `sweep analyze` brackets
   it) and tokens/param runs from r x span ... r / span (80 ... 5 at the defaults).
3. Shape. For each target the shape rule's candidates are d_model = k x `shape.d_multiple`,
   n_heads = d_model / `shape.head_dim`, any n_layers >= `shape.min_layers` with aspect ratio
   d_model / n_layers in `shape.aspect_range` (defaults: 64, 64, [24, 96], 4 layers). Chosen: among
   candidates whose total parameter count is within tolerance/2 of the target, the one whose aspect
   ratio is nearest `shape.aspect` (default 48, configs/dense_157m.yaml's and dense_1b.yaml's; in
   log); if none is, the candidate nearest the target. The planner refuses a point whose model (the
   real one, built on the meta device: routers included) is more than `shape.tolerance` (default
   3%) off its target, and a grid whose targets collapse onto one shape. The FFN follows the base
   config's rule (model.d_ff, or 8/3 d_model rounded up to model.ffn_multiple_of), unless
   `shape.ffn_ratio: [lo, hi]` frees it: then d_ff (a multiple of model.ffn_multiple_of in
   lo..hi x d_model) is a third knob, set per shape to hit the target (ties: the ratio nearest 8/3).
   Tiny models need it: at 10^4-10^5 parameters one layer or one d_model step is 10-50% of N, and
   no (d_model, n_layers) pair alone lands within a few % (configs/sweeps/tiny.yaml).
4. Learning rate (`lr:`), one of
   - width (default): lr = base x (d_ref / d_model)^power, base 6e-4 at d_ref 768, power 1: the
     muP scaling of Adam's hidden-weight learning rate, 1 / fan_in (Yang et al. 2022, "Tensor
     Programs V"), applied to all parameters (the embedding's constant muP rate is not kept apart).
     base/d_ref are configs/dense_157m.yaml's tuned values (its 350m-1b siblings: 3e-4 ... 2e-4).
   - compute: lr = coef x C^exponent, coef 0.3118, exponent -0.125: DeepSeek LLM (Bi et al. 2024,
     arXiv:2401.02954, sec. 3.1, eq. 1), fitted for AdamW (0.9, 0.95), weight decay 0.1; one
     learning rate for every size at a budget.
   optim.min_lr = `lr.min_lr_ratio` (0.1) x lr. `lr_sweep: [0.5, 1, 2]` multiplies the rule's lr:
   each multiplier is a point of its own (tag `lr_mult`, run name suffix -lr<m>), and the analysis
   keeps the best one per (variant, size, budget, seed) with `best_lr_points`.
5. Batch (`batch:`), one of
   - compute (default): B = coef x C^exponent tokens, coef 0.292, exponent 0.3271: DeepSeek LLM
     (same section, eq. 1). Their FLOPs/token leave out the embedding (their sec. 3.2); ours also
     count the LM head, 10-20% more at 150M-1B with a 32K vocabulary (~5% more batch at the 0.33
     power). Rounded to the nearest multiple (at least one) of
     train.micro_batch_size x data-parallel ranks (`batch.data_parallel`; default the ranks of the
     spec's sbatch resources: --ntasks, or --nodes x --ntasks-per-node, over parallel.tp).
   - fixed: the config's train.global_batch_size.
6. Schedule (`schedule:`): optim.warmup_steps = max(min_warmup_steps, round(warmup_fraction x steps)),
   warmup_fraction default 0.05, so warm-up scales with each run instead of a fixed step count
   (a fixed warm-up is a larger share of the short, small-model runs; Porian et al. 2024, "Resolving
   Discrepancies in Compute-Optimal Scaling of Language Models", name warm-up duration as one of
   the causes of the Kaplan/Chinchilla disagreement); optim.decay_fraction =
   `decay_fraction` when given (the final decay of the wsd schedule). Cosine decays from the end of
   warm-up to min_lr at each run's own last step: Chinchilla found a cosine cycle longer than the
   run costs loss (Hoffmann et al. 2022, fig. A1).

The planner (megaroute/sweep/plan.py) refuses, naming the point and the reason, a point that ends
inside its warm-up, has fewer than `min_tokens_per_param` tokens per parameter (default 2 with a
design), misses its shape target by more than the tolerance, or misses its budget by more than
`budget_tolerance`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Sequence

from ..config import ModelConfig, RoutingConfig
from ..flops import flops_per_token


# ---- spec sections (defaults are the documented constants) ----

@dataclass(frozen=True)
class ShapeRule:
    d_multiple: int = 64
    head_dim: int = 64
    aspect: float = 48.0            # preferred d_model / n_layers (configs/dense_157m.yaml, dense_1b.yaml: 48)
    aspect_range: tuple[float, float] = (24.0, 96.0)
    min_layers: int = 4
    tolerance: float = 0.03         # |N / target - 1| allowed
    # [lo, hi]: d_ff free in lo..hi x d_model (multiples of model.ffn_multiple_of), chosen to hit the target;
    # None: the config's FFN (8/3 d_model rounded up). For tiny models, where one layer is 10-25% of N.
    ffn_ratio: Optional[tuple[float, float]] = None


FFN_RATIO = 8 / 3   # SwiGLU's usual hidden / d_model (megaroute.config.ModelConfig.ffn_hidden)


@dataclass(frozen=True)
class Design:
    sizes: int = 5
    span: float = 4.0
    tokens_per_param: float = 20.0
    shape: ShapeRule = field(default_factory=ShapeRule)


@dataclass(frozen=True)
class LrRule:
    rule: str = "width"             # width | compute
    base: float = 6.0e-4            # width: lr at d_ref
    d_ref: int = 768
    power: float = 1.0
    coef: float = 0.3118            # compute: DeepSeek LLM eq. 1
    exponent: float = -0.125
    min_lr_ratio: float = 0.1

    def lr(self, d_model: int, budget: float) -> float:
        if self.rule == "width":
            return self.base * (self.d_ref / d_model) ** self.power
        return self.coef * budget ** self.exponent


@dataclass(frozen=True)
class BatchRule:
    rule: str = "compute"           # compute | fixed
    coef: float = 0.292             # compute: tokens per step = coef x C^exponent (DeepSeek LLM eq. 1)
    exponent: float = 0.3271
    data_parallel: Optional[int] = None   # None: from the spec's sbatch resources

    def tokens(self, budget: float) -> float:
        return self.coef * budget ** self.exponent

    def sequences(self, budget: float, seq_len: int, multiple: int) -> int:
        """Sequences per optimizer step: the rule's tokens over seq_len, to the nearest multiple of `multiple`."""
        return max(1, round(self.tokens(budget) / seq_len / multiple)) * multiple


@dataclass(frozen=True)
class Schedule:
    warmup_fraction: float = 0.05
    min_warmup_steps: int = 0
    decay_fraction: Optional[float] = None   # -> optim.decay_fraction (wsd)

    def warmup_steps(self, steps: int) -> int:
        return max(self.min_warmup_steps, round(self.warmup_fraction * steps))


LR_RULES = ("width", "compute")
BATCH_RULES = ("compute", "fixed")
LR_KEYS = {"width": {"rule", "base", "d_ref", "power", "min_lr_ratio"},
           "compute": {"rule", "coef", "exponent", "min_lr_ratio"}}
BATCH_KEYS = {"compute": {"rule", "coef", "exponent", "data_parallel"}, "fixed": {"rule", "data_parallel"}}


def decay_steps(schedule: str, decay_fraction: float, warmup: int, steps: int) -> int:
    """Steps of the run spent decaying the LR, as megaroute.train.optim.lr_lambda schedules them."""
    if schedule == "constant":
        return 0
    if schedule == "wsd":
        return steps - max(warmup, int(steps * (1 - decay_fraction)))
    return max(0, steps - warmup)


def sbatch_ranks(sbatch: Sequence[str]) -> Optional[int]:
    """Ranks an array task gets from its sbatch options (--ntasks, or --nodes x --ntasks-per-node)."""
    opts = {}
    for o in sbatch:
        m = re.fullmatch(r"--(ntasks|nodes|ntasks-per-node)=(\d+)", o)
        if m:
            opts[m.group(1)] = int(m.group(2))
    if "ntasks" in opts:
        return opts["ntasks"]
    if "ntasks-per-node" in opts:
        return opts.get("nodes", 1) * opts["ntasks-per-node"]
    return None


# ---- shapes ----

@dataclass(frozen=True)
class Shape:
    d_model: int
    n_layers: int
    n_heads: int
    n_params: int        # total, dense count (megaroute.model: no routers); the plan checks the real model
    d_ff: Optional[int] = None   # set by a rule with shape.ffn_ratio; None: the config's FFN rule

    @property
    def name(self) -> str:
        return f"d{self.d_model}l{self.n_layers}" + (f"f{self.d_ff}" if self.d_ff is not None else "")

    @property
    def aspect(self) -> float:
        return self.d_model / self.n_layers

    def overrides(self) -> list[str]:
        return [f"model.d_model={self.d_model}", f"model.n_layers={self.n_layers}", f"model.n_heads={self.n_heads}",
                *([f"model.d_ff={self.d_ff}"] if self.d_ff is not None else [])]

    def model(self, base: ModelConfig) -> ModelConfig:
        return replace(base, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                       **({"d_ff": self.d_ff} if self.d_ff is not None else {}))


def dense_params(model: ModelConfig) -> int:
    """Total parameters of megaroute's dense transformer (tests/unit/sweep/test_design.py checks it against
    build_model): embedding (+ untied LM head), per layer q/k/v/o (4 d^2), SwiGLU (3 d f), two RMSNorm
    gains, and the final norm."""
    d, f = model.d_model, model.ffn_hidden
    embed = model.vocab_size * d * (1 if model.tie_embeddings else 2)
    return embed + d + model.n_layers * (4 * d * d + 3 * d * f + 2 * d)


def _candidates(base: ModelConfig, rule: ShapeRule, target: float, band: float):
    """(d_model, n_layers, d_ff or None, total params) of the rule near `target`: per d_model and n_layers
    the d_ff nearest the target (shape.ffn_ratio) or the config's FFN, and per d_model only the depths
    within `band` of the target plus the nearest one on each side (fixed FFN)."""
    lo_aspect, hi_aspect = rule.aspect_range
    embed = (1 if base.tie_embeddings else 2) * base.vocab_size
    m = base.ffn_multiple_of
    d = rule.d_multiple
    while True:
        l_min = max(rule.min_layers, math.ceil(d / hi_aspect))
        l_max = max(l_min, math.floor(d / lo_aspect))
        fixed = embed * d + d
        if rule.ffn_ratio is None:
            f = replace(base, d_model=d).ffn_hidden
            per_layer = 4 * d * d + 3 * d * f + 2 * d
            if fixed + l_min * per_layer > 2 * target:
                return
            ideal = (target - fixed) / per_layer
            layers = {math.floor(ideal), math.ceil(ideal),
                      *range(math.floor(ideal * (1 - band)), math.ceil(ideal * (1 + band)) + 1)}
            for n_layers in {min(l_max, max(l_min, n)) for n in layers}:
                yield d, n_layers, None, fixed + n_layers * per_layer
        else:
            f_lo, f_hi = m * math.ceil(rule.ffn_ratio[0] * d / m), m * math.floor(rule.ffn_ratio[1] * d / m)
            if f_lo > f_hi:
                d += rule.d_multiple
                continue
            if fixed + l_min * (4 * d * d + 3 * d * f_lo + 2 * d) > 2 * target:
                return
            for n_layers in range(l_min, l_max + 1):
                exact = (target - fixed - n_layers * (4 * d * d + 2 * d)) / (3 * d * n_layers)
                for f in {min(f_hi, max(f_lo, m * rnd(exact / m))) for rnd in (math.floor, math.ceil)}:
                    yield d, n_layers, f, fixed + n_layers * (4 * d * d + 3 * d * f + 2 * d)
        d += rule.d_multiple


def nearest_shape(base: ModelConfig, rule: ShapeRule, target: float) -> Optional[Shape]:
    """The rule's shape for a target total parameter count (module docstring, rule 3); None when even the
    smallest shape of the rule is more than twice the target."""
    band = rule.tolerance / 2
    best, near = None, []
    for d, n_layers, f, n in _candidates(base, rule, target, band):
        shape = Shape(d, n_layers, d // rule.head_dim, n, f)
        err = abs(math.log(n / target))
        if best is None or err < best[0]:
            best = (err, shape)
        if abs(n / target - 1) <= band:
            near.append(shape)
    if near:
        return min(near, key=lambda s: (abs(math.log(s.aspect / rule.aspect)),
                                        0.0 if s.d_ff is None else abs(math.log(s.d_ff / s.d_model / FFN_RATIO)),
                                        abs(math.log(s.n_params / target))))
    return best[1] if best else None


def smallest_shape(base: ModelConfig, rule: ShapeRule) -> Shape:
    d, n_layers = rule.d_multiple, max(rule.min_layers, math.ceil(rule.d_multiple / rule.aspect_range[1]))
    f = None
    if rule.ffn_ratio is not None:
        m = base.ffn_multiple_of
        while (f := m * math.ceil(rule.ffn_ratio[0] * d / m)) > rule.ffn_ratio[1] * d:
            d += rule.d_multiple
    shape = Shape(d, n_layers, d // rule.head_dim, 0, f)
    return replace(shape, n_params=dense_params(shape.model(base)))


# ---- the prior optimum and the grid ----

@dataclass(frozen=True)
class GridPoint:
    target: float        # target total parameters
    shape: Shape


@dataclass(frozen=True)
class Grid:
    budget: float
    n_star: float        # prior compute-optimal total parameters at this budget
    flops_per_token: Callable[[Shape], float] = field(repr=False, compare=False, default=None)
    points: tuple[GridPoint, ...] = ()


def prior_optimum(budget: float, design: Design, base: ModelConfig,
                  fpt: Callable[[Shape], float]) -> Optional[float]:
    """N* with C = fpt(shape(N)) x tokens_per_param x N, the shape's FLOPs per parameter carried over to N
    so the function is continuous between shapes; None when it lies below the rule's smallest shape."""
    r = design.tokens_per_param

    def compute(n: float) -> float:
        shape = nearest_shape(base, design.shape, n)
        return r * n * n * fpt(shape) / shape.n_params

    lo = smallest_shape(base, design.shape).n_params
    if compute(lo) > budget:
        return None
    hi = lo
    while compute(hi) < budget:
        hi *= 4
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if compute(mid) < budget else (lo, mid)
        if hi / lo < 1 + 1e-6:
            break
    return math.sqrt(lo * hi)


def grid_targets(n_star: float, design: Design) -> list[float]:
    k = design.sizes
    return [n_star * design.span ** (i / (k - 1) - 0.5) for i in range(k)]


def design_grid(budget: float, design: Design, base: ModelConfig, routing: RoutingConfig,
                seq_len: int) -> Optional[Grid]:
    """The prior optimum and the shapes of one (budget, variant); None when N* is below the smallest shape."""
    cache: dict[Shape, float] = {}

    def fpt(shape: Shape) -> float:
        if shape not in cache:
            cache[shape] = flops_per_token(shape.model(base), routing, seq_len, training=True)
        return cache[shape]

    n_star = prior_optimum(budget, design, base, fpt)
    if n_star is None:
        return None
    points = tuple(GridPoint(t, nearest_shape(base, design.shape, t)) for t in grid_targets(n_star, design))
    return Grid(budget, n_star, fpt, points)


# ---- learning-rate sweep selection (for the analysis) ----

@dataclass(frozen=True)
class LrChoice:
    """The learning-rate multiplier kept for one (variant, size, budget, seed)."""
    variant: str
    size: str
    budget: float
    seed: int
    lr_mult: float                       # chosen
    losses: tuple[tuple[float, float], ...]   # (multiplier, loss) of every finished run, by multiplier

    @property
    def at_edge(self) -> bool:
        """The best multiplier is the smallest or largest tried: the sweep did not bracket the best LR."""
        mults = [m for m, _ in self.losses]
        return len(mults) > 1 and self.lr_mult in (min(mults), max(mults))

    def as_row(self) -> dict[str, Any]:
        return {"variant": self.variant, "size": self.size, "budget": self.budget, "seed": self.seed,
                "lr_mult": self.lr_mult, "at_edge": self.at_edge,
                "tried": " ".join(f"{m:g}:{loss:.4f}" for m, loss in self.losses)}


def _field(row: Any, name: str, default: Any = None) -> Any:
    if isinstance(row, dict):
        return row.get(name, default)
    return getattr(row, name, default)


def best_lr_points(rows: Iterable[Any], loss: str = "val_loss") -> tuple[list[Any], list[LrChoice]]:
    """Keeps, per (variant, size, budget, seed), the row with the lowest loss over its lr multipliers.

    rows: objects or dicts with `variant`, `size`, `budget`, `seed`, `lr_mult` (missing or None: 1.0, a
    sweep without `lr_sweep`) and the loss under the name `loss` (default "val_loss", as
    megaroute.sweep.mlflow_runs.RunResult has it; "loss" for dicts of that name). Rows whose loss is None
    or not finite are dropped (the caller lists them as left out). Returns (kept rows in input order,
    one LrChoice per group): the isoFLOP fit then sees one loss per (size, seed), and the choices (with
    `at_edge` warnings) go into the report. Ties keep the multiplier nearest 1.
    """
    groups: dict[tuple, list[tuple[int, float, float, Any]]] = {}
    for i, row in enumerate(rows):
        value = _field(row, loss)
        if value is None or not math.isfinite(float(value)):
            continue
        mult = _field(row, "lr_mult")
        mult = 1.0 if mult in (None, "") else float(mult)
        key = (_field(row, "variant"), _field(row, "size"), float(_field(row, "budget")), int(_field(row, "seed")))
        groups.setdefault(key, []).append((i, mult, float(value), row))
    kept, choices = [], []
    for key, members in groups.items():
        i, mult, _, row = min(members, key=lambda m: (m[2], abs(math.log(m[1])) if m[1] > 0 else math.inf))
        kept.append((i, row))
        choices.append(LrChoice(*key, mult, tuple(sorted((m[1], m[2]) for m in members))))
    return [row for _, row in sorted(kept, key=lambda x: x[0])], choices
