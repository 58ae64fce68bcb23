#!/usr/bin/env python
"""Pretraining entry point.

    deepspeed --num_gpus 8 launcher/pretrain.py --config configs/mod_1b.yaml [key=value ...]
    torchrun --nproc_per_node 8 launcher/pretrain.py --config ...
    srun python launcher/pretrain.py --config ...          (see slurm/pretrain.sh)

Exit codes: 0 done, 2 bad config/data, 3 too many non-finite steps, 75 stopped by a signal
after a checkpoint (requeue to resume).
"""

import sys

from megaroute.train.run import main

if __name__ == "__main__":
    sys.exit(main())
