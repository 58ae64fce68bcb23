"""isoFLOP analysis: per budget and variant, loss vs log10(parameters) -> loss-optimal size.

For each (variant, budget) the final validation losses are fit with a parabola in
x = log10(N) (Chinchilla's approach 2); its vertex is the loss-optimal size N* and loss L*.
When the vertex is not a minimum inside the measured sizes, or there are fewer than three
sizes, the best measured point is reported instead (`fit` says which). With several seeds,
seeds are resampled per size (bootstrap) and the fit repeated, giving a 90% interval.
The compute-optimal frontier is the least-squares line log10 N* = a log10 C + b per variant.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 1000


@dataclass(frozen=True)
class OptimumFit:
    variant: str
    budget: float
    n_opt: float
    loss_opt: float
    fit: str                    # "parabola" | "best measured"
    coeffs: Optional[tuple[float, float, float]]  # a, b, c of a x^2 + b x + c, x = log10 N
    n_interval: Optional[tuple[float, float]] = None
    loss_interval: Optional[tuple[float, float]] = None
    points: int = 0


def fit_optimum(params: Sequence[float], losses: Sequence[float]) -> tuple[float, float, str, Optional[tuple]]:
    """(N*, L*, how, coeffs) from one isoFLOP slice; losses are per size (seed means)."""
    n = np.asarray(params, dtype=float)
    x = np.log10(n)
    y = np.asarray(losses, dtype=float)
    best = int(np.argmin(y))
    if len(np.unique(x)) >= 3:
        a, b, c = np.polyfit(x, y, 2)
        if a > 0:
            xv = -b / (2 * a)
            if x.min() <= xv <= x.max():
                return float(10 ** xv), float(c - b * b / (4 * a)), "parabola", (float(a), float(b), float(c))
        return float(n[best]), float(y[best]), "best measured", (float(a), float(b), float(c))
    return float(n[best]), float(y[best]), "best measured", None


def bootstrap(by_size: dict[float, list[float]], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0):
    """90% intervals of (N*, L*) from resampling the seeds of every size with replacement."""
    rng = np.random.default_rng(seed)
    params = sorted(by_size)
    ns, ls = [], []
    for _ in range(samples):
        means = [float(np.mean(rng.choice(by_size[p], size=len(by_size[p])))) for p in params]
        n, loss, _, _ = fit_optimum(params, means)
        ns.append(n)
        ls.append(loss)
    return tuple(np.percentile(ns, [5, 95])), tuple(np.percentile(ls, [5, 95]))


def isoflop_fits(rows: Sequence[tuple[str, float, int, int, float]]) -> list[OptimumFit]:
    """rows: (variant, budget, n_params, seed, final val loss) -> one fit per (variant, budget)."""
    groups: dict[tuple[str, float], dict[float, list[float]]] = {}
    for variant, budget, n_params, _seed, loss in rows:
        groups.setdefault((variant, budget), {}).setdefault(float(n_params), []).append(float(loss))
    fits = []
    for (variant, budget), by_size in sorted(groups.items()):
        params = sorted(by_size)
        n, loss, how, coeffs = fit_optimum(params, [float(np.mean(by_size[p])) for p in params])
        n_iv = l_iv = None
        if any(len(v) > 1 for v in by_size.values()):
            n_iv, l_iv = bootstrap(by_size)
        fits.append(OptimumFit(variant, budget, n, loss, how, coeffs, n_iv, l_iv,
                               sum(len(v) for v in by_size.values())))
    return fits


@dataclass(frozen=True)
class Frontier:
    variant: str
    exponent: float     # a in N* = k C^a
    coefficient: float  # k

    def n_opt(self, budget: float) -> float:
        return self.coefficient * budget ** self.exponent


def frontiers(fits: Sequence[OptimumFit]) -> list[Frontier]:
    """N*(C) = k C^a per variant with at least two budgets."""
    out = []
    for variant in sorted({f.variant for f in fits}):
        mine = [f for f in fits if f.variant == variant]
        if len({f.budget for f in mine}) < 2:
            continue
        a, b = np.polyfit(np.log10([f.budget for f in mine]), np.log10([f.n_opt for f in mine]), 1)
        out.append(Frontier(variant, float(a), float(10 ** b)))
    return out


# ---- reports ----

def _interval(iv: Optional[tuple[float, float]], fmt: str) -> str:
    return "" if iv is None else f"[{iv[0]:{fmt}}, {iv[1]:{fmt}}]"


def table_rows(fits: Sequence[OptimumFit]) -> list[dict[str, str]]:
    return [{"variant": f.variant, "budget": f"{f.budget:.3g}", "n_opt": f"{f.n_opt:.4g}",
             "n_opt_90ci": _interval(f.n_interval, ".4g"), "loss_opt": f"{f.loss_opt:.4f}",
             "loss_opt_90ci": _interval(f.loss_interval, ".4f"), "fit": f.fit, "runs": str(f.points)} for f in fits]


def write_csv(path: str, fits: Sequence[OptimumFit]) -> None:
    rows = table_rows(fits)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["variant"])
        w.writeheader()
        w.writerows(rows)


def markdown(sweep: str, fits: Sequence[OptimumFit], fronts: Sequence[Frontier], skipped: Sequence[str],
             loss: str = "eval/loss") -> str:
    rows = table_rows(fits)
    head = ["variant", "budget (FLOPs)", "N* (params)", "N* 90% CI", "L* (loss)", "L* 90% CI", "fit", "runs"]
    lines = [f"# isoFLOP analysis: {sweep}", "", f"Loss: final {loss} of each run.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
    if fronts:
        lines += ["", "## Compute-optimal frontier N*(C) = k C^a", "", "| variant | a | k |", "|---|---|---|"]
        lines += [f"| {fr.variant} | {fr.exponent:.3f} | {fr.coefficient:.4g} |" for fr in fronts]
    if skipped:
        lines += ["", "## Runs left out", ""] + [f"- {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def plot_isoflops(path: str, rows, fits: Sequence[OptimumFit]) -> None:
    """One panel per variant: loss vs params per budget, the fitted parabola and its optimum."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    variants = sorted({r[0] for r in rows})
    budgets = sorted({r[1] for r in rows})
    fig = Figure(figsize=(5 * len(variants), 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(variants), squeeze=False, sharey=True)[0]
    colors = {b: c for b, c in zip(budgets, _colors(len(budgets)))}
    for ax, variant in zip(axes, variants):
        for b in budgets:
            pts = [(r[2], r[4]) for r in rows if r[0] == variant and r[1] == b]
            if not pts:
                continue
            ax.scatter(*zip(*pts), color=colors[b], label=f"C={b:.2g}")
            fit = next((f for f in fits if f.variant == variant and f.budget == b), None)
            if fit and fit.coeffs:
                xs = np.linspace(math.log10(min(p for p, _ in pts)), math.log10(max(p for p, _ in pts)), 50)
                ax.plot(10 ** xs, np.polyval(fit.coeffs, xs), color=colors[b], lw=1)
            if fit:
                ax.scatter([fit.n_opt], [fit.loss_opt], color=colors[b], marker="*", s=150, edgecolor="k")
        ax.set(xscale="log", xlabel="parameters", title=variant)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("final validation loss")
    fig.savefig(path, dpi=100)


def plot_frontier(path: str, fits: Sequence[OptimumFit], fronts: Sequence[Frontier]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    variants = sorted({f.variant for f in fits})
    for variant, color in zip(variants, _colors(len(variants))):
        mine = sorted((f.budget, f.n_opt) for f in fits if f.variant == variant)
        ax.scatter(*zip(*mine), color=color, label=variant)
        front = next((fr for fr in fronts if fr.variant == variant), None)
        if front:
            cs = np.geomspace(mine[0][0], mine[-1][0], 20)
            ax.plot(cs, front.n_opt(cs), color=color, lw=1, label=f"{variant}: N* ∝ C^{front.exponent:.2f}")
    ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="loss-optimal parameters N*")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def _colors(n: int):
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1) * 0.85) for i in range(n)]
