"""Content hashes shared by the data pipeline (shards, tokenizers) and checkpoints (file manifests)."""

from __future__ import annotations

import hashlib


def sha256_file(path: str) -> str:
    """Hex sha256 of a file, streamed (checkpoint shards can be many GB)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
