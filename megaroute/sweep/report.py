"""Ties analysis to MLflow: read a sweep's runs, write table + plots, log them to a new analysis run.

Every analysis is its own record: a child run of the sweep's parent (`analysis-<metric>-<UTC time>`,
tags sweep_id, sweep_role=analysis, metric) holding the artifacts, and a new local folder
<out>/<metric>-<UTC time>/. Nothing an earlier analysis wrote is replaced, whatever --out or --metric.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from . import analyze as A
from .. import metric_names as names
from ..paths import check_out_dir
from .design import best_lr_points
from .mlflow_runs import (HONEST_LOSS, TOPK_LOSS, RunResult, end_run, finish_parent, log_artifacts, set_tags,
                          start_analysis_run, sweep_runs)

METRICS = {"eval": HONEST_LOSS, "topk": TOPK_LOSS}
DENSE_ROUTING = "none"  # the "routing" tag of a dense run


@dataclass(frozen=True)
class Analysis:
    """What one `analyze_sweep` wrote: iterating it gives the files (as the plain list it used to be)."""
    files: list[str]
    out_dir: str
    run_id: str
    parent: Optional[str]

    def __iter__(self):
        return iter(self.files)


def select_runs(runs: Sequence[RunResult], select=best_lr_points) -> tuple[list[RunResult], list[str], list[str]]:
    """One run per (variant, size, budget, seed): a sweep with `lr_sweep` trains each point at several
    learning-rate multipliers (tag lr_mult) and the fit keeps the lowest-loss one (`select`, default
    design.best_lr_points). Returns (kept runs, lines naming the runs not used, lines of the learning-rate
    choices where a point had several runs, flagged when the best multiplier is at the edge of those tried)."""
    kept, choices = select(runs)
    used = {r.run_id for r in kept}
    dropped = [f"{r.name} ({r.run_id}): lr_mult {r.lr_mult:g}, loss {r.val_loss:.4f}" for r in runs
               if r.run_id not in used]
    lines = []
    for c in choices:
        if len(c.losses) < 2:
            continue
        tried = ", ".join(f"{m:g}: {loss:.4f}" for m, loss in c.losses)
        edge = " — AT THE EDGE of the multipliers tried: the best learning rate was not bracketed" if c.at_edge else ""
        lines.append(f"{c.variant} {c.size} C={c.budget:.3g} seed {c.seed}: kept lr_mult {c.lr_mult:g} "
                     f"(tried {tried}){edge}")
    return kept, dropped, lines


def baseline_variant(runs: Sequence[RunResult]) -> tuple[Optional[str], str]:
    """(the dense variant routed ones are compared with, a note): the variant whose runs have routing
    tag "none"; when that is ambiguous or missing, the one named "dense"."""
    dense = sorted({r.variant for r in runs if r.routing == DENSE_ROUTING})
    variants = {r.variant for r in runs}
    if len(dense) == 1:
        return dense[0], ""
    if "dense" in variants:
        return "dense", (f"baseline: variant 'dense' (dense variants: {', '.join(dense)})" if dense else "")
    if dense:
        return dense[0], f"baseline: {dense[0]} (of dense variants {', '.join(dense)})"
    return None, "No dense variant (routing tag 'none', or named 'dense'): no routed-vs-dense differences."


def loss_label(runs: Sequence[RunResult], keys: tuple[str, ...]) -> tuple[str, str]:
    """(table line, y-axis label) naming the metric actually fitted."""
    if keys == HONEST_LOSS:
        return names.LOSS_LABEL, "final " + names.LOSS_LABEL.replace(" (", "\n(", 1)
    used = [k for k in keys if any(r.loss_key == k for r in runs)]
    by_key = {k: sorted({r.variant for r in runs if r.loss_key == k}) for k in used}
    table = (" or ".join(keys) + " (training-mode routing: not comparable with eval/loss); used: "
             + ", ".join(f"{k} ({', '.join(v)})" for k, v in by_key.items()))
    return table, "final " + " / ".join(used) + "\n(training-mode routing, sees future tokens)"


def _stamp(now: Optional[dt.datetime] = None) -> str:
    return (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")


def _new_dir(base: str, name: str) -> str:
    """base/name, or base/name-2, -3 ... : a folder no earlier analysis wrote."""
    os.makedirs(base, exist_ok=True)
    for i in range(1, 10_000):
        path = os.path.join(base, name if i == 1 else f"{name}-{i}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free analysis folder {name}-N under {base}")


def analyze_sweep(uri: str, experiment: str, sweep: str, out_dir: str, metric: str = "eval",
                  finish: bool = False, now: Optional[dt.datetime] = None, select=None) -> Analysis:
    """metric "eval": each run's eval/loss, autoregressive at the compute it executed; "topk": the
    training-mode figure (val/loss_topk: sequence-wide top-k, which sees future tokens; halting's soft
    gates), for diagnosis only. Writes <out_dir>/<metric>-<UTC time>/ and a new analysis child run of
    the parent. `finish`: then end the parent run (FINISHED; FAILED when the analysis fails). `select`:
    keeps one run per (variant, size, budget, seed), as design.best_lr_points (the default) does."""
    keys = METRICS[metric]
    check_out_dir(out_dir, "analysis directory")  # before the child run opens: a bad one would leave it FAILED
    stamp = _stamp(now)
    parent, runs = sweep_runs(uri, experiment, sweep, keys)
    run_id = start_analysis_run(uri, experiment, sweep, parent, metric, keys, stamp)
    try:
        result = _analyze(uri, sweep, runs, keys, os.path.abspath(out_dir), f"{metric}-{stamp}", run_id, parent,
                          select)
    except BaseException as e:
        try:  # the analysis's own error is the one to raise
            end_run(uri, run_id, "FAILED")
            if finish:
                finish_parent(uri, experiment, sweep, "FAILED",
                              {"analysis_run": run_id, "analysis_error": f"{type(e).__name__}: {e}"[:500]})
        except Exception as e2:  # noqa: BLE001
            print(f"warning: could not mark the runs FAILED: {e2}", file=sys.stderr)
        raise
    end_run(uri, run_id, "FINISHED")
    if finish:
        finish_parent(uri, experiment, sweep, "FINISHED", {"analysis_run": run_id})
    return result


def _analyze(uri, sweep, runs, keys, base_dir, name, run_id, parent, select) -> Analysis:
    good, skipped = [], []
    for r in sorted(runs, key=lambda r: r.name):
        if r.status != "FINISHED" or r.val_loss is None or not math.isfinite(r.val_loss):
            skipped.append(f"{r.name} ({r.run_id}): status {r.status}, final {' or '.join(keys)} {r.val_loss}")
        else:
            good.append(r)
    if not good:
        raise LookupError(f"no finished run with {' or '.join(keys)} in sweep {sweep!r}"
                          + (f"; left out: {'; '.join(skipped)}" if skipped else ""))
    kept, dropped, lr_lines = select_runs(good, select or best_lr_points)
    kept.sort(key=lambda r: r.name)
    rows = [(r.variant, r.budget, r.n_params, r.seed, r.val_loss) for r in kept]
    fits = A.isoflop_fits(rows)
    fronts = A.frontiers(fits)
    baseline, diff_note = baseline_variant(kept)
    if any(r.hold == "active_params" for r in kept):
        diff_note = " ".join(filter(None, [diff_note, "hold: active_params: parameters are ACTIVE parameters, and "
                                           "each budget is the first variant's training FLOPs; the other variants "
                                           "trained on its tokens at its active size, so their curves are not "
                                           "isoFLOP: compare them at matched size."]))
    if keys != HONEST_LOSS and baseline is not None:
        diff_note = " ".join(filter(None, [diff_note, "NOT A COMPARISON: routed losses here are training-mode figures "
                                           "(they see future tokens) and dense's are eval/loss; these differences "
                                           "flatter routing. Diagnosis only; compare with --metric eval."]))
    diffs = None if baseline is None else A.differences(
        [(r.variant, r.budget, r.size, r.n_params, r.seed, r.val_loss) for r in kept], baseline, fits)
    label, ylabel = loss_label(kept, keys)

    out_dir = _new_dir(base_dir, name)
    files = {f: os.path.join(out_dir, f) for f in ("isoflop_table.md", "isoflop_table.csv", "isoflop_differences.csv",
                                                   "isoflop_curves.png", "isoflop_frontier.png")}
    with open(files["isoflop_table.md"], "w") as f:
        f.write(A.markdown(sweep, fits, fronts, skipped, loss=label, diffs=diffs if diffs is not None else [],
                           diff_note=diff_note, selected=dropped, lr_choices=lr_lines,
                           header=f"MLflow analysis run {run_id}" + (f", child of the sweep's parent run {parent}"
                                                                     if parent else "") + "."))
    A.write_csv(files["isoflop_table.csv"], fits)
    A.write_differences_csv(files["isoflop_differences.csv"], diffs or [])
    A.plot_isoflops(files["isoflop_curves.png"], rows, fits, ylabel=ylabel)
    A.plot_frontier(files["isoflop_frontier.png"], fits, fronts)
    log_artifacts(uri, run_id, list(files.values()), None)
    set_tags(uri, run_id, {"out_dir": out_dir, "runs_used": str(len(kept)), "runs_left_out": str(len(skipped)),
                           "runs_not_selected": str(len(dropped))})
    return Analysis(list(files.values()), out_dir, run_id, parent)
