"""Data pipeline: corpus ingestion, tokenizers, packed token shards, resumable sampler.

    from megaroute.data.prepare import prepare
    index = prepare(cfg.data)                               # megaroute data prepare --config X
    ds = PackedDataset(cfg.data.output_dir, "train", seq_len=cfg.data.seq_len,
                       vocab_size=cfg.model.vocab_size, tokenizer_hash=saved_hash)
    loader = SequenceLoader(ds, micro_batch_size, global_batch_size, dp_rank, dp_size, seed)

Submodules are imported lazily so that `megaroute --help` does not pay for numpy,
sentencepiece or torch. (`prepare` is not re-exported: the name belongs to the submodule.)
"""

from __future__ import annotations

import importlib


# The prepared-directory format, shared by prepare (writer), loader and tokenizers (readers).
INDEX_FILE = "index.json"
INDEX_VERSION = 1


class DataError(ValueError):
    """Bad or inconsistent data input. The message names the offending file or config key."""


_LAZY = {
    "load_tokenizer": "megaroute.data.tokenizers",
    "Tokenizer": "megaroute.data.tokenizers",
    "PackedDataset": "megaroute.data.loader",
    "SequenceLoader": "megaroute.data.loader",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megaroute.data' has no attribute {name!r}")


__all__ = ["DataError", "INDEX_FILE", "INDEX_VERSION", *_LAZY]
