"""A sweep's runs faked in a real (SQLite) MLflow store, as the point runs tag and log them."""

from __future__ import annotations

from typing import Optional

import numpy as np


def store(tmp_path, experiment: str = "exp"):
    """(uri, client, experiment id) of a fresh SQLite store with file artifacts under tmp_path."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment(experiment, artifact_location=f"file://{tmp_path}/artifacts")
    return uri, client, exp


def parent_run(client, exp: str, sweep: str, points: Optional[int] = None) -> str:
    run_id = client.create_run(exp, run_name=sweep, tags={"sweep_id": sweep, "sweep_role": "parent"}).info.run_id
    if points is not None:
        client.log_param(run_id, "points", str(points))
    return run_id


def point_run(client, exp: str, sweep: str, parent: Optional[str], variant: str, size: str, budget: float,
              n_params: int, seed: int, loss: Optional[float], status: str = "FINISHED", routing: str = "none",
              name: Optional[str] = None, metrics: Optional[dict] = None, tags: Optional[dict] = None) -> str:
    tags = {"sweep_id": sweep, "variant": variant, "size": size, "budget": f"{budget:.3g}", "seed": str(seed),
            "n_params": str(n_params), "routing": routing, **(tags or {})}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run_id = client.create_run(exp, run_name=name or f"{sweep}-{variant}-{size}-C{budget:.0e}-s{seed}",
                               tags=tags).info.run_id
    if loss is not None:
        client.log_metric(run_id, "eval/loss", loss)
    for k, v in (metrics or {}).items():
        client.log_metric(run_id, k, v)
    client.set_terminated(run_id, status)
    return run_id


SIZES = {"s": 1e8, "m": 2e8, "l": 4e8, "xl": 8e8, "xxl": 1.6e9}


def parabola(n: float, n_opt: float, l_opt: float, curvature: float = 0.3) -> float:
    return l_opt + curvature * (np.log10(n) - np.log10(n_opt)) ** 2


def sweep(client, exp: str, name: str = "sw", budgets=(1e19, 1e20), seeds=(0,), routed_gain: float = 0.05,
          parent: bool = True, noise: float = 0.0, failed: tuple = ()) -> Optional[str]:
    """dense and mod at every budget, five sizes each, optimum inside the grid (N* = 3e8 x (C/1e19)^0.5 ...
    kept inside by the sizes); mod's loss is `routed_gain` lower everywhere. `failed`: (variant, size, budget,
    seed) points that end FAILED without a loss."""
    parent_id = parent_run(client, exp, name, points=2 * len(budgets) * len(SIZES) * len(seeds)) if parent else None
    rng = np.random.default_rng(0)
    for b in budgets:
        n_opt = 3e8 * (b / 1e19) ** 0.25
        for size, n in SIZES.items():
            for seed in seeds:
                for variant, gain, routing in (("dense", 0.0, "none"), ("mod", routed_gain, "mod")):
                    loss = parabola(n, n_opt, 3.0 - 0.1 * np.log10(b / 1e19)) - gain + rng.normal(0, noise)
                    if (variant, size, b, seed) in failed:
                        point_run(client, exp, name, parent_id, variant, size, b, int(n), seed, None, "FAILED",
                                  routing)
                    else:
                        point_run(client, exp, name, parent_id, variant, size, b, int(n), seed, float(loss),
                                  routing=routing, metrics={"val/loss_topk": float(loss) - 0.2} if gain else None)
    return parent_id
