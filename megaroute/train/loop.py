"""The fit loop: step, evaluate, notify callbacks. Everything else is a callback."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import torch

from ..data.loader import PackedDataset, SequenceLoader
from .. import metric_names as names
from ..model import ForwardOptions
from ..model.routing import calibrate_thresholds
from ..parallel import collectives

# Training's forward: the loss is all it reads, so the model need not return the logits (on CPU
# without TP the LM head then runs inside the loss: model/lm_loss.py).
TRAIN_FORWARD = ForwardOptions(return_logits=False)


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0
    flops_seen: float = 0.0
    skipped_steps: int = 0
    nonfinite_streak: int = 0
    stop_reason: Optional[str] = None  # "complete" | "signal" | "exit_interval" | "nonfinite"

    def state_dict(self) -> dict:
        return asdict(self)


class Callback:
    def on_train_start(self, trainer: "Trainer") -> None: ...
    def on_step_end(self, trainer: "Trainer", metrics: dict[str, float]) -> None: ...
    def on_eval(self, trainer: "Trainer", metrics: dict[str, float]) -> None: ...
    # After the step and its evaluation (if any): the state a checkpoint of this step must hold,
    # running summaries included, so a job resumed from it goes on exactly as an unbroken one.
    def on_step_done(self, trainer: "Trainer") -> None: ...
    def on_train_end(self, trainer: "Trainer") -> None: ...


def _accumulate(sums: dict[str, torch.Tensor], key: str, value, weight: float, device) -> None:
    """sums[key] += weight * value, kept as a float64 tensor on `device` (no host sync)."""
    v = torch.as_tensor(value.detach() if torch.is_tensor(value) else value, dtype=torch.float64, device=device)
    sums[key] = sums[key] + weight * v if key in sums else weight * v


class Trainer:
    def __init__(self, engine, optimizer, batches: Iterator, evaluate: Callable[[], dict], *, total_steps: int,
                 accumulation: int, tokens_per_step: int, flops_per_token: float, eval_interval: int,
                 max_nonfinite_steps: int, stop_signal, callbacks: list[Callback], state: TrainState,
                 count_overflow_as_nonfinite: bool = True, exit_interval: Optional[int] = None,
                 grad_probe: Optional[Callable[[], dict[str, float]]] = None, probe_interval: int = 1):
        self.engine, self.optimizer, self.batches, self.evaluate = engine, optimizer, batches, evaluate
        self.total_steps, self.accumulation = total_steps, accumulation
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.eval_interval, self.max_nonfinite_steps = eval_interval, max_nonfinite_steps
        self.stop_signal, self.callbacks, self.state = stop_signal, callbacks, state
        # fp16 loss scaling skips overflowing steps by design; only non-finite losses count then.
        self.count_overflow_as_nonfinite = count_overflow_as_nonfinite
        self.exit_interval = exit_interval
        # Called on every rank between the last backward and the optimizer step of every
        # `probe_interval`-th step (e.g. gradient norms per parameter group); may be collective.
        self.grad_probe, self.probe_interval = grad_probe, probe_interval

    def _emit(self, event: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(self, *args)

    def fit(self) -> TrainState:
        self._emit("on_train_start")
        while self.state.stop_reason is None:
            if self.state.step >= self.total_steps:
                self.state.stop_reason = "complete"
                break
            metrics, stop = self.train_step()
            self._emit("on_step_end", metrics)
            if self.state.step % self.eval_interval == 0 or self.state.step == self.total_steps:
                self._emit("on_eval", self.evaluate())
            self._emit("on_step_done")
            if stop:
                self.state.stop_reason = "signal"
            elif self.exit_interval and self.state.step % self.exit_interval == 0 and self.state.step < self.total_steps:
                self.state.stop_reason = "exit_interval"
            elif self.state.nonfinite_streak >= self.max_nonfinite_steps:
                self.state.stop_reason = "nonfinite"
        self._emit("on_train_end")
        return self.state

    def train_step(self) -> tuple[dict[str, float], bool]:
        start = time.perf_counter()
        # Losses and routing stats stay on the device until the step's last micro-batch: one host
        # copy per step instead of a device sync per stat per micro-batch.
        sums: dict[str, torch.Tensor] = {}
        device = self.engine.device
        bad = torch.zeros((), dtype=torch.bool, device=device)
        probed: dict[str, float] = {}
        step = self.state.step + 1
        probe_now = self.grad_probe is not None and (step % self.probe_interval == 0 or step in (1, self.total_steps))
        for micro in range(self.accumulation):
            inputs, targets = next(self.batches)
            out = self.engine(inputs.to(device), targets.to(device), options=TRAIN_FORWARD)
            bad |= ~torch.isfinite(out.loss.detach())
            values = {"lm_loss": out.lm_loss, **{f"aux/{k}": v for k, v in out.aux_losses.items()},
                      **{f"routing/{k}": v for k, v in out.routing_stats.items()}}
            for key, value in values.items():
                _accumulate(sums, key, value, 1 / self.accumulation, device)
            if micro == self.accumulation - 1:
                # One collective per step, on the engine's device: summed finite loss, "any rank
                # non-finite", "any rank asked to stop". Then one host copy of everything.
                stop_flag = torch.tensor(float(self.stop_signal.requested), dtype=torch.float64, device=device)
                flags = collectives.all_reduce(
                    torch.stack([torch.where(bad, 0.0, sums["lm_loss"]), bad.double(), stop_flag]), device)
                host = torch.cat([torch.stack(list(sums.values())), flags]).tolist()
                local = dict(zip(sums, host))
                loss_sum, n_bad, n_stop = host[len(sums):]
                del local["lm_loss"]
                if hasattr(self.optimizer, "nonfinite_loss"):
                    self.optimizer.nonfinite_loss = n_bad > 0
            self.engine.backward(out.loss)
            if probe_now and micro == self.accumulation - 1:
                probed = self.grad_probe()
            self.engine.step()

        skipped = not self.engine.was_step_applied() or getattr(self.optimizer, "last_step_skipped", False)
        bad = n_bad > 0 or (skipped and self.count_overflow_as_nonfinite)
        s = self.state
        s.step += 1
        s.skipped_steps += int(skipped)
        s.nonfinite_streak = s.nonfinite_streak + 1 if bad else 0
        s.consumed_samples += self.engine.train_batch_size()
        s.tokens_seen += self.tokens_per_step
        s.flops_seen += self.flops_per_token * self.tokens_per_step
        n_finite = collectives.world_size() - n_bad
        grad_norm = self.engine.get_global_grad_norm()
        metrics = {
            "train/loss": loss_sum / n_finite if n_finite else math.nan,
            "train/lr": self.engine.get_lr()[0],
            "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "train/skipped_steps": float(s.skipped_steps),
            "train/tokens_seen": float(s.tokens_seen),
            "train/flops_seen": s.flops_seen,
            "perf/step_time_s": time.perf_counter() - start,
            **local,  # aux/* and routing/*, this rank's micro-batch means
            **probed,
        }
        return metrics, n_stop > 0


class Evaluator:
    """Validation metrics over a fixed set of batches, in each routing mode of the method
    (`modes`: metric suffix -> routing mode, from its MethodSpec; names in megaroute.metric_names).

    First, with a `calibration_set` (training data), the causal decisions' thresholds are re-measured
    in causal mode on its first `batches` micro-batches per rank (model/routing/calibration.py), so
    causal evaluation executes the budget's fraction with the current weights.
    The `honest_mode` (each token routed from its own past, at the compute the method spends) gives
    eval/loss, with eval/exec_frac (mean over routed layers, and eval/exec_frac/<layer>), eval/tlops_frac
    and eval/budget beside it. Every other mode logs val/loss<suffix> (val/loss_topk: training's
    top-k, which sees future tokens) and its own fractions. Mixture-of-Experts layers (moe, MoDE) also
    log their causal-mode expert load, routing_causal/<layer>/expert_<e>_load and moe_load_max (no
    drops: causal mode drops nothing). Every call reads the same batches: each data-parallel rank its
    own share of them, `batches` micro-batches per mode; every value is a mean over them and the ranks."""

    def __init__(self, engine, val_set: PackedDataset, modes: dict[str, str], *, honest_mode: str,
                 budget: Optional[float], batches: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 calibration_set: Optional[PackedDataset] = None, dp_group=None):
        if honest_mode not in modes.values():
            raise ValueError(f"honest mode {honest_mode!r} is not one of the evaluation modes {modes}")
        self.engine, self.val_set, self.modes, self.batches = engine, val_set, modes, batches
        self.honest_mode, self.budget = honest_mode, budget
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.calibration_set, self.dp_group = calibration_set, dp_group

    def _batches(self, dataset: PackedDataset) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same `batches` micro-batches of `dataset` at every call: this rank's share of them."""
        mb = self.micro_batch_size
        loader = iter(SequenceLoader(dataset, mb, mb * self.dp_size, self.dp_rank, self.dp_size, seed=0))
        for _ in range(self.batches):
            x, y = next(loader)
            yield x.to(self.engine.device), y.to(self.engine.device)

    def _calibrate(self) -> None:
        engine = self.engine
        options = ForwardOptions(mode="causal", calibrate=True)
        calibrate_thresholds(getattr(engine, "module", engine), lambda x: engine(x, options=options),
                             (x for x, _ in self._batches(self.calibration_set)), self.dp_group)

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        engine = self.engine
        engine.eval()
        if self.calibration_set is not None:
            self._calibrate()
        out = {}
        for suffix, mode in self.modes.items():
            # Sums stay on the device; one collective (on the engine's device) and one host copy per mode.
            sums: dict[str, torch.Tensor] = {}
            for x, y in self._batches(self.val_set):
                result = engine(x, y, options=ForwardOptions(mode=mode, return_logits=False))
                values = {"loss": result.lm_loss, "tlops_frac": result.routing_stats.get("tlops_frac"),
                          **{f"exec_frac/{layer}": v for layer, v in result.executed.items()}}
                if result.executed:
                    values["exec_frac"] = sum(result.executed.values()) / len(result.executed)
                if mode == "causal":  # the expert load of what eval/loss runs, beside training's (top-k) one
                    for key, value in result.routing_stats.items():
                        layer, _, stat = key.partition("/")
                        if names.is_expert_stat(stat):
                            values[names.routing_stat(layer, stat, names.ROUTING_CAUSAL)] = value
                for key, value in values.items():
                    if value is not None:
                        _accumulate(sums, key, value, 1 / self.batches, engine.device)
            keys = list(sums)
            means = collectives.all_reduce(torch.stack([sums[k] for k in keys]), engine.device)
            means = (means / collectives.world_size()).tolist()
            for key, value in zip(keys, means):
                out[self._name(key, suffix, mode)] = value
        if self.budget is not None:
            out[names.BUDGET] = self.budget
        if "val/loss_soft" in out:  # halting: what hard skipping costs over the soft gates
            out["val/soft_hard_gap"] = out[names.LOSS] - out["val/loss_soft"]
        engine.train()
        return out

    def _name(self, key: str, suffix: str, mode: str) -> str:
        if key.startswith(names.ROUTING_CAUSAL + "/"):  # named for its mode already
            return key
        if mode == self.honest_mode:
            return f"eval/{key}"
        stem, _, layer = key.partition("/")
        return f"val/{stem}{suffix}" + (f"/{layer}" if layer else "")
