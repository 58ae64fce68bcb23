"""A checkpoint-shaped run directory without training (benchmarks and tests of the converter).

Writes what a TP=1, ZeRO 0-2 run writes for its weights: config.yaml, checkpoints/<tag>/
mp_rank_00_model_states.pt ({"module": state_dict, client state with tokenizer_hash and config_hash, as
training saves them}), manifest.json and `latest`. With parallel.ep > 1 (MoE), as expert parallelism
saves: the model-states file holds EP rank 0's experts only, and every expert of every MoE layer is in
its own file (train/checkpoint.py EXPERT_STATES).
"""

from __future__ import annotations

import os

import torch

from ..config import Config, config_hash, save_config
from ..train.checkpoint import (EXPERT_STATES, EXPERT_WEIGHTS, LATEST, _atomic_write, moe_layers, tag_for,
                                write_manifest)


def write_checkpoint(model: torch.nn.Module, cfg: Config, run_dir: str, tokenizer_hash: str | None = None,
                     step: int = 0) -> str:
    """Saves `model` (built from cfg) as run_dir's checkpoint at `step`; returns the tag directory."""
    if cfg.parallel.tp != 1:
        raise ValueError("write_checkpoint writes single-rank (parallel.tp=1) checkpoints")
    tag = tag_for(step)
    tag_dir = os.path.join(run_dir, cfg.checkpoint.dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    save_config(cfg, os.path.join(run_dir, "config.yaml"))
    module = model.state_dict()
    ep = cfg.parallel.ep
    for layer_id, (prefix, moe) in enumerate(moe_layers(model) if ep > 1 else []):
        keys = [f"{prefix}.{w}" for w in EXPERT_WEIGHTS]
        for e in range(moe.num_experts):
            path = os.path.join(tag_dir, EXPERT_STATES.format(layer_id, e, 0))
            torch.save({k: module[k][e].clone() for k in keys}, path)
        for k in keys:
            module[k] = module[k][:moe.num_experts // ep].clone()  # EP rank 0's slice
    state = {"module": module, "tokenizer_hash": tokenizer_hash, "config_hash": config_hash(cfg),
             "mp_world_size": 1,
             "dp_world_size": 1, "global_steps": step}
    torch.save(state, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    write_manifest(tag_dir, step)
    _atomic_write(os.path.join(run_dir, cfg.checkpoint.dir, LATEST), tag)
    return tag_dir
