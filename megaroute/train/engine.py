"""DeepSpeed setup. `import_deepspeed` is how megaroute imports deepspeed (the rest import its submodules after it).

The DeepSpeed config dict is generated from the typed Config (never hand-written JSON), so
a run's resolved YAML fully determines its engine.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Optional

import torch
from torch import nn

from ..config import Config, ConfigError
from ..parallel import ParallelLayout, collectives
from ..parallel.experts import group_name, is_expert_param
from .env import DistEnv, unlink_shm_buffer
from .optim import GuardedAdamW, lr_lambda, param_groups


def grad_accumulation_steps(cfg: Config, dp_size: int) -> int:
    per_step = cfg.train.micro_batch_size * dp_size
    if cfg.train.global_batch_size % per_step:
        raise ConfigError(
            "train.global_batch_size",
            f"{cfg.train.global_batch_size} is not divisible by micro_batch_size x data-parallel size "
            f"= {cfg.train.micro_batch_size} x {dp_size}",
        )
    return cfg.train.global_batch_size // per_step


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """The DP size implied by the layout; raises before any process group exists."""
    return ParallelLayout.from_config(cfg.parallel, world_size, model=cfg.model).dp


def deepspeed_config(cfg: Config, dp_size: int) -> dict[str, Any]:
    t, o = cfg.train, cfg.optim
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accumulation_steps(cfg, dp_size),
        "gradient_clipping": o.grad_clip,
        "steps_per_print": 10**9,  # progress is ours; keep DeepSpeed's own log quiet
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": o.zero_stage},
    }
    if o.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        # ZeRO-Offload steps on the CPU with DeepSpeed's own Adam; our client optimizer cannot be offloaded.
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": o.lr, "betas": o.betas, "eps": o.eps,
                                                       "weight_decay": o.weight_decay}}
    if o.offload_params:
        ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if t.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        # Dynamic loss scaling (loss_scale 0) for V100s, which have no bf16.
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                      "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    return ds


def import_deepspeed():
    """`import deepspeed`, with two of its import-time effects left out:

    - the `import mlflow` its autotuner makes when MLflow is installed: ~1.5 s of CPU in every rank of
      every launch, for autotuning, which megaroute does not use (and the training process keeps
      MLflow out on purpose: see tracking.py). A `None` entry in sys.modules makes that import raise
      ImportError, which DeepSpeed catches; the entry goes again right after, so MLflow stays
      importable for anything else in this process.
    - its logger writing to stdout: its handler takes the stdout of import time, which is stderr
      here, so DeepSpeed's lines ("Setting accelerator to CPU ...") never mix into what megaroute's
      commands print for programs (`inspect --json`, `sweep point`'s arguments)."""
    fresh = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if fresh:
        sys.modules["mlflow"] = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
    finally:
        if fresh and sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]
    return deepspeed


def init_distributed(env: DistEnv) -> None:
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
    if env.backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    # Every rank has mapped its peers' CPU comm buffers once all have passed init: the names can go.
    collectives.barrier()
    unlink_shm_buffer(env)


def init_expert_groups(layout: ParallelLayout) -> None:
    """Expert parallelism (layout.ep > 1): DeepSpeed's expert and expert-data-parallel groups, made by
    its own groups API (collective), handed to the layout, which checks them against its arithmetic."""
    from deepspeed.utils import groups

    if layout.tp > 1:
        groups.mpu = layout  # what the engine sets from mpu= later; the group builder reads it now
        groups._create_expert_data_and_model_parallel(layout.ep, mpu=layout)
        # That builder assumes experts sharded over TP as well; ours are replicated over it (moe.py), so
        # DeepSpeed must not sum their norms over the TP group (runtime.utils.get_global_norm_of_tensors).
        groups.expert_tensor_parallel_world_size = 1
    else:
        groups._create_expert_and_data_parallel(layout.ep)
    name = group_name(layout.ep)
    layout.set_expert_groups(groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name),
                             groups._get_expert_parallel_group_ranks(name),
                             groups._get_expert_data_parallel_group_ranks(name))


def expert_parallel_model(model: nn.Module, layout: ParallelLayout) -> int:
    """Keeps this EP rank's experts of every MoE FFN (marked as DeepSpeed MoE parameters) and gives each
    one a child DeepSpeed recognises as an MoE layer: `deepspeed.moe.layer.MoE` is how the engine turns
    on its MoE paths (expert gradients averaged over the expert-data-parallel group, ZeRO 1/2
    partitions per that group, expert broadcast at start). The child holds no parameters, so DeepSpeed
    writes no expert files of its own (train/checkpoint.py writes them) and the state dict is unchanged.
    Returns the number of MoE layers."""
    from deepspeed.moe.layer import MoE

    class ExpertParallelMarker(MoE):
        def __init__(self, num_experts: int, ep: int):
            nn.Module.__init__(self)  # none of MoE's own experts or gate
            self.num_experts, self.ep_size = num_experts, ep
            self.expert_group_name = group_name(ep)
            self.num_local_experts = 0  # nothing for DeepSpeed's per-expert files to save or load

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups exist already (init_expert_groups)

    layers = [m for m in model.modules() if hasattr(m, "shard_experts")]
    for moe in layers:
        moe.shard_experts(layout.ep_group, layout.ep_rank, layout.ep, writer=layout.expert_dp_rank == 0)
        moe.ds_moe = ExpertParallelMarker(moe.num_experts, layout.ep)
    return len(layers)


def initialize(model: nn.Module, cfg: Config, ds_config: dict, max_steps: int,
               layout: Optional[ParallelLayout] = None):
    """Wraps model + optimizer + LR schedule in a DeepSpeed engine.

    With tensor parallelism the layout is DeepSpeed's `mpu`: ZeRO then averages gradients and
    partitions state over the data-parallel group only, saves one model file per TP rank
    (mp_rank_XX) and counts TP-sharded parameters once per TP group in the grad norm. At tp = 1
    it is left out, so DeepSpeed keeps its default world group (the same math).
    With expert parallelism (parallel.ep > 1) the model's experts are sharded over the EP group first
    (`expert_parallel_model`) and the optimizer's parameter groups split into DeepSpeed MoE groups
    (deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer).
    """
    deepspeed = import_deepspeed()
    mpu = layout if layout is not None and layout.tp > 1 else None

    if layout is not None and layout.ep > 1:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        init_expert_groups(layout)
        expert_parallel_model(model, layout)
        named = [{**g, "name": n} for n, g in zip(("decay", "no_decay"), param_groups(model, cfg.optim.weight_decay))]
        groups = split_params_into_different_moe_groups_for_optimizer(named)  # ZeRO finds the expert groups by name
    else:
        groups = param_groups(model, cfg.optim.weight_decay)
    optimizer = None
    if "optimizer" not in ds_config:
        o = cfg.optim
        optimizer = GuardedAdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    schedule = lr_lambda(cfg.optim, max_steps)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=groups,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        config=ds_config,
        mpu=mpu,
    )
    skip_identity_allreduce(engine, ds_config)
    return engine, optimizer, scheduler


def skip_identity_allreduce(engine, ds_config: dict) -> bool:
    """Turns off DeepSpeed's gradient all-reduce where it is the identity: one data-parallel rank,
    ZeRO stage 0, fp32. There it still flattens every gradient into a bucket, all-reduces it over a
    group of one and copies it back each step (0-2.5% of a tiny step, 3.5% at 6 layers/384 on CPU:
    python -m megaroute.bench.engine, README "Engine overhead"). 16-bit and ZeRO optimizers hook into that
    path (accumulation boundaries, fp32 gradient buffers), so they keep it. Returns whether it did."""
    precision_16 = any(ds_config.get(k, {}).get("enabled", False) for k in ("bf16", "fp16"))
    if engine.dp_world_size == 1 and engine.zero_optimization_stage() == 0 and not precision_16:
        engine.enable_backward_allreduce = False
        return True
    return False


def grad_norms(groups: dict[str, list[torch.nn.Parameter]], device: torch.device | str,
               tp_group=None) -> dict[str, float]:
    """L2 norm of the full (unpartitioned) gradient of each named parameter group.

    Collective under ZeRO (DeepSpeed assembles partitioned gradients) and, with a TP group, over
    it (TP-sharded parameters contribute their slices; replicated ones count once), and with expert
    parallelism over the EP group (each rank's experts contribute theirs): every rank must call it,
    after the last backward and before the optimizer step. Squared sums stay on `device` (the
    engine's: the all-reduces run there) and reach the host in one copy.
    """
    from deepspeed.utils import groups as ds_groups, safe_get_full_grad  # imported after DS_ACCELERATOR is set

    names = sorted(groups)
    sums = torch.zeros(len(names), 3, dtype=torch.float64, device=device)  # [replicated, tp-sharded, experts]
    ep_group = None
    for i, name in enumerate(names):
        buckets: tuple[list, list, list] = ([], [], [])
        for p in groups[name]:
            g = safe_get_full_grad(p)
            if g is None:
                continue
            if is_expert_param(p):
                ep_group = ds_groups._get_expert_parallel_group(p.group_name)
                buckets[2].append(g.detach())
            else:
                buckets[int(getattr(p, "tensor_model_parallel", False))].append(g.detach())
        for j, grads in enumerate(buckets):
            if grads:
                # fp32 (16-bit grads would round the norm); one fused kernel per device and dtype
                norms = torch._foreach_norm([g.float() for g in grads])
                sums[i, j] = torch.stack(norms).to(device, torch.float64).pow(2).sum()
    if tp_group is not None:
        sums[:, 1] = collectives.all_reduce_(sums[:, 1].contiguous(), group=tp_group)
    if ep_group is not None:  # every rank of the group holds expert parameters, so all take this branch
        sums[:, 2] = collectives.all_reduce_(sums[:, 2].contiguous(), group=ep_group)
    totals = sums.sum(dim=1).sqrt().tolist()
    return {f"grad_norm/{name}": total for name, total in zip(names, totals)}
