#!/usr/bin/env python
"""Pretraining entry point.

    deepspeed --num_gpus 8 launcher/pretrain.py --config configs/mod_1b.yaml [key=value ...]
    torchrun --nproc_per_node 8 launcher/pretrain.py --config ...
    srun python launcher/pretrain.py --config ...          (see slurm/pretrain.sh)

Exit codes: 0 done, 2 bad config/data, 3 too many non-finite steps, 75 stopped by a signal
after a checkpoint (requeue to resume).
"""

import os
import sys

from megaroute.train.run import main

if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: main() has released the process group, closed the
    # tracker and reported its outcome, and the C++ destructors of the communication stack can
    # abort (SIGABRT, "terminate called without an active exception") when a peer rank exited
    # first, turning a clean exit code (e.g. 2 on all-corrupt checkpoints) into 250.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
