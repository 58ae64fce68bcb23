"""launcher/pretrain.py with a fault injected, chosen by MEGAROUTE_FAULT (tests only).

    nan:RANK:STEP            rank RANK's loss is NaN at optimizer step STEP (1-based)
    kill_in_checkpoint:STEP  rank 0 is SIGKILLed after every rank wrote checkpoint STEP's files,
                             before the manifest and `latest` are written
    slow:SECONDS             every training forward sleeps (numerics unchanged), so a test can
                             signal or kill a rank mid-run
"""

import os
import signal
import sys
import time

import megaroute.train.checkpoint as checkpoint
from megaroute.model import transformer
from megaroute.train.run import main

kind, *args = os.environ["MEGAROUTE_FAULT"].split(":")

if kind == "nan":
    rank, step = int(args[0]), int(args[1])
    forward = transformer.Transformer.forward
    calls = {"train": 0}

    def nan_forward(self, tokens, targets=None, **kw):
        out = forward(self, tokens, targets, **kw)
        if self.training and targets is not None:
            calls["train"] += 1  # micro-batches; the demo configs run one per step per rank
            if int(os.environ.get("RANK", 0)) == rank and calls["train"] == step:
                out.loss = out.loss * float("nan")
                out.lm_loss = out.lm_loss * float("nan")
        return out

    transformer.Transformer.forward = nan_forward

elif kind == "kill_in_checkpoint":
    step = int(args[0])
    write_manifest = checkpoint.write_manifest

    def killing_write_manifest(tag_dir, at_step):
        if at_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return write_manifest(tag_dir, at_step)

    checkpoint.write_manifest = killing_write_manifest

elif kind == "slow":
    delay = float(args[0])
    forward = transformer.Transformer.forward

    def slow_forward(self, *a, **kw):
        if self.training:
            time.sleep(delay)
        return forward(self, *a, **kw)

    transformer.Transformer.forward = slow_forward

else:
    raise SystemExit(f"unknown MEGAROUTE_FAULT {kind!r}")

if __name__ == "__main__":
    sys.exit(main())
