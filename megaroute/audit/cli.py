"""megaroute audit <checkpoint> --data val [--reference <dense run>] [--experiment NAME] [--run-id ID]"""

from __future__ import annotations

import os
import sys
import time

import torch

from ..argtypes import positive_int
from ..config import ConfigError, load_config
from ..paths import check_out_dir
from ..sweep.mlflow_runs import require_store
from ..train.tracking import config_uri
from .report import (audit_model, batches_for, check_data, check_reference, check_tokenizer, checkpoint_config,
                     find_config, is_hf_dir, load_run_model, log_to_mlflow, routing_label, seed_report,
                     write_report)


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="routing audit of a checkpoint: counterfactuals, correlations, strata, maps, "
                                     "expert load")
    p.add_argument("checkpoint", help="run directory, checkpoints root, checkpoint tag directory, model-states "
                                      "file, or a converted Hugging Face directory (then --data-dir is needed)")
    p.add_argument("--data", default="val", choices=["val", "train"], help="prepared split to evaluate on")
    p.add_argument("--data-dir", help="prepared data directory (default: the run's data.output_dir)")
    p.add_argument("--reference", help="dense baseline run/checkpoint: token entropy and dense loss come from it")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens to evaluate (whole sequences)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--bins", type=positive_int, default=5, help="entropy quantile bins")
    p.add_argument("--out", help="report directory (default: <run dir>/audit)")
    p.add_argument("--experiment", help="MLflow experiment whose FINISHED runs, grouped by variant and seed, give "
                                        "the seed-variance section (final eval/loss, Student-t intervals)")
    p.add_argument("--mlflow-uri", help="tracking URI (default: the run's tracking.uri or its local store)")
    p.add_argument("--run-id", help="MLflow run to attach the report to as artifacts")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    if not os.path.exists(args.checkpoint):
        raise ConfigError("", f"checkpoint path {args.checkpoint!r} does not exist")
    hf = is_hf_dir(args.checkpoint)
    if hf and not args.data_dir:
        raise ConfigError("", "a Hugging Face directory carries no data config: pass --data-dir <prepared data dir>")
    if hf and (args.experiment or args.run_id) and not args.mlflow_uri:
        raise ConfigError("", "with a Hugging Face directory, --experiment and --run-id need --mlflow-uri")
    # Checks of the output, the data and the tracking store come before the model loads; a run's config
    # alone names its data and store (a Hugging Face directory has neither: the options name them).
    config = None if hf else find_config(args.checkpoint)
    run_cfg = None if hf else load_config(config)
    run_dir = args.checkpoint if hf else os.path.dirname(config)
    out = args.out or os.path.join(run_dir, "audit")
    check_out_dir(out, "--out" if args.out else "report directory")
    data_hash = check_data(args.data_dir or run_cfg.data.output_dir, args.data,
                           "--data-dir" if args.data_dir else "the run's data.output_dir")
    audited = run_cfg or checkpoint_config(args.checkpoint)
    # Also without --data-dir: the run's data.output_dir may have been re-prepared since its checkpoint
    # recorded the tokenizer it was trained with.
    check_tokenizer("the audited checkpoint", args.checkpoint, audited, data_hash)
    if args.reference:
        check_reference(args.reference, audited, data_hash)
    uri = args.mlflow_uri or (config_uri(run_cfg) if run_cfg else None)
    if args.experiment or args.run_id:
        require_store(uri)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    model, cfg = load_run_model(args.checkpoint)
    # Before the model passes, so a refusal to pool the experiment's runs comes in seconds.
    seeds = seed_report(uri, args.experiment) if args.experiment else None
    reference = load_run_model(args.reference)[0] if args.reference else None
    batches, tokenizer = batches_for(cfg, args.data, args.tokens, args.batch_size, args.data_dir)
    result = audit_model(model, cfg, batches, reference=reference, bins=args.bins, seed=args.seed)
    if seeds is not None:
        result["seeds"] = seeds
    result["seconds"] = time.perf_counter() - start
    paths = write_report(result, out, decode=tokenizer.decode)
    if args.run_id:
        log_to_mlflow(uri, args.run_id, paths)
    losses = ", ".join(f"{routing_label(k, result['mode'], 'correlation' in result)} {v:.4f}"
                       for k, v in result["losses"].items())
    print(f"audit of {args.checkpoint} ({result['tokens']:,} tokens, {result['seconds']:.1f} s): {losses}")
    if seeds is not None and seeds["left_out"]:
        print(f"seed report: {len(seeds['left_out'])} run(s) left out of the pool (not FINISHED, no "
              f"{seeds['metric']}, or superseded); listed in audit.md")
    print(f"report: {os.path.join(out, 'audit.md')}", file=sys.stdout)
    return 0
