"""Callbacks around the fit loop: progress line, metrics file, MLflow, checkpoints."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

from .. import metric_names as names
from ..model.routing import sync_quantile_cuts
from ..model.routing.calibration import budget_gap
from .checkpoint import CheckpointManager
from .loop import Callback, Trainer
from .tracking import MLflowTracker


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


class SpeedMeter(Callback):
    """Adds perf/tokens_per_s, perf/mfu and perf/eta_s to each step's metrics, over a sliding window of
    steps. The first step after a (re)start is the window until the second ends, then leaves it: it
    holds one-time work (train.compile's graph compilation, the CPU kernels' build, allocator and
    communicator warm-up; for tiny_mod compiled on CPU 14 s cold, 2.6 s warm, against 0.06 s steps)
    that would understate the speed of the next `window` steps."""

    def __init__(self, peak_flops_total: float, window: int = 10):
        self.peak = peak_flops_total
        self.window = window
        self.times: list[float] = []
        self.steps = 0  # steps seen since this process started

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self.steps += 1
        if self.steps == 2:
            self.times = []  # the first step leaves the window
        self.times = (self.times + [metrics["perf/step_time_s"]])[-self.window:]
        step_time = sum(self.times) / len(self.times)
        tps = trainer.tokens_per_step / step_time
        metrics["perf/tokens_per_s"] = tps
        metrics["perf/mfu"] = tps * trainer.flops_per_token / self.peak if self.peak > 0 else math.nan
        metrics["perf/eta_s"] = step_time * (trainer.total_steps - trainer.state.step)


class RoutingStateSync(Callback):
    """Averages per-rank routing state (the causal decisions' calibrated thresholds) over the
    data-parallel group after each step; registered first, so evaluation and checkpoints see the
    synced values."""

    def __init__(self, model, dp_group):
        self.model, self.group, self.sync = model, dp_group, sync_quantile_cuts

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self.sync(self.model, self.group)


class ProgressPrinter(Callback):
    """Rank-0 progress line: step, loss, tokens/s, MFU, ETA."""

    def __init__(self, interval: int, print_fn=print):
        self.interval = interval
        self.print = print_fn

    def on_step_end(self, trainer: Trainer, m: dict) -> None:
        s = trainer.state.step
        if s % self.interval == 0 or s == trainer.total_steps or s == 1:
            self.print(f"step {s:>6}/{trainer.total_steps} | loss {m['train/loss']:.4f} | lr {m['train/lr']:.2e} "
                       f"| gnorm {m['train/grad_norm']:.3f} | {m['perf/tokens_per_s']:,.0f} tok/s "
                       f"| mfu {100 * m['perf/mfu']:.2f}% | eta {_fmt_duration(m['perf/eta_s'])}", flush=True)

    def on_eval(self, trainer: Trainer, m: dict) -> None:
        # Per-expert causal loads (E + 1 per MoE layer) go to metrics.jsonl / MLflow, not the console line.
        shown = {k: v for k, v in m.items() if not k.startswith(names.ROUTING_CAUSAL + "/")}
        self.print(f"eval step {trainer.state.step}: " + " ".join(f"{k}={v:.4f}" for k, v in shown.items()), flush=True)

    def on_train_end(self, trainer: Trainer) -> None:
        self.print(f"training stopped at step {trainer.state.step}: {trainer.state.stop_reason} "
                   f"(skipped steps: {trainer.state.skipped_steps})", flush=True)


class LossSummary(Callback):
    """Adds the run-level loss figures routed-depth papers compare, of eval/loss: eval/best_loss,
    eval/avg_loss, and once per threshold the first step it reached it (eval/threshold_hit_step/<t>);
    and train/avg_loss. Its state rides in the checkpoint, so resuming keeps it. Place it before the
    callbacks that record metrics."""

    def __init__(self, thresholds: list[float]):
        self.thresholds = sorted(thresholds, reverse=True)
        self.best = math.inf
        self.val_sum = self.train_sum = 0.0
        self.val_n = self.train_n = 0
        self.hits: dict[str, int] = {}

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        if math.isfinite(metrics["train/loss"]):
            self.train_sum += metrics["train/loss"]
            self.train_n += 1
        if self.train_n:
            metrics["train/avg_loss"] = self.train_sum / self.train_n

    def on_eval(self, trainer: Trainer, metrics: dict) -> None:
        loss = metrics.get(names.LOSS, math.nan)
        if not math.isfinite(loss):
            return
        self.best = min(self.best, loss)
        self.val_sum += loss
        self.val_n += 1
        metrics[names.BEST_LOSS] = self.best
        metrics[names.AVG_LOSS] = self.val_sum / self.val_n
        for t in self.thresholds:
            key = f"{t:g}"
            if key not in self.hits and loss <= t:
                self.hits[key] = trainer.state.step
                metrics[f"{names.THRESHOLD_HIT}/{key}"] = float(trainer.state.step)

    def state_dict(self) -> dict:
        return {"best": self.best, "val_sum": self.val_sum, "val_n": self.val_n, "train_sum": self.train_sum,
                "train_n": self.train_n, "hits": dict(self.hits)}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, dict(value) if key == "hits" else value)


class BudgetCheck(Callback):
    """Says, in the run's summary, when evaluation executed a fraction of tokens off the method's budget
    by more than `tolerance` (relative) at some routed layer: eval/loss was then measured at another
    compute level than the budget. Adds eval/budget_gap (the largest relative gap) to each eval."""

    def __init__(self, tracker: Optional[MLflowTracker] = None, tolerance: float = 0.1, print_fn=print):
        self.tracker, self.tolerance, self.print = tracker, tolerance, print_fn
        self.off: dict[str, float] = {}
        self.budget: Optional[float] = None
        self.step = 0

    def on_eval(self, trainer: Trainer, metrics: dict) -> None:
        self.budget = metrics.get(names.BUDGET)
        prefix = names.EXEC_FRAC + "/"
        layers = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
        if self.budget is None or not layers:
            return
        gaps = {layer: budget_gap(v, self.budget) for layer, v in layers.items()}
        metrics["eval/budget_gap"] = max(gaps.values())
        self.off = {layer: layers[layer] for layer, gap in gaps.items() if gap > self.tolerance}
        self.step = trainer.state.step

    def on_train_end(self, trainer: Trainer) -> None:
        if not self.off:
            return
        listed = ", ".join(f"{layer} {v:.3f}" for layer, v in self.off.items())
        message = (f"evaluation at step {self.step} executed fractions off the budget {self.budget:.3f} by more "
                   f"than {self.tolerance:.0%}: {listed}; {names.LOSS} is a loss at that compute, not at the budget")
        self.print(f"WARNING: {message}", flush=True)
        if self.tracker is not None:
            self.tracker.set_tags({"budget_warning": message})


METRICS_FILE = "metrics.jsonl"  # in the run directory: every step's and eval's metrics (MetricsFile)


class MetricsFile(Callback):
    """Appends every step's and eval's metrics to <run_dir>/metrics.jsonl (rank 0)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def _write(self, kind: str, step: int, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "step": step, "time": time.time(), **metrics}) + "\n")

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self._write("train", trainer.state.step, metrics)

    def on_eval(self, trainer: Trainer, metrics: dict) -> None:
        self._write("eval", trainer.state.step, metrics)


class MLflowLogger(Callback):
    """Forwards metrics to the MLflow tracker every `interval` steps; marks the run's final status."""

    # A run stopped to be resumed later stays KILLED until the resumed job finishes it.
    STATUS = {"complete": "FINISHED", "signal": "KILLED", "exit_interval": "KILLED", "nonfinite": "FAILED"}

    def __init__(self, tracker: MLflowTracker, interval: int, metrics_path: Optional[str] = None,
                 print_fn=print):
        self.tracker = tracker
        self.interval = interval
        self.metrics_path = metrics_path  # named in the final line when the run did not reach MLflow
        self.print_fn = print_fn

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        if trainer.state.step % self.interval == 0 or trainer.state.step == trainer.total_steps:
            self.tracker.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, trainer.state.step)

    def on_eval(self, trainer: Trainer, metrics: dict) -> None:
        self.tracker.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, trainer.state.step)

    def on_train_end(self, trainer: Trainer) -> None:
        if self.tracker.close(self.STATUS.get(trainer.state.stop_reason, "FAILED")):
            return
        # The start-up warning scrolled away long ago: the job's last lines say the run is incomplete.
        where = f"; every logged metric is in {self.metrics_path}" if self.metrics_path else ""
        self.print_fn(f"warning: MLflow run {self.tracker.run_id or '(never created)'} at {self.tracker.uri} is "
                      f"incomplete: not every metric or the final status reached it (last error: "
                      f"{self.tracker.last_error}; {self.tracker.dropped_metrics} points dropped){where}", flush=True)


class PeriodicCheckpoint(Callback):
    """Commits a checkpoint every `interval` steps and whenever training stops. It saves once the
    step's evaluation has run (on_step_done), so the running summaries it holds (LossSummary) and
    the RNG state include that evaluation: a job resumed from it logs what an unbroken one does."""

    def __init__(self, manager: CheckpointManager, interval: int, client_state):
        self.manager = manager
        self.interval = interval
        self.client_state = client_state  # callable -> dict, evaluated at save time
        self.last_saved: Optional[int] = None

    def _save(self, trainer: Trainer) -> None:
        self.manager.save(trainer.engine, trainer.state.step, self.client_state())
        self.last_saved = trainer.state.step

    def on_step_done(self, trainer: Trainer) -> None:
        if trainer.state.step % self.interval == 0:
            self._save(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        if self.last_saved != trainer.state.step and trainer.state.step > 0:
            self._save(trainer)
