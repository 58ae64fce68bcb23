"""Sweep spec: the YAML file that describes an isoFLOP sweep (configs/sweeps/*.yaml).

    name: isoflop-v1                 # sweep id: tags every run, names run directories
    experiment: isoflop              # MLflow experiment of all runs and the parent run
    budgets: [1.0e19, 3.0e19]        # training FLOPs per run
    sizes: {157m: [], 350m: []}      # size name -> overrides ({size} fills variant config paths)
    variants:                        # variant name -> base config (+ overrides)
      dense: {config: ../dense_{size}.yaml}
      mod:   {config: ../mod_{size}.yaml, overrides: [routing.capacity=0.125]}
    seeds: [0]
    overrides: [tracking.uri=http://mlflow:5000]   # applied to every point
    gpu: a100                        # slurm/pretrain.sh --gpu: a100 (bf16), v100 (fp16), cpu
    sbatch: [--nodes=1, --ntasks-per-node=8, --gpus-per-node=8]   # resources of one array task
    mfu: 0.4                         # assumed utilisation for the GPU-hour estimate

Paths are relative to the spec file. Unknown keys are errors, like in run configs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import yaml

from ..config import ConfigError

GPUS = ("a100", "v100", "cpu")


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
    sizes: dict[str, tuple[str, ...]]
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...] = (0,)
    overrides: tuple[str, ...] = ()
    runs_dir: Optional[str] = None
    gpu: str = "a100"
    sbatch: tuple[str, ...] = ()
    mfu: float = 0.4
    # How far tokens x FLOPs/token may miss a budget (whole optimizer steps quantize tokens).
    budget_tolerance: float = 0.01

    @property
    def run_root(self) -> str:
        return self.runs_dir or os.path.join("runs", self.name)


_KEYS = {"name", "experiment", "budgets", "sizes", "variants", "seeds", "overrides", "runs_dir", "gpu", "sbatch",
         "mfu", "budget_tolerance"}


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
    sizes = need("sizes")
    if not isinstance(sizes, dict) or not sizes:
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
    runs_dir = raw.get("runs_dir")
    return SweepSpec(
        path=os.path.abspath(path), name=name, experiment=str(raw.get("experiment", name)),
        budgets=tuple(budgets), sizes={str(s): tuple(ov or ()) for s, ov in sizes.items()},
        variants=tuple(variants), seeds=tuple(seeds),
        overrides=tuple(_check_overrides(path, "overrides", raw.get("overrides", []))),
        runs_dir=runs_dir, gpu=gpu, sbatch=tuple(_check_overrides(path, "sbatch", raw.get("sbatch", []), "--")),
        mfu=float(mfu), budget_tolerance=float(tol),
    )


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
