"""Audit wall time for a fixed number of tokens (random weights and tokens: cost, not findings).

    python -m megaroute.bench.audit [--configs configs/tiny_mod.yaml,configs/mod_157m.yaml] [--tokens 4096]

Per batch the audit runs the learned routing, a dense reference, four counterfactual masks and
the causal mode: 7 forward passes.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..argtypes import comma_list, positive_int
from ..audit.report import audit_model, auditable_methods
from ..config import ConfigError, load_config
from ..model import build_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", type=comma_list(str), default=["configs/tiny_mod.yaml", "configs/mod_157m.yaml"],
                   help="comma-separated configs of routed models (default configs/tiny_mod.yaml,configs/mod_157m.yaml)")
    p.add_argument("--tokens", type=positive_int, default=4096)
    p.add_argument("--batch-size", type=positive_int, default=4)
    args = p.parse_args(argv)
    try:  # every config, before the first is timed
        cfgs = {path: load_config(path) for path in args.configs}
    except ConfigError as e:
        p.error(f"--configs: {e}")
    for path, cfg in cfgs.items():
        if cfg.routing.method not in auditable_methods():
            p.error(f"--configs: {path}: the audit needs a routed model, one of {', '.join(auditable_methods())}; "
                    f"got routing.method {cfg.routing.method!r}")
    print(f"{'config':<28}{'params':>10}{'seq':>6}{'tokens':>8}{'wall s':>9}{'tokens/s':>10}")
    for path, cfg in cfgs.items():
        torch.manual_seed(0)
        model = build_model(cfg.model, cfg.routing).eval()
        dense = build_model(cfg.model, load_config(path, ["routing.method=none"]).routing).eval()
        T = cfg.data.seq_len
        n = max(1, args.tokens // (args.batch_size * T))
        batches = [(torch.randint(0, cfg.model.vocab_size, (args.batch_size, T)),) * 2 for _ in range(n)]
        start = time.perf_counter()
        result = audit_model(model, cfg, batches, reference=dense)
        wall = time.perf_counter() - start
        print(f"{cfg.name:<28}{model.num_params() / 1e6:>9.1f}M{T:>6}{result['tokens']:>8}{wall:>9.1f}"
              f"{result['tokens'] / wall:>10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
