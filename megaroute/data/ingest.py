"""Corpus ingestion: resolve `data.source` into a deterministic list of chunks, and read them.

A chunk is the unit of parallel work and of the train/val split. Its boundaries depend only
on the corpus, never on the number of workers, which is what makes `prepare` output
byte-identical for any `data.num_workers`.

- text files: byte ranges of about `chunk_bytes`, cut just after a newline. UTF-8 never has
  0x0A inside a multi-byte character, so such a cut is a character boundary and workers can
  decode their range independently. Each file is one document.
- jsonl / parquet / arrow (read with `datasets.load_dataset(builder, data_files=...)`) and hub
  datasets: runs of consecutive rows holding about `chunk_bytes` of text. Each row is a document.
  A directory source with one of these as data.format holds the files of that format below it
  (a downloaded dataset's README.md is not an input); Parquet is read for data.text_field only.

`chunk_bytes` is 16 KiB, doubled (up to 4 MiB) until the corpus has at most ~4096 chunks: small
corpora still get a fine-grained train/val split, large ones a short chunk list.

Undecodable input, per kind of source:

- text files: `data.decode_errors=replace` substitutes U+FFFD for invalid UTF-8 and counts the
  substitutions, `strict` raises DataError naming the file and the absolute byte offset. A file
  with a NUL byte in its first 8000 bytes (git's binary test) is not text at all (gzip, zip, a
  .bin shard, UTF-16): it is rejected in either mode instead of being tokenized as U+FFFD soup.
- JSONL (.jsonl/.json, optionally .gz): JSON is UTF-8 and `datasets`' JSON reader does not check
  it (it fails later, on first access, with a bare UnicodeDecodeError), so every file is
  stream-decoded first; invalid UTF-8 or a corrupt gzip stream raises DataError naming the file
  (and the byte offset, counted in the decompressed stream), whatever `data.decode_errors` says.
- Parquet / Arrow: a file whose schema cannot be read (not Parquet/Arrow, truncated) raises
  DataError naming it; their string columns are UTF-8 by construction.

`check_source(cfg)` runs these checks (and the missing/empty ones) without tokenizing or
converting anything, so a launcher can reject bad input before any process group starts.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import os
import re
import socket
import threading
import zlib
from dataclasses import dataclass
from typing import NamedTuple, Optional
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config.schema import DataConfig
from . import DataError

MIN_CHUNK_BYTES = 16 << 10
_MAX_CHUNK_BYTES = 4 << 20
_TARGET_CHUNKS = 4096
# A "line" longer than this is cut at a character boundary instead of at a newline.
_MAX_LINE_BYTES = 1 << 20
_HUB_PROBE_TIMEOUT_S = 3.0
# A NUL byte this early means "not a text file" (the same test git and grep use).
_BINARY_SNIFF_BYTES = 8000
_SCAN_BLOCK_BYTES = 1 << 20
_STRICT_HINT = "set data.decode_errors=replace to substitute U+FFFD and count the substitutions"

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
                f"{origin}: invalid UTF-8 at byte offset {offset + e.start} ({e.reason}); {_STRICT_HINT}"
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


def require_text(path: str) -> None:
    """DataError unless `path` looks like a text file (no NUL byte in its first 8000 bytes)."""
    with open(path, "rb") as f:
        head = f.read(_BINARY_SNIFF_BYTES)
    nul = head.find(b"\0")
    if nul >= 0:
        kind = "gzip-compressed" if head.startswith(b"\x1f\x8b") else "binary"
        raise DataError(
            f"data.source: {path} is not a text file ({kind}: NUL byte at offset {nul}); decompress it or "
            "convert it to UTF-8 text, or give JSONL/Parquet/Arrow files their extension (or set data.format)"
        )


def check_utf8(path: str, hint: str = "") -> None:
    """Stream-decodes `path` (gunzipped when it ends in .gz) as strict UTF-8 in 1 MiB blocks;
    DataError naming the file and the absolute byte offset of the first invalid sequence."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    opener = gzip.open if path.lower().endswith(".gz") else open
    offset = 0  # bytes fed to the decoder so far
    try:
        with opener(path, "rb") as f:
            while True:
                block = f.read(_SCAN_BLOCK_BYTES)
                pending = len(decoder.getstate()[0])  # an incomplete sequence carried over
                try:
                    decoder.decode(block, final=not block)
                except UnicodeDecodeError as e:  # e.start indexes pending + block
                    raise DataError(f"{path}: invalid UTF-8 at byte offset {offset - pending + e.start} "
                                    f"({e.reason}){'; ' + hint if hint else ''}") from None
                if not block:
                    return
                offset += len(block)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"data.source: could not read {path}: {type(e).__name__}: {e}") from None


def _text_sizes(files: list[str], strict_utf8: bool = False) -> list[int]:
    """Sizes of plain text files, after checking the input is not empty and every file is text
    (and, when `strict_utf8`, that it decodes in full)."""
    sizes = [os.path.getsize(p) for p in files]
    if sum(sizes) == 0:
        raise DataError(f"data.source: input is empty: {', '.join(files)}")
    for path, size in zip(files, sizes):
        if size:
            require_text(path)
            if strict_utf8:
                check_utf8(path, _STRICT_HINT)
    return sizes


def text_corpus(source: str, files: list[str]) -> Corpus:
    """Plain text files; each file is a document."""
    sizes = _text_sizes(files)
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
    # Imported here, not at the top: `datasets` takes ~0.5 s to import, and every rank of every launch
    # imports this module for the pre-flight checks, while only jsonl/parquet/arrow/hub sources read through it.
    import datasets

    try:
        return datasets.load_dataset(builder_or_name, **kwargs)
    except Exception as e:  # datasets/pyarrow raise many types; name the input either way
        raise DataError(f"data.source: could not read {origin}: {type(e).__name__}: {e}") from None


def _is_hub(cfg: DataConfig) -> bool:
    return cfg.format == "hub" or (cfg.format == "auto" and _is_hub_name(cfg.source))


def _local_format(cfg: DataConfig, files: list[str]) -> str:
    if cfg.format != "auto":
        return cfg.format
    formats = sorted({_format_of(p) for p in files})
    if len(formats) > 1:
        raise DataError(f"data.source: {cfg.source!r} mixes formats {formats}; set data.format or narrow the glob")
    return formats[0]


def _local_files(cfg: DataConfig) -> tuple[list[str], str]:
    """The files of a local `cfg.source` and their format. A directory with an explicit structured
    data.format means its files of that format: a downloaded dataset (e.g. fineweb-edu's parquet
    shards) also holds README.md, LICENSE and the like."""
    files = _expand_local(cfg.source)
    if cfg.format in _BUILDERS and os.path.isdir(cfg.source):
        matching = [p for p in files if _format_of(p) == cfg.format]
        if not matching:
            raise DataError(f"data.source: directory {cfg.source!r} has no {cfg.format} files "
                            f"(data.format={cfg.format}; names ending in "
                            f"{', '.join(e for e, f in _EXTENSIONS.items() if f == cfg.format)})")
        files = matching
    return files, _local_format(cfg, files)


def _check_structured(files: list[str], fmt: str, text_field: str) -> None:
    """Non-empty, readable and (JSONL) valid UTF-8; Parquet/Arrow: the schema has `text_field`."""
    empty = [p for p in files if os.path.getsize(p) == 0]
    if empty:
        raise DataError(f"data.source: input is empty: {', '.join(empty)}")
    for path in files:
        if fmt == "jsonl":
            check_utf8(path, "JSON must be UTF-8 (data.decode_errors applies to text files only)")
            continue
        try:
            if fmt == "parquet":
                names = pq.read_schema(path).names
            else:  # what datasets' arrow builder reads: the IPC stream format, else the file format
                with open(path, "rb") as f:
                    try:
                        names = pa.ipc.open_stream(f).schema.names
                    except pa.ArrowInvalid:
                        f.seek(0)
                        names = pa.ipc.open_file(f).schema.names
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"data.source: {path} is not a readable {fmt} file ({type(e).__name__}: {e})") from None
        if text_field not in names:
            raise DataError(f"data.text_field: column {text_field!r} not found in {path} (columns: {', '.join(names)})")


def check_source(cfg: DataConfig) -> None:
    """Pre-flight check of `cfg.source`: raises the DataError `open_corpus`/`prepare` would raise for
    a missing, empty or undecodable input, without tokenizing or converting anything.

    Cost: text files are sniffed (8000 bytes each) and, with decode_errors=strict, stream-decoded;
    JSONL files are stream-decoded (they must be UTF-8); Parquet/Arrow files have their schema read.
    A hub name is probed for reachability (at most 3 s). What needs the whole corpus tokenized (a
    split left empty by data.val_fraction, too many characters for a char vocabulary) is still
    found by `prepare`."""
    if _is_hub(cfg):
        _require_hub_reachable(cfg.source)
        return
    files, fmt = _local_files(cfg)
    if fmt != "text":
        _check_structured(files, fmt, cfg.text_field)
        return
    _text_sizes(files, strict_utf8=cfg.decode_errors == "strict")


def open_corpus(cfg: DataConfig, cache_dir: str) -> Corpus:
    """Resolve `cfg.source` to a chunked Corpus. Local structured inputs are converted to
    Arrow under `cache_dir` (the caller's scratch space)."""
    if _is_hub(cfg):
        _require_hub_reachable(cfg.source)
        ds = _load_dataset(cfg.source, cfg.source, name=cfg.hub_config, split=cfg.hub_split)
        description = {"kind": "hub", "source": cfg.source, "config": cfg.hub_config, "split": cfg.hub_split,
                       "fingerprint": getattr(ds, "_fingerprint", None)}
        return row_corpus(ds, cfg.text_field, cfg.source, description)

    files, fmt = _local_files(cfg)
    if fmt == "text":
        return text_corpus(cfg.source, files)
    _check_structured(files, fmt, cfg.text_field)
    origin = files[0] if len(files) == 1 else f"{cfg.source} ({len(files)} files)"
    # Parquet: read only the text column (fineweb-edu's url/dump/score... columns are not converted).
    columns = {"columns": [cfg.text_field]} if fmt == "parquet" else {}
    ds = _load_dataset(_BUILDERS[fmt], origin, data_files=files, split="train", cache_dir=cache_dir, **columns)
    description = {"kind": fmt, "source": cfg.source, "files": [{"path": p, "bytes": os.path.getsize(p)} for p in files]}
    return row_corpus(ds, cfg.text_field, origin, description)
