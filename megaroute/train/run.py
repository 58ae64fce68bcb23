"""`launcher/pretrain.py`: config -> checks -> process group -> model -> engine -> fit.

Everything that can be wrong with the config or data is checked before the process group
starts, so a bad run fails in seconds with a message naming the key or file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import traceback
from typing import Callable, Optional

import numpy as np
import torch

from .. import metric_names as names
from ..config import Config, ConfigError, config_hash, flatten, load_config, save_config
from ..data import INDEX_FILE, DataError
from ..data.loader import PackedDataset, SequenceLoader
from ..data.prepare import preflight, prepare
from ..data.tokenizers import load_tokenizer
from ..flops import config_flops, cpu_rank_peak, flops_per_token, peak_flops, training_proxy
from ..memory import MemoryFitError, local_ranks
from ..memory import preflight as memory_preflight
from ..model import build_model
from ..model.routing import freeze_base, is_controller_param, method_spec
from ..model.routing.context import eval_modes
from ..parallel import ParallelLayout, collectives
from ..paths import dir_problem
from . import engine as ds
from .callbacks import (METRICS_FILE, BudgetCheck, LossSummary, MetricsFile, MLflowLogger, PeriodicCheckpoint, ProgressPrinter, RoutingStateSync,
                        SpeedMeter)
from .checkpoint import (CheckpointError, CheckpointManager, committed_tags, init_from_file, load_init_weights,
                         move_aside, replaced_stamp, resolve_checkpoint, resume_tag, set_aside)
from .env import DistEnv, detect_env, release
from .loop import Evaluator, Trainer, TrainState
from .signals import EXIT_CONFIG_ERROR, EXIT_NONFINITE, EXIT_OK, EXIT_REQUEUE, StopSignal
from .run_record import RUN_RECORD, await_run, tracked_run
from .tracking import MLflowTracker, TrackingProcess, config_uri, file_store_problem
from .watchdog import LauncherWatchdog

EXIT_FOR_REASON = {"complete": EXIT_OK, "signal": EXIT_REQUEUE, "exit_interval": EXIT_REQUEUE,
                   "nonfinite": EXIT_NONFINITE}
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pretrain a dense or routed transformer under DeepSpeed.")
    p.add_argument("--config", required=True, help="YAML config (may use `base:` inheritance)")
    # The deepspeed launcher passes --local_rank; the environment carries the same value.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    return p.parse_args(argv)


def _git_commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _peak_flops(cfg: Config, env: DistEnv) -> tuple[float, str]:
    """(peak FLOP/s of one rank, where it comes from). CPU ranks on one machine share its cores, so they
    split its peak, or measure what their GEMMs reach where that is more (flops.cpu_rank_peak)."""
    if cfg.train.peak_flops:
        return cfg.train.peak_flops, "train.peak_flops"
    if env.device == "cpu":
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        return (cpu_rank_peak(cfg.train.precision, ranks),
                "this rank's measured GEMM rate, or its share of the cores' estimate where higher")
    try:
        return peak_flops(None), "the device's 16-bit tensor-core datasheet peak"
    except ValueError as e:  # a GPU missing from the table must not stop training: MFU is logged as NaN
        if env.is_main:
            print(f"warning: {e}; perf/mfu will be NaN", file=sys.stderr, flush=True)
        return 0.0, "none"


def check_data(cfg: Config):
    """Everything about the data that can be checked before the process group, cheaply, on every rank.

    Prepared data (data.output_dir has an index.json): both splits are opened as `PackedDataset`s,
    which checks shard sizes, seq_len, and token ids against model.vocab_size (from the index's
    recorded id ranges: no shard is read). Returns (train, val).
    No prepared data: rank 0 will prepare it after the process group starts, so the source is
    checked now (exists, not empty, decodable; see `prepare.preflight`). A failure there is
    reported as a missing prepared directory (naming data.output_dir) that cannot be prepared
    (naming data.source and the file). Returns None.
    Raises DataError (exit 2)."""
    out = cfg.data.output_dir
    if not os.path.isfile(os.path.join(out, INDEX_FILE)):
        try:
            preflight(cfg.data, cfg.model.vocab_size)
        except DataError as e:
            state = ("does not exist" if not os.path.exists(out) else
                     "is not a directory" if not os.path.isdir(out) else f"has no {INDEX_FILE}")
            raise DataError(f"data.output_dir: no prepared data: {out} {state}, and it cannot be prepared "
                            f"from data.source={cfg.data.source!r}: {e}") from None
        return None  # rank 0 prepares it after the process group starts
    kw = dict(seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
    return PackedDataset(out, "train", **kw), PackedDataset(out, "val", **kw)


def check_resume_tag(cfg: Config) -> None:
    """An explicit checkpoint.resume (not auto/none) must name an existing checkpoint directory under
    <run_dir>/<checkpoint.dir>, looked up as `CheckpointManager` does (`resume_tag`). Existence only:
    the manifest and checksums are verified after the process group starts."""
    if cfg.checkpoint.resume in ("auto", "none"):
        return
    resume = cfg.checkpoint.resume
    tag = resume_tag(resume)
    try:
        resolve_checkpoint(os.path.join(cfg.run_dir, cfg.checkpoint.dir), tag=tag)
    except CheckpointError as e:
        # A path is cut to its last component: say so, or the message names a tag the user never wrote.
        given = "" if resume == tag else (f"{resume!r} names checkpoint {tag!r} (a path's last component, looked "
                                          "up under the run's checkpoint.dir): ")
        raise ConfigError("checkpoint.resume", f"{given}{e}; use a tag listed there, 'auto' (the latest intact one) "
                                               "or 'none' (start fresh)") from None


# Families of DeepSpeed checkpoint layouts by ZeRO stage: 0 keeps the optimizer state in the model
# files, 1 and 2 partition it per data-parallel rank (a stage-1 checkpoint loads under stage 2), 3
# partitions the parameters too.
ZERO_LAYOUTS = {0: "ZeRO 0", 1: "ZeRO 1-2", 2: "ZeRO 1-2", 3: "ZeRO 3"}


def check_resume_compat(cfg: Config, layout: ParallelLayout) -> None:
    """Resuming (checkpoint.resume not 'none') in a run directory that holds committed checkpoints needs
    what they were saved with, read from the run's config.yaml and ds_config.json:
      - the same model: parameter and buffer names and shapes (both configs built on the meta device);
      - the same checkpoint layout: parallel.tp (a file per TP rank), parallel.ep (experts stacked per
        EP rank, and one file per expert from ep 2 on), the ZeRO stage's family
        (ZERO_LAYOUTS) and, from ZeRO 1 on, the data-parallel size (DeepSpeed cannot re-partition the
        optimizer state: "Automatic adjustment of ZeRO's optimizer state partitioning with a new world
        size is not currently supported").
    Otherwise DeepSpeed's load fails with a traceback once the process group and the engine are up. A
    launch writes both files only after it has resumed or started fresh (`_write_run_files`), so they
    describe the checkpoints. Files that do not load (an older schema) are left to DeepSpeed's load.
    Raises ConfigError (exit 2) naming the key that differs."""
    saved_path = os.path.join(cfg.run_dir, "config.yaml")
    if (cfg.checkpoint.resume == "none" or not os.path.isfile(saved_path)
            or not committed_tags(os.path.join(cfg.run_dir, cfg.checkpoint.dir))):
        return
    try:
        saved = load_config(saved_path)
    except ConfigError:
        return
    fix = "resume them with that config, or start a new run under another name"
    shapes = [{k: tuple(v.shape) for k, v in build_model(c.model, c.routing, device="meta").state_dict().items()}
              for c in (saved, cfg)]
    if shapes[0] != shapes[1]:
        before, now = flatten(saved), flatten(cfg)
        changed = [k for k in now if k.startswith(("model.", "routing.")) and before.get(k) != now[k]]
        tensors = sorted(k for k in shapes[0].keys() | shapes[1].keys() if shapes[0].get(k) != shapes[1].get(k))
        what = (", ".join(f"{k}: {before.get(k)!r} there, {now[k]!r} here" for k in changed) if changed
                else "tensors " + ", ".join(tensors[:4]) + (", ..." if len(tensors) > 4 else ""))
        raise ConfigError(changed[0] if changed else "name", f"the run directory {cfg.run_dir} holds checkpoints "
                                                             f"of another model ({what}; see its config.yaml): {fix}")
    zero = [f"{c.optim.zero_stage} ({ZERO_LAYOUTS[c.optim.zero_stage]}'s layout)" for c in (saved, cfg)]
    saved_dp = _saved_dp(cfg.run_dir) if cfg.optim.zero_stage > 0 else None
    for key, there, here, differ in (
            ("parallel.tp", saved.parallel.tp, layout.tp, saved.parallel.tp != layout.tp),
            # ep > 1 saves each rank's experts stacked in its states file and each expert in its own file
            ("parallel.ep", saved.parallel.ep, layout.ep, saved.parallel.ep != layout.ep),
            ("optim.zero_stage", *zero, ZERO_LAYOUTS[saved.optim.zero_stage] != ZERO_LAYOUTS[cfg.optim.zero_stage]),
            ("parallel.dp", saved_dp, layout.dp, saved_dp not in (None, layout.dp))):
        if differ:
            raise ConfigError(key, f"the run directory {cfg.run_dir} holds checkpoints saved with {key}={there}, this "
                                   f"launch has {here}: DeepSpeed cannot load them across that change; {fix}")


def _saved_dp(run_dir: str) -> Optional[int]:
    """The data-parallel size of the launch that wrote run_dir's ds_config.json, or None (unreadable)."""
    try:
        with open(os.path.join(run_dir, "ds_config.json")) as f:
            saved = json.load(f)
        return saved["train_batch_size"] // (saved["train_micro_batch_size_per_gpu"] * saved["gradient_accumulation_steps"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def check_run_paths(cfg: Config) -> None:
    """The run directory and its checkpoint directory are (or rank 0 can create them as) writable
    directories: a file in the way would otherwise surface after the process group, or at the first
    checkpoint save, after hours of training. Leaves nothing behind (paths.dir_problem); rank 0 creates
    them in `_start` and at saves.
    Raises ConfigError (exit 2)."""
    # runs_dir itself need not be writable when the run directory in it already is (a shared runs_dir).
    paths = (("runs_dir", cfg.runs_dir, "runs directory", False), ("name", cfg.run_dir, "run directory", True),
             ("checkpoint.dir", os.path.join(cfg.run_dir, cfg.checkpoint.dir), "checkpoint directory", True))
    for key, path, what, writable in paths:
        problem = dir_problem(path, writable)
        if problem:
            raise ConfigError(key, f"{what}: {problem}")


def check_tracking(cfg: Config) -> None:
    """A tracking URI that fails on every attempt (MLflow's file store: tracking.file_store_problem) is a
    configuration error: tracking failures otherwise only warn, since a server may come back, and this
    one would leave the run unlogged. Raises ConfigError (exit 2)."""
    reason = file_store_problem(config_uri(cfg), cfg.routing.method != "none") if cfg.tracking.enabled else None
    if reason:
        raise ConfigError("tracking.uri", reason)


def pretrain(cfg: Config, env: DistEnv) -> int:
    layout, ds_config, init_path = _check(cfg, env)
    tracking = _start_tracking(cfg, env)
    try:
        return _train(cfg, env, layout, ds_config, init_path, tracking)
    finally:
        if tracking is not None:
            tracking.discard()  # a launch that failed before its tracker adopted the process


def _train(cfg: Config, env: DistEnv, layout: ParallelLayout, ds_config: dict, init_path: Optional[str],
           tracking: Optional[TrackingProcess]) -> int:
    _start(cfg, env, layout)
    train_set, val_set, tokenizer = _datasets(cfg)
    model = _model(cfg, env, layout, init_path)
    fpt = flops_per_token(cfg.model, cfg.routing, cfg.data.seq_len, training=True)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    total_steps = _total_steps(cfg, tokens_per_step, fpt)
    engine, optimizer, _ = ds.initialize(model, cfg, ds_config, total_steps, layout)
    dp_rank, dp_size = layout.dp_rank, layout.dp
    # Per-DP-rank seeds after init: data-parallel replicas draw their own randomness, while the
    # TP ranks of one replica share a stream, so replicated routing draws (random baselines,
    # oracle-label sampling, rank-loss pairs) stay identical across them.
    _seed_everything(cfg.train.seed + dp_rank)
    loader = train_loader(cfg, train_set, dp_rank, dp_size)
    manager = CheckpointManager(os.path.join(cfg.run_dir, cfg.checkpoint.dir), cfg.checkpoint.keep_last, env.rank)
    state, summary, run_id = _resume(cfg, env, engine, manager, loader, tokenizer.hash)
    if env.is_main:
        _write_run_files(cfg, ds_config)

    stop = StopSignal().install()
    watchdog = LauncherWatchdog(stop.request).start()  # a killed `deepspeed` runner leaves the ranks running
    tracker = _make_tracker(cfg, env, run_id, tokenizer, state.step, total_steps, tracking) if env.is_main else None
    client_state = _client_state(cfg, state, loader, summary, tokenizer.hash, tracker)
    spec = method_spec(cfg.routing.method)
    evaluate = Evaluator(engine, val_set, eval_modes(cfg.routing.method), honest_mode=spec.honest_mode,
                         budget=_budget(cfg), batches=cfg.train.eval_batches,
                         micro_batch_size=cfg.train.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                         calibration_set=train_set, dp_group=layout.get_data_parallel_group())
    trainer = Trainer(
        engine, optimizer, iter(loader), evaluate,
        total_steps=total_steps, accumulation=ds.grad_accumulation_steps(cfg, dp_size),
        tokens_per_step=tokens_per_step, flops_per_token=fpt, eval_interval=cfg.train.eval_interval,
        max_nonfinite_steps=cfg.train.max_nonfinite_steps, stop_signal=stop,
        callbacks=_callbacks(cfg, env, layout, model, manager, summary, tracker, client_state), state=state,
        count_overflow_as_nonfinite=cfg.train.precision != "fp16", exit_interval=cfg.train.exit_interval,
        grad_probe=lambda: ds.grad_norms(_param_groups_by_role(model), engine.device, layout.tp_group),
        probe_interval=cfg.train.log_interval,
    )
    if tracker is not None:
        await_run(cfg, tracker)
    final = _fit(trainer, tracker, stop, watchdog)
    if final.stop_reason == "nonfinite" and env.is_main:
        print(f"error: {final.nonfinite_streak} consecutive non-finite steps (train.max_nonfinite_steps="
              f"{cfg.train.max_nonfinite_steps}); the last good state is checkpointed in {manager.root}",
              file=sys.stderr)
    return EXIT_FOR_REASON[final.stop_reason]


def _check(cfg: Config, env: DistEnv):
    """The checks that need no process group -> (layout, DeepSpeed config, init_from weights file)."""
    layout = ParallelLayout.from_config(cfg.parallel, env.world_size, env.rank, cfg.model)
    ds_config = ds.deepspeed_config(cfg, layout.dp)
    check_run_paths(cfg)
    check_tracking(cfg)
    check_data(cfg)
    check_resume_tag(cfg)
    check_resume_compat(cfg, layout)
    init_path = init_from_file(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else None
    check_memory(cfg, env, layout)
    return layout, ds_config, init_path


def check_memory(cfg: Config, env: DistEnv, layout: ParallelLayout) -> None:
    """train.preflight: the estimated peak per rank against the device's free memory (megaroute.memory).
    Every rank reaches the same verdict; rank 0 prints the full message. Raises MemoryFitError (exit 2)."""
    if cfg.train.preflight == "off":
        return
    fits, message = memory_preflight(cfg, dp=layout.dp, tp=layout.tp, device=env.device, local_rank=env.local_rank,
                              ranks_here=local_ranks(), ep=layout.ep)
    if fits:
        return
    if cfg.train.preflight == "warn":
        if env.is_main:
            print(f"warning: {message}", file=sys.stderr, flush=True)
        return
    raise MemoryFitError(message if env.is_main else "memory pre-flight: does not fit (rank 0 prints why)")


def _start(cfg: Config, env: DistEnv, layout: ParallelLayout) -> None:
    """Process groups; rank 0 creates the run directory, sets a restarted run's earlier checkpoints and
    metrics aside (checkpoint.resume=none: _start_over) and prepares missing data while the others wait."""
    ds.init_distributed(env)
    layout.init_process_groups()
    if env.is_main:
        os.makedirs(cfg.run_dir, exist_ok=True)
        if cfg.checkpoint.resume == "none":
            _start_over(cfg)
        if not os.path.isfile(os.path.join(cfg.data.output_dir, INDEX_FILE)):
            print(f"preparing {cfg.data.source} -> {cfg.data.output_dir}", flush=True)
            prepare(cfg.data)
    collectives.barrier()


def _start_over(cfg: Config) -> None:
    """checkpoint.resume=none: the earlier run's checkpoints (checkpoint.set_aside) and metrics.jsonl move
    to `<name>.replaced-<UTC time>`, one time for both; nothing is deleted. Appended to, the old run's
    metrics.jsonl would hold its points beside the new run's, and readers that keep each step's last
    point would report the old run's steps beyond the new run's last as this run's."""
    stamp = replaced_stamp()
    moved = set_aside(os.path.join(cfg.run_dir, cfg.checkpoint.dir), stamp)
    if moved:
        print(f"checkpoint.resume=none: starting over; the run's earlier checkpoints are in {moved}", flush=True)
    metrics = os.path.join(cfg.run_dir, METRICS_FILE)
    if os.path.exists(metrics):
        print(f"checkpoint.resume=none: the run's earlier metrics are in {move_aside(metrics, stamp)}", flush=True)


def _write_run_files(cfg: Config, ds_config: dict) -> None:
    """The run directory's config.yaml and ds_config.json, written once this launch has resumed (or found
    nothing to resume): a launch that fails before then leaves the files that describe the run's
    checkpoints as they were (the converter, the audit and check_resume_compat read them)."""
    save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
    with open(os.path.join(cfg.run_dir, "ds_config.json"), "w") as f:
        json.dump(ds_config, f, indent=1)


def _model(cfg: Config, env: DistEnv, layout: ParallelLayout, init_path: Optional[str]):
    _seed_everything(cfg.train.seed)
    # Every rank draws the full weights from the same seed and keeps its TP slice.
    model = build_model(cfg.model, cfg.routing, tp_group=layout.tp_group,
                        activation_checkpointing=cfg.parallel.activation_checkpointing)
    if init_path:
        load_init_weights(model, init_path, controller_only=cfg.train.controller_only)
    if cfg.train.controller_only:
        trainable = freeze_base(model)
        if env.is_main:
            n = sum(p.numel() for p in model.parameters() if p.requires_grad)
            print(f"controller-only: training {n:,} of {model.num_params():,} parameters "
                  f"({len(trainable)} tensors)", flush=True)
    if cfg.train.compile:
        model.compile_blocks()  # lazy: each shape compiles at its first call, after the engine casts the weights
    return model


def _resume(cfg: Config, env: DistEnv, engine, manager: CheckpointManager, loader: SequenceLoader,
            tokenizer_hash: str) -> tuple[TrainState, LossSummary, Optional[str]]:
    """checkpoint.resume: restores engine, loader and loss summary from a checkpoint when there is
    one -> (train state, loss summary, the MLflow run id saved in the checkpoint: see `run_record.tracked_run`)."""
    state, summary = TrainState(), LossSummary(cfg.train.loss_thresholds)
    if cfg.checkpoint.resume == "none":
        return state, summary, None
    tag = manager.find_resumable(None if cfg.checkpoint.resume == "auto" else cfg.checkpoint.resume)
    if tag is None:
        return state, summary, None
    client = manager.load(engine, tag)
    _check_resume_compat(client, config_hash(cfg), tokenizer_hash, tag)
    state = TrainState(**{**client["train_state"], "stop_reason": None, "nonfinite_streak": 0})
    loader.load_state_dict(client["loader"])
    summary.load_state_dict(client.get("loss_summary", {}))
    if env.is_main:
        print(f"resumed from {os.path.join(manager.root, tag)} at step {state.step}", flush=True)
    return state, summary, client.get("mlflow_run_id")


def _client_state(cfg: Config, state: TrainState, loader: SequenceLoader, summary: LossSummary,
                  tokenizer_hash: str, tracker: Optional[MLflowTracker]) -> Callable[[], dict]:
    """What each checkpoint saves beside DeepSpeed's own state (`_resume` reads it back)."""
    chash = config_hash(cfg)
    return lambda: {"train_state": state.state_dict(), "loader": loader.state_dict(), "config_hash": chash,
                    "tokenizer_hash": tokenizer_hash, "mlflow_run_id": tracker.run_id if tracker else None,
                    "loss_summary": summary.state_dict()}


def _callbacks(cfg: Config, env: DistEnv, layout: ParallelLayout, model, manager: CheckpointManager,
               summary: LossSummary, tracker: Optional[MLflowTracker], client_state: Callable[[], dict]) -> list:
    dp_size = layout.dp
    peak, source = _peak_flops(cfg, env)
    if env.is_main and peak > 0:  # the denominator of perf/mfu, which a reader cannot see in the figure
        print(f"perf/mfu: against {peak / 1e9:,.1f} GFLOP/s per rank ({source}), x {env.world_size} ranks", flush=True)
    callbacks = [SpeedMeter(peak * env.world_size), summary,
                 BudgetCheck(tracker, print_fn=print if env.is_main else lambda *a, **k: None)]
    if method_spec(cfg.routing.method).syncs_state and dp_size > 1:
        callbacks.insert(0, RoutingStateSync(model, layout.get_data_parallel_group()))
    if env.is_main:
        callbacks += [ProgressPrinter(cfg.train.log_interval), MetricsFile(os.path.join(cfg.run_dir, METRICS_FILE))]
    callbacks.append(PeriodicCheckpoint(manager, cfg.checkpoint.interval, client_state))
    if tracker is not None:
        callbacks.append(MLflowLogger(tracker, cfg.train.log_interval, os.path.join(cfg.run_dir, METRICS_FILE)))
    return callbacks


def _fit(trainer: Trainer, tracker: Optional[MLflowTracker], stop: StopSignal,
         watchdog: LauncherWatchdog) -> TrainState:
    """Runs the loop; a crash marks the MLflow run FAILED. Signal handlers and the watchdog end with it."""
    try:
        return trainer.fit()
    except BaseException:
        if tracker is not None:
            tracker.close("FAILED", timeout=10)
        raise
    finally:
        watchdog.stop()
        stop.uninstall()


def _datasets(cfg: Config):
    tokenizer = load_tokenizer(cfg.data.output_dir)
    kw = dict(seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size, tokenizer_hash=tokenizer.hash)
    return PackedDataset(cfg.data.output_dir, "train", **kw), PackedDataset(cfg.data.output_dir, "val", **kw), tokenizer


def _budget(cfg: Config) -> Optional[float]:
    """Fraction of tokens per routed layer the method's budget says (None: no budget)."""
    spec = method_spec(cfg.routing.method)
    return spec.budget(cfg.routing, cfg.data.seq_len) if spec.budget is not None else None


def _description(cfg: Config) -> str:
    """The MLflow run description: what the comparison metric is."""
    spec, budget = method_spec(cfg.routing.method), _budget(cfg)
    if cfg.routing.method == "none":
        return f"{names.LOSS}: the ordinary autoregressive validation loss of a dense model."
    at = f" (budget {budget:.4g})" if budget is not None else ""
    text = (f"{names.LOSS}: autoregressive validation loss, {cfg.routing.method} routed in its "
            f"'{spec.honest_mode}' mode (each token decides from its own past), at the executed fraction "
            f"logged as {names.EXEC_FRAC}{at}. ")
    if "topk" in spec.eval_modes.values() and spec.honest_mode != "topk":
        text += (f"The training-mode figure is logged under its own name (val/loss{_suffix(spec, 'topk')}): "
                 "it is not comparable with eval/loss")
        text += " (sequence-wide top-k sees future tokens)." if spec.budget is not None else "."
    return text


def _suffix(spec, mode: str) -> str:
    return next(s for s, m in spec.eval_modes.items() if m == mode)


def _total_steps(cfg: Config, tokens_per_step: int, flops_per_token: float) -> int:
    """Stopping rule: the first of max_steps, the token budget and the FLOP budget."""
    steps = cfg.train.max_steps
    if cfg.train.max_tokens:
        steps = min(steps, -(-cfg.train.max_tokens // tokens_per_step))
    if cfg.train.max_flops:
        steps = min(steps, int(-(-cfg.train.max_flops // (flops_per_token * tokens_per_step))))
    return max(1, steps)


def train_loader(cfg: Config, dataset: PackedDataset, dp_rank: int = 0, dp_size: int = 1) -> SequenceLoader:
    """The training loader: its sample order is seeded by train.data_seed, or train.seed when that is
    None, so runs of different seeds see the data in different orders (the evaluator's order is fixed)."""
    seed = cfg.train.seed if cfg.train.data_seed is None else cfg.train.data_seed
    return SequenceLoader(dataset, cfg.train.micro_batch_size, cfg.train.global_batch_size, dp_rank, dp_size, seed)


def data_fingerprint(output_dir: str) -> str:
    """Content hash of prepared data (the tokenizer's and every shard's sha256 from its index.json),
    logged as the MLflow param data.prepared_sha256 so that runs on different data are not pooled."""
    with open(os.path.join(output_dir, INDEX_FILE)) as f:
        index = json.load(f)
    content = {"tokenizer": index["tokenizer"].get("sha256"),
               "splits": {name: [s["sha256"] for s in split["shards"]] for name, split in sorted(index["splits"].items())}}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def _check_resume_compat(client: dict, chash: str, tokenizer_hash: str, tag: str) -> None:
    if client.get("tokenizer_hash") not in (None, tokenizer_hash):
        raise ConfigError("data.output_dir", f"checkpoint {tag} was trained with tokenizer {client['tokenizer_hash']}, "
                                             f"the prepared data uses {tokenizer_hash}")
    if client.get("config_hash") not in (None, chash):
        print(f"warning: resuming {tag} with a changed config (hash {client['config_hash']} -> {chash})", flush=True)


def _start_tracking(cfg: Config, env: DistEnv) -> Optional[TrackingProcess]:
    """Rank 0's tracking process, started before DeepSpeed so that it imports MLflow meanwhile: seconds
    that rank 0 (and every rank, at the first collective) would otherwise wait before step 1. None if
    it cannot start: the tracker then tries again, and warns (no tracking is better than no training)."""
    if not (env.is_main and cfg.tracking.enabled):
        return None
    try:
        return TrackingProcess(config_uri(cfg))
    except Exception:  # noqa: BLE001 - see MLflowTracker
        return None


def _make_tracker(cfg: Config, env: DistEnv, run_id: Optional[str], tokenizer, resumed_step: int = 0,
                  total_steps: Optional[int] = None, process: Optional[TrackingProcess] = None):
    """Rank 0's tracker. `run_id`: the one saved in the resumed checkpoint (see `run_record.tracked_run`);
    `process`: the tracking process started for it (a new one by default)."""
    if not cfg.tracking.enabled:
        return None

    tags = {"variant": cfg.variant, "size": cfg.size, "seed": str(cfg.train.seed), "git_commit": _git_commit(),
            "host": socket.gethostname(), "world_size": str(env.world_size), "routing": cfg.routing.method,
            **({"slurm_job_id": os.environ["SLURM_JOB_ID"]} if "SLURM_JOB_ID" in os.environ else {}),
            **({"slurm_array_job_id": os.environ["SLURM_ARRAY_JOB_ID"]} if "SLURM_ARRAY_JOB_ID" in os.environ else {}),
            **({"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}),
            "mlflow.note.content": _description(cfg), "run_dir": os.path.abspath(cfg.run_dir),
            **cfg.tracking.tags}

    flops = config_flops(cfg)
    params = {**flatten(cfg), "flops.train_per_token": flops.per_token(training=True),
              "flops.inference_per_token": flops.per_token(training=False),
              "flops.train_proxy_vs_full": round(training_proxy(cfg.model, cfg.routing, cfg.data.seq_len), 4),
              "data.prepared_sha256": data_fingerprint(cfg.data.output_dir)}
    if cfg.train.controller_only and method_spec(cfg.routing.method).frozen_base_flops:
        # What autograd runs with the base frozen (the proxy above keeps the 3x-forward convention).
        params["flops.train_executed_vs_full"] = round(
            training_proxy(cfg.model, cfg.routing, cfg.data.seq_len, frozen_base=True), 4)
    uri = config_uri(cfg)
    run_id, find_existing = tracked_run(cfg, uri, resumed_step, run_id)
    metrics_file = os.path.join(cfg.run_dir, METRICS_FILE)
    backfill = None  # points up to the resumed step that the store may lack (a tracker killed before sending)
    if resumed_step > 0 and cfg.checkpoint.resume != "none" and os.path.exists(metrics_file):
        backfill = (os.path.abspath(metrics_file), resumed_step, cfg.train.log_interval, total_steps or 0)
    tracker = MLflowTracker(uri, cfg.tracking.experiment, cfg.name,
                            params=params, tags=tags, artifact_root=os.path.join(cfg.runs_dir, "mlartifacts"),
                            run_id=run_id, record_path=os.path.abspath(os.path.join(cfg.run_dir, RUN_RECORD)),
                            find_existing=find_existing, backfill=backfill, process=process)
    tracker.log_artifact(os.path.join(cfg.run_dir, "config.yaml"))
    tracker.log_artifact(os.path.join(cfg.run_dir, "ds_config.json"))
    tracker.log_artifact(tokenizer.path, "tokenizer")
    return tracker


def _param_groups_by_role(model) -> dict[str, list]:
    """Trainable parameters split into the base model and the routing controller (for grad norms)."""
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault("controller" if is_controller_param(name) else "base", []).append(p)
    return groups


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    env = None
    try:
        cfg = load_config(args.config, args.overrides)
        env = detect_env()
        return pretrain(cfg, env)
    except ConfigError as e:
        print(f"pretrain: error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except CheckpointError as e:
        print(f"pretrain: checkpoint error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except Exception as e:
        if isinstance(e, DataError):
            print(f"pretrain: data error: {e}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        traceback.print_exc()
        return 1
    finally:
        if env is not None:  # without an env, no process group was created
            release(env)
