"""isoFLOP analysis: per budget and variant, loss vs log10(parameters) -> loss-optimal size.

For each (variant, budget) the final validation losses are fit with a parabola in
x = log10(N) (Chinchilla's approach 2); its vertex is the loss-optimal size N* and loss L*.
When the vertex is not a minimum inside the measured sizes, or there are fewer than three
sizes, the best measured point is reported instead (`fit` says which, `note` why): that is a
grid point, not an optimum. With at least MIN_BOOTSTRAP_SEEDS seeds at every size, seeds are
resampled per size (bootstrap) and the fit repeated, giving a 90% interval; with fewer there is
none (a percentile bootstrap over two seeds never leaves their range: it would claim a precision
the runs do not have), and the table says how many seeds there were.

The compute-optimal frontier is the least-squares line log10 N* = a log10 C + b per variant,
through interior minima only (a grid-edge "best measured" N* would pin the exponent to the
grid); with fewer than two budgets that have one, there is no frontier and the table says so.

Routed vs dense (`differences`): per budget, the difference of fitted optimum losses
L*(routed) - L*(dense), each seed's L* from its own parabola, paired by seed, with a
Student-t interval over seeds (megaroute.audit.analysis.t_interval); and the difference at one
size both variants measured (the one nearest dense's N*), paired by seed the same way.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..audit.analysis import t_interval

BOOTSTRAP_SAMPLES = 1000
MIN_BOOTSTRAP_SEEDS = 3
PARABOLA, BEST_MEASURED = "parabola", "best measured"
DIFF_CONFIDENCE = 0.95


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
    note: str = ""              # why a fit is "best measured"
    seeds: int = 1              # the fewest seeds at any size (intervals need MIN_BOOTSTRAP_SEEDS)

    @property
    def interior(self) -> bool:
        """The optimum is a parabola vertex inside the measured sizes (not a grid point)."""
        return self.fit == PARABOLA


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
                return float(10 ** xv), float(c - b * b / (4 * a)), PARABOLA, (float(a), float(b), float(c))
        return float(n[best]), float(y[best]), BEST_MEASURED, (float(a), float(b), float(c))
    return float(n[best]), float(y[best]), BEST_MEASURED, None


def why_not_interior(params: Sequence[float], coeffs: Optional[tuple]) -> str:
    """The reason a slice's fit fell back to the best measured point."""
    if coeffs is None:
        return f"{len(set(params))} size(s): a parabola needs 3"
    a, b, _ = coeffs
    if a <= 0:
        return "no minimum (the parabola opens downward)"
    xv = -b / (2 * a)
    side = "largest" if xv > math.log10(max(params)) else "smallest"
    return f"vertex beyond the {side} size: the optimum is outside the grid"


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
        seeds = min(len(v) for v in by_size.values())
        n_iv, l_iv = bootstrap(by_size) if seeds >= MIN_BOOTSTRAP_SEEDS else (None, None)
        fits.append(OptimumFit(variant, budget, n, loss, how, coeffs, n_iv, l_iv,
                               sum(len(v) for v in by_size.values()),
                               "" if how == PARABOLA else why_not_interior(params, coeffs), seeds))
    return fits


@dataclass(frozen=True)
class Frontier:
    variant: str
    exponent: Optional[float]     # a in N* = k C^a; None: refused (fewer than 2 interior minima)
    coefficient: Optional[float]  # k
    interior: int = 0             # budgets with an interior minimum: the points of the fit
    budgets: int = 0              # budgets the variant was fitted at

    @property
    def fitted(self) -> bool:
        return self.exponent is not None

    def n_opt(self, budget: float) -> float:
        return self.coefficient * budget ** self.exponent

    def summary(self) -> str:
        used = f"{self.interior} of {self.budgets} budgets with an interior minimum"
        if self.fitted:
            return f"fit through {used}"
        return f"no fit: {used} (needs 2; widen the size grid around the best sizes)"


def frontiers(fits: Sequence[OptimumFit]) -> list[Frontier]:
    """N*(C) = k C^a per variant, through the budgets whose optimum is a parabola vertex inside the
    measured sizes; a variant with fewer than two such budgets gets a refusal (exponent None)."""
    out = []
    for variant in sorted({f.variant for f in fits}):
        mine = [f for f in fits if f.variant == variant]
        inside = [f for f in mine if f.interior]
        budgets, n_inside = len({f.budget for f in mine}), len({f.budget for f in inside})
        if n_inside < 2:
            out.append(Frontier(variant, None, None, n_inside, budgets))
            continue
        a, b = np.polyfit(np.log10([f.budget for f in inside]), np.log10([f.n_opt for f in inside]), 1)
        out.append(Frontier(variant, float(a), float(10 ** b), n_inside, budgets))
    return out


# ---- routed vs dense ----

@dataclass(frozen=True)
class Difference:
    """One routed variant minus the dense baseline at one budget; `stats` are t_interval's dicts of the
    paired per-seed differences (n, mean, ci_low, ci_high, note), None where refused (`*_note` says why)."""
    variant: str
    baseline: str
    budget: float
    optimum: Optional[dict]          # L*(variant) - L*(baseline), each seed's L* from its own parabola
    optimum_note: str
    size: Optional[str]              # the matched size: measured by both, nearest baseline's N*
    at_size: Optional[dict]          # loss(variant, size) - loss(baseline, size)
    size_note: str
    left_out: list[str] = field(default_factory=list)


def differences(rows: Sequence[tuple[str, float, str, int, int, float]], baseline: str,
                fits: Sequence[OptimumFit], confidence: float = DIFF_CONFIDENCE) -> list[Difference]:
    """rows: (variant, budget, size name, n_params, seed, final loss), one per run. For every other
    variant and every budget both have: paired-by-seed differences to `baseline` at the fitted optimum
    and at the matched size, each with a Student-t interval over seeds (none with one seed)."""
    # (variant, budget) -> seed -> [(n_params, size, loss)]
    slices: dict[tuple[str, float], dict[int, list[tuple[float, str, float]]]] = {}
    for variant, budget, size, n_params, seed, loss in rows:
        slices.setdefault((variant, budget), {}).setdefault(seed, []).append((float(n_params), size, float(loss)))
    fit_of = {(f.variant, f.budget): f for f in fits}
    out = []
    for (variant, budget) in sorted(slices):
        if variant == baseline or (baseline, budget) not in slices:
            continue
        mine, base = slices[variant, budget], slices[baseline, budget]
        seeds = sorted(set(mine) & set(base))
        left_out = [f"{v} seed {s}: no {other} run with that seed"
                    for v, own, other_runs, other in ((variant, mine, base, baseline), (baseline, base, mine, variant))
                    for s in sorted(set(own) - set(other_runs))]

        # Fitted optima, paired by seed.
        diffs, edge = [], []
        for s in seeds:
            opt = {}
            for v, runs in ((variant, mine[s]), (baseline, base[s])):
                params = [p for p, _, _ in runs]
                _, loss, how, coeffs = fit_optimum(params, [l for _, _, l in runs])
                if how == PARABOLA:
                    opt[v] = loss
                else:
                    edge.append(f"{v} seed {s}: {why_not_interior(params, coeffs)}")
            if len(opt) == 2:
                diffs.append(opt[variant] - opt[baseline])
        if diffs:
            optimum, note = t_interval(diffs, confidence), ""
        else:
            optimum, note = None, "no fit: no seed with an interior minimum for both"
        if edge:
            note = "; ".join(filter(None, [note, "left out (L* not a fitted optimum): " + "; ".join(edge)]))

        # Matched size: measured by both for the same seeds, nearest the baseline's N* (log scale).
        size, at_size, size_note = None, None, ""
        common = {}
        for s in seeds:
            a = {sz: l for _, sz, l in mine[s]}
            b = {sz: (p, l) for p, sz, l in base[s]}
            for sz in set(a) & set(b):
                common.setdefault(sz, []).append((b[sz][0], a[sz] - b[sz][1]))
        base_fit = fit_of.get((baseline, budget))
        if common and base_fit is not None:
            size = min(common, key=lambda sz: abs(math.log10(common[sz][0][0]) - math.log10(base_fit.n_opt)))
            at_size = t_interval([d for _, d in common[size]], confidence)
        else:
            size_note = "no size measured by both"
        out.append(Difference(variant, baseline, budget, optimum, note, size, at_size, size_note, left_out))
    return out


def _stat(st: Optional[dict]) -> tuple[str, str, str]:
    """(mean, interval, n) cells of a t_interval dict; one seed gets "n=1, no interval"."""
    if st is None:
        return "—", "—", "0"
    if st["n"] < 2:
        return f"{st['mean']:+.4f}", f"n={st['n']}, no interval", str(st["n"])
    iv = f"[{st['ci_low']:+.4f}, {st['ci_high']:+.4f}]"
    return f"{st['mean']:+.4f}", iv + (f" ({st['note']})" if st.get("note") else ""), str(st["n"])


def difference_rows(diffs: Sequence[Difference]) -> list[dict[str, str]]:
    out = []
    for d in diffs:
        opt, opt_iv, opt_n = _stat(d.optimum)
        at, at_iv, at_n = _stat(d.at_size)
        out.append({"budget": f"{d.budget:.3g}", "variant": d.variant, "baseline": d.baseline,
                    "delta_L_opt": opt, "delta_L_opt_ci": opt_iv, "delta_L_opt_seeds": opt_n,
                    "matched_size": d.size or "—", "delta_L_size": at, "delta_L_size_ci": at_iv,
                    "delta_L_size_seeds": at_n,
                    "note": "; ".join(filter(None, [d.optimum_note, d.size_note, *d.left_out]))})
    return out


# ---- reports ----

def _interval(iv: Optional[tuple[float, float]], fmt: str, seeds: int) -> str:
    if iv is None:
        return f"{seeds} seed{'s' if seeds != 1 else ''} at a size: no interval"
    return f"[{iv[0]:{fmt}}, {iv[1]:{fmt}}]"


def table_rows(fits: Sequence[OptimumFit]) -> list[dict[str, str]]:
    return [{"variant": f.variant, "budget": f"{f.budget:.3g}", "n_opt": f"{f.n_opt:.4g}",
             "n_opt_90ci": _interval(f.n_interval, ".4g", f.seeds), "loss_opt": f"{f.loss_opt:.4f}",
             "loss_opt_90ci": _interval(f.loss_interval, ".4f", f.seeds),
             "fit": f.fit + (f" ({f.note})" if f.note else ""), "runs": str(f.points)} for f in fits]


def write_csv(path: str, fits: Sequence[OptimumFit]) -> None:
    _write_rows(path, table_rows(fits), ["variant"])


def _write_rows(path: str, rows: list[dict[str, str]], empty_header: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else empty_header)
        w.writeheader()
        w.writerows(rows)


def write_differences_csv(path: str, diffs: Sequence[Difference]) -> None:
    _write_rows(path, difference_rows(diffs), ["budget", "variant", "baseline"])


def markdown(sweep: str, fits: Sequence[OptimumFit], fronts: Sequence[Frontier], skipped: Sequence[str],
             loss: str = "eval/loss", diffs: Optional[Sequence[Difference]] = None,
             diff_note: str = "", selected: Sequence[str] = (), header: str = "",
             lr_choices: Sequence[str] = ()) -> str:
    rows = table_rows(fits)
    head = ["variant", "budget (FLOPs)", "N* (params)", "N* 90% CI", "L* (loss)", "L* 90% CI", "fit", "runs"]
    lines = [f"# isoFLOP analysis: {sweep}", "", *([header, ""] if header else []),
             f"Loss: final {loss} of each run.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
    lines += ["", f"90% CIs: seeds resampled at each size (bootstrap) and the parabola refitted; only with at "
              f"least {MIN_BOOTSTRAP_SEEDS} seeds at every size (fewer: the cell gives the fewest seeds at a "
              "size, and no interval)."]
    if any(not f.interior for f in fits):
        lines += ["", "`best measured` rows are grid points, not optima: the true optimum lies outside the sizes "
                  "(or could not be fitted); they are left out of the frontier."]
    lines += ["", "## Compute-optimal frontier N*(C) = k C^a (interior minima only)", "",
              "| variant | a | k | points |", "|---|---|---|---|"]
    for fr in fronts:
        if fr.fitted:
            lines.append(f"| {fr.variant} | {fr.exponent:.3f} | {fr.coefficient:.4g} | {fr.summary()} |")
        else:
            lines.append(f"| {fr.variant} | — | — | {fr.summary()} |")
    if diffs is not None:
        lines += ["", "## Routed vs dense: loss difference (negative = routed better)", ""]
        if diff_note:
            lines += [diff_note, ""]
        if diffs:
            pct = f"{DIFF_CONFIDENCE:.0%}"
            lines += [f"ΔL* = L*(variant) − L*(baseline): difference of FITTED OPTIMUM losses (each seed's L* from "
                      f"its own parabola, paired by seed; seeds whose L* is not an interior minimum are left out), "
                      f"so with several seeds it can differ slightly from subtracting the table above (fit to seed "
                      f"means). ΔL(size): the difference at one size both measured, the one nearest the baseline's "
                      f"N*. Intervals: Student-t {pct} over seeds (paired differences); none with one seed.", "",
                      f"| budget | variant − baseline | ΔL* | ΔL* {pct} CI | matched size | ΔL(size) "
                      f"| ΔL(size) {pct} CI | note |", "|" + "---|" * 8]
            for r in difference_rows(diffs):
                lines.append(f"| {r['budget']} | {r['variant']} − {r['baseline']} | {r['delta_L_opt']} | "
                             f"{r['delta_L_opt_ci']} | {r['matched_size']} | {r['delta_L_size']} | "
                             f"{r['delta_L_size_ci']} | {r['note']} |")
    if lr_choices:
        lines += ["", "## Learning rate: the lowest-loss multiplier per (variant, size, budget, seed)", ""]
        lines += [f"- {c}" for c in lr_choices]
    if selected:
        lines += ["", "## Runs not used: another run of the same point was selected", ""] + [f"- {s}" for s in selected]
    if skipped:
        lines += ["", "## Runs left out", ""] + [f"- {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def plot_isoflops(path: str, rows, fits: Sequence[OptimumFit], ylabel: str = "final validation loss") -> Any:
    """One panel per budget (the MoD paper's isoFLOP figure): loss vs params (log x), one colour per
    variant, every run as a small dot, seed means as circles, the fitted parabola (dashed where its
    vertex is not an interior minimum) and the optimum (star; hollow square: best measured grid point)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    variants = sorted({r[0] for r in rows})
    budgets = sorted({r[1] for r in rows})
    fig = Figure(figsize=(4.5 * len(budgets), 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(budgets), squeeze=False, sharey=True)[0]
    colors = dict(zip(variants, _colors(len(variants), "tab10")))
    for ax, b in zip(axes, budgets):
        for variant in variants:
            pts = [(r[2], r[4]) for r in rows if r[0] == variant and r[1] == b]
            if not pts:
                continue
            c = colors[variant]
            by_size: dict[float, list[float]] = {}
            for p, loss in pts:
                by_size.setdefault(p, []).append(loss)
            if any(len(v) > 1 for v in by_size.values()):
                ax.scatter(*zip(*pts), color=c, s=8, alpha=0.4)
            sizes = sorted(by_size)
            ax.scatter(sizes, [np.mean(by_size[p]) for p in sizes], color=c, label=variant)
            fit = next((f for f in fits if f.variant == variant and f.budget == b), None)
            if fit and fit.coeffs:
                xs = np.linspace(math.log10(sizes[0]), math.log10(sizes[-1]), 50)
                ax.plot(10 ** xs, np.polyval(fit.coeffs, xs), color=c, lw=1, ls="-" if fit.interior else "--")
            if fit and fit.interior:
                ax.scatter([fit.n_opt], [fit.loss_opt], color=c, marker="*", s=180, edgecolor="k", zorder=3)
            elif fit:
                ax.scatter([fit.n_opt], [fit.loss_opt], facecolor="none", edgecolor=c, marker="s", s=120, zorder=3)
        ax.set(xscale="log", xlabel="parameters N", title=f"C = {b:.3g} FLOPs")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    axes[0].set_ylabel(ylabel)
    fig.savefig(path, dpi=100)
    return fig


def plot_frontier(path: str, fits: Sequence[OptimumFit], fronts: Sequence[Frontier]) -> Any:
    """N* vs C per variant: interior optima filled, grid-edge "best measured" points hollow (not in the fit)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    variants = sorted({f.variant for f in fits})
    for variant, color in zip(variants, _colors(len(variants), "tab10")):
        inside = sorted((f.budget, f.n_opt) for f in fits if f.variant == variant and f.interior)
        edge = sorted((f.budget, f.n_opt) for f in fits if f.variant == variant and not f.interior)
        if inside:
            ax.scatter(*zip(*inside), color=color, label=variant)
        if edge:
            ax.scatter(*zip(*edge), facecolor="none", edgecolor=color, marker="s",
                       label=f"{variant}: best measured (grid edge, not fitted)")
        front = next((fr for fr in fronts if fr.variant == variant), None)
        if front and front.fitted:
            cs = np.geomspace(inside[0][0], inside[-1][0], 20)
            ax.plot(cs, front.n_opt(cs), color=color, lw=1,
                    label=f"{variant}: N* ∝ C^{front.exponent:.2f} ({front.interior} budgets)")
    ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel="loss-optimal parameters N*")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    return fig


def _colors(n: int, name: str = "viridis"):
    from matplotlib import colormaps

    cmap = colormaps[name]
    if name == "tab10":
        return [cmap(i % 10) for i in range(n)]
    return [cmap(i / max(1, n - 1) * 0.85) for i in range(n)]
