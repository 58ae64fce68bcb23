"""Reference logits for the conversion tests: a checkpoint loaded the way training resumes it.

    torchrun --nproc_per_node N tests/integration/hf_reference.py <run_dir> <tokens.pt> <out.pt>

Every rank builds the model from the run's config, wraps it in a DeepSpeed engine (same ZeRO stage
and TP layout as the run), loads the latest checkpoint with CheckpointManager.load, and runs the
forward in causal routing mode; rank 0 saves the full-vocabulary logits. Nothing here shares code
with the converter's reader, so the comparison checks the shard merging and ZeRO-3 reassembly.
"""

import os
import sys

import torch
import torch.distributed as dist

from megaroute.config import load_config
from megaroute.model import ForwardOptions, build_model
from megaroute.parallel import ParallelLayout
from megaroute.train import engine as ds
from megaroute.train.checkpoint import CheckpointManager
from megaroute.train.env import detect_env


def main(run_dir: str, tokens_path: str, out_path: str) -> None:
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    env = detect_env()
    layout = ParallelLayout.from_config(cfg.parallel, env.world_size, env.rank, cfg.model)
    ds.init_distributed(env)
    layout.init_process_groups()
    model = build_model(cfg.model, cfg.routing, tp_group=layout.tp_group)
    engine, _, _ = ds.initialize(model, cfg, ds.deepspeed_config(cfg, layout.dp), 10, layout)
    manager = CheckpointManager(os.path.join(run_dir, cfg.checkpoint.dir), 10, env.rank)
    manager.load(engine, manager.latest_tag())
    engine.eval()
    with torch.no_grad():
        logits = model.gather_logits(engine(torch.load(tokens_path), options=ForwardOptions(mode="causal")).logits)
    if env.rank == 0:
        torch.save(logits.float(), out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # As launcher/pretrain.py: skip interpreter teardown, whose C++ destructors of the communication
    # stack can abort a rank ("terminate called without an active exception", SIGABRT) after its
    # logits are saved and the process group is destroyed; one such abort failed a CI run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
