"""Corpus ingestion: resolve `data.source` into a deterministic list of chunks, and read them.

A chunk is the unit of parallel work and of the train/val split. Its boundaries depend only
on the corpus, never on the number of workers, which is what makes `prepare` output
byte-identical for any `data.num_workers`.

- text files: byte ranges of about `chunk_bytes`, cut just after a newline. UTF-8 never has
  0x0A inside a multi-byte character, so such a cut is a character boundary and workers can
  decode their range independently. Each file is one document.
- jsonl / parquet / arrow (read with `datasets.load_dataset(builder, data_files=...)`) and hub
  datasets: runs of consecutive rows holding about `chunk_bytes` of text. Each row is a document.

`chunk_bytes` is 16 KiB, doubled (up to 4 MiB) until the corpus has at most ~4096 chunks: small
corpora still get a fine-grained train/val split, large ones a short chunk list.

Undecodable bytes (text files only; the structured readers validate UTF-8 themselves and fail
naming the file): `data.decode_errors=replace` substitutes U+FFFD and counts substitutions,
`strict` raises DataError naming the file and the absolute byte offset.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional
from urllib.parse import urlparse

import numpy as np

from ..config.schema import DataConfig
from . import DataError

MIN_CHUNK_BYTES = 16 << 10
_MAX_CHUNK_BYTES = 4 << 20
_TARGET_CHUNKS = 4096
# A "line" longer than this is cut at a character boundary instead of at a newline.
_MAX_LINE_BYTES = 1 << 20
_HUB_PROBE_TIMEOUT_S = 3.0

_EXTENSIONS = {
    ".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl", ".json.gz": "jsonl",
    ".parquet": "parquet", ".arrow": "arrow",
}
_BUILDERS = {"jsonl": "json", "parquet": "parquet", "arrow": "arrow"}


class Chunk(NamedTuple):
    index: int
    origin: str  # file path or dataset name, for messages and decode-error accounting
    start: int  # byte offset (text) or first row (rows)
    end: int  # exclusive
    nbytes: int  # approximate size of its text, for progress
    ends_document: bool  # the chunk's last text is the end of a document


@dataclass
class ChunkText:
    pieces: list[tuple[str, bool]]  # (text, ends a document)
    replaced: int  # U+FFFD substitutions made while decoding


@dataclass
class Corpus:
    chunks: list[Chunk]
    chunk_bytes: int
    description: dict  # recorded in the index as "source"
    reader: "TextReader | RowReader"  # small and picklable: what a worker process receives

    def read(self, chunk: Chunk, decode_errors: str) -> ChunkText:
        return self.reader.read(chunk, decode_errors)


def chunk_bytes_for(total_bytes: int) -> int:
    size = MIN_CHUNK_BYTES
    while size < _MAX_CHUNK_BYTES and total_bytes > size * _TARGET_CHUNKS:
        size *= 2
    return size


def decode_utf8(data: bytes, mode: str, origin: str, offset: int) -> tuple[str, int]:
    """Decode `data` (found at byte `offset` of `origin`); returns (text, substitutions)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if mode == "strict":
            raise DataError(
                f"{origin}: invalid UTF-8 at byte offset {offset + e.start} ({e.reason}); "
                "set data.decode_errors=replace to substitute U+FFFD and count the substitutions"
            ) from None
    text = data.decode("utf-8", "replace")
    # U+FFFD already present in the file is a valid 3-byte sequence that no error span can
    # overlap, so the difference counts exactly the substitutions.
    return text, text.count("\ufffd") - data.count(b"\xef\xbf\xbd")


class TextReader:
    def read(self, chunk: Chunk, decode_errors: str) -> ChunkText:
        with open(chunk.origin, "rb") as f:
            f.seek(chunk.start)
            data = f.read(chunk.end - chunk.start)
        text, replaced = decode_utf8(data, decode_errors, chunk.origin, chunk.start)
        return ChunkText([(text, chunk.ends_document)], replaced)


def text_corpus(source: str, files: list[str]) -> Corpus:
    """Plain text files; each file is a document."""
    sizes = [os.path.getsize(p) for p in files]
    if sum(sizes) == 0:
        raise DataError(f"data.source: input is empty: {', '.join(files)}")
    chunk_bytes = chunk_bytes_for(sum(sizes))
    chunks: list[Chunk] = []
    for path, size in zip(files, sizes):
        with open(path, "rb") as f:
            start = 0
            while start < size:
                end = _cut(f, start + chunk_bytes, size)
                chunks.append(Chunk(len(chunks), path, start, end, end - start, end == size))
                start = end
    description = {"kind": "text", "source": source, "files": [{"path": p, "bytes": n} for p, n in zip(files, sizes)]}
    return Corpus(chunks, chunk_bytes, description, TextReader())


def _cut(f, target: int, size: int) -> int:
    """First chunk boundary at or after `target`: just past the next newline."""
    if target >= size:
        return size
    f.seek(target)
    scanned, step = 0, 4096  # lines are usually short: read small windows, growing
    while scanned < _MAX_LINE_BYTES:
        window = f.read(min(step, _MAX_LINE_BYTES - scanned))
        step *= 2
        if not window:
            return size
        newline = window.find(b"\n")
        if newline >= 0:
            return target + scanned + newline + 1
        scanned += len(window)
    # Pathological line: cut before the next byte that starts a UTF-8 character.
    f.seek(target)
    head = f.read(4)
    i = 0
    while i < len(head) and (head[i] & 0xC0) == 0x80:
        i += 1
    return target + i


class RowReader:
    def __init__(self, dataset, text_field: str):
        self.dataset = dataset.select_columns([text_field])  # memory-mapped Arrow: pickles by file
        self.text_field = text_field

    def read(self, chunk: Chunk, decode_errors: str) -> ChunkText:
        texts = self.dataset[chunk.start : chunk.end][self.text_field]
        return ChunkText([(t, True) for t in texts if t], 0)


def row_corpus(dataset, text_field: str, origin: str, description: dict) -> Corpus:
    """A `datasets.Dataset` with one document per row of `text_field`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if text_field not in dataset.column_names:
        raise DataError(
            f"data.text_field: column {text_field!r} not found in {origin} (columns: {', '.join(dataset.column_names)})"
        )
    column = dataset.data.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"data.text_field: column {text_field!r} of {origin} has type {column.type}, not string")
    lengths = pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    if lengths.sum() == 0:
        raise DataError(f"data.source: input is empty: {origin} has no text in column {text_field!r}")
    chunk_bytes = chunk_bytes_for(int(lengths.sum()))
    description = {**description, "text_field": text_field, "rows": len(lengths)}
    return Corpus(_row_chunks(lengths, origin, chunk_bytes), chunk_bytes, description, RowReader(dataset, text_field))


def _row_chunks(lengths: np.ndarray, origin: str, chunk_bytes: int) -> list[Chunk]:
    cumulative = np.cumsum(lengths)
    chunks, start, done = [], 0, 0
    while start < len(lengths):
        # Greedy: rows until at least chunk_bytes of text (at least one row).
        end = int(np.searchsorted(cumulative, done + chunk_bytes, side="left")) + 1
        end = min(max(end, start + 1), len(lengths))
        nbytes = int(cumulative[end - 1]) - done
        chunks.append(Chunk(len(chunks), origin, start, end, nbytes, True))
        start, done = end, int(cumulative[end - 1])
    return chunks


def _format_of(path: str) -> str:
    name = path.lower()
    for ext, fmt in _EXTENSIONS.items():
        if name.endswith(ext):
            return fmt
    return "text"


def _expand_local(source: str) -> list[str]:
    if os.path.isfile(source):
        return [source]
    if os.path.isdir(source):
        files = []
        for root, dirs, names in os.walk(source):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        if not files:
            raise DataError(f"data.source: directory {source!r} contains no files")
        return files
    if glob.has_magic(source):
        files = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"data.source: no files match {source!r}")
        return files
    raise DataError(f"data.source: {source!r} does not exist (not a file, directory, glob or hub dataset name)")


def _is_hub_name(source: str) -> bool:
    """'org/name' or 'name' that is not a local path (e.g. 'HuggingFaceFW/fineweb-edu')."""
    if os.path.exists(source) or glob.has_magic(source) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source):
        return False
    if "/" in source and os.path.isdir(source.split("/")[0]):
        return False  # 'data/missing.txt' is a missing local file, not a hub repo
    return _format_of(source) == "text" and not source.lower().endswith((".txt", ".md"))


def _require_hub_reachable(name: str) -> None:
    """Fail fast and clearly when the hub cannot be used, instead of hanging in retries."""
    hint = ("download it on a machine with network access (e.g. its parquet files) and point "
            "data.source at the local files")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise DataError(f"data.source: {name!r} is not a local path, so it names a Hugging Face hub "
                            f"dataset, but {var} is set: this machine is offline; {hint}")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    result: list[Optional[BaseException]] = [TimeoutError(f"no answer within {_HUB_PROBE_TIMEOUT_S:.0f}s")]

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
            result[0] = None
        except OSError as e:
            result[0] = e

    # A thread bounds the whole probe: DNS resolution ignores the socket timeout.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(_HUB_PROBE_TIMEOUT_S)
    if result[0] is not None:
        raise DataError(f"data.source: {name!r} is not a local path, so it names a Hugging Face hub "
                        f"dataset, but {host}:{port} is unreachable ({result[0]}): this machine looks "
                        f"offline; {hint}")


def _load_dataset(builder_or_name: str, origin: str, **kwargs):
    import datasets

    try:
        return datasets.load_dataset(builder_or_name, **kwargs)
    except Exception as e:  # datasets/pyarrow raise many types; name the input either way
        raise DataError(f"data.source: could not read {origin}: {type(e).__name__}: {e}") from None


def open_corpus(cfg: DataConfig, cache_dir: str) -> Corpus:
    """Resolve `cfg.source` to a chunked Corpus. Local structured inputs are converted to
    Arrow under `cache_dir` (the caller's scratch space)."""
    if cfg.format == "hub" or (cfg.format == "auto" and _is_hub_name(cfg.source)):
        _require_hub_reachable(cfg.source)
        ds = _load_dataset(cfg.source, cfg.source, name=cfg.hub_config, split=cfg.hub_split)
        description = {"kind": "hub", "source": cfg.source, "config": cfg.hub_config, "split": cfg.hub_split,
                       "fingerprint": getattr(ds, "_fingerprint", None)}
        return row_corpus(ds, cfg.text_field, cfg.source, description)

    files = _expand_local(cfg.source)
    formats = sorted({_format_of(p) for p in files})
    fmt = cfg.format
    if fmt == "auto":
        if len(formats) > 1:
            raise DataError(f"data.source: {cfg.source!r} mixes formats {formats}; set data.format or narrow the glob")
        fmt = formats[0]
    if fmt == "text":
        return text_corpus(cfg.source, files)
    empty = [p for p in files if os.path.getsize(p) == 0]
    if empty:
        raise DataError(f"data.source: input is empty: {', '.join(empty)}")
    origin = files[0] if len(files) == 1 else f"{cfg.source} ({len(files)} files)"
    ds = _load_dataset(_BUILDERS[fmt], origin, data_files=files, split="train", cache_dir=cache_dir)
    description = {"kind": fmt, "source": cfg.source, "files": [{"path": p, "bytes": os.path.getsize(p)} for p in files]}
    return row_corpus(ds, cfg.text_field, origin, description)
