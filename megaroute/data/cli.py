"""`megaroute data prepare --config X [key=value ...]` and `megaroute data verify DIR`."""

from __future__ import annotations

import sys

from ..config import load_config
from ..config.cli import add_config_args
from . import DataError
from .loader import PackedDataset
from .prepare import prepare


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare and verify tokenized datasets")
    actions = p.add_subparsers(dest="data_action", required=True, metavar="ACTION")

    prep = actions.add_parser("prepare", help="tokenize the `data` section's corpus into packed shards")
    add_config_args(prep)
    prep.add_argument("--no-progress", action="store_true", help="no progress bars")
    prep.set_defaults(func=run_prepare)

    ver = actions.add_parser("verify", help="check a prepared directory: sizes, checksums, id range")
    ver.add_argument("output_dir")
    ver.set_defaults(func=run_verify)


def _fail(error: Exception) -> int:
    print(f"megaroute: error: {error}", file=sys.stderr)
    return 1


def run_prepare(args) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        index = prepare(cfg.data, progress=not args.no_progress)
    except DataError as e:
        return _fail(e)
    except KeyboardInterrupt:
        print(f"megaroute: interrupted; the previous output in {cfg.data.output_dir} (if any) is still valid",
              file=sys.stderr)
        return 130
    tok = index["tokenizer"]
    print(f"prepared {cfg.data.output_dir}: {tok['kind']} tokenizer, vocab {index['vocab_size']}, "
          f"sha256 {tok['sha256'][:12]}, dtype {index['dtype']}")
    for name, split in index["splits"].items():
        print(f"  {name}: {split['num_tokens']:,} tokens in {len(split['shards'])} shard(s)")
    if index["decode_errors"]["replaced"]:
        print(f"  replaced {index['decode_errors']['replaced']} undecodable byte sequence(s) with U+FFFD")
    if index["vocab_size"] > cfg.model.vocab_size:
        print(f"warning: tokenizer vocab {index['vocab_size']} > model.vocab_size={cfg.model.vocab_size}",
              file=sys.stderr)
    return 0


def run_verify(args) -> int:
    try:
        splits = PackedDataset(args.output_dir, seq_len=1).index["splits"]
        for split in splits:
            ds = PackedDataset(args.output_dir, split, seq_len=1, verify="full")
            print(f"{split}: {ds.num_tokens:,} tokens in {len(ds.files)} shard(s) OK")
    except DataError as e:
        return _fail(e)
    return 0
