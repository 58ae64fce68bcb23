"""`prepare`: corpus -> tokenizer -> packed token shards + index.json.

Output directory:

    index.json                        the only entry point; written last with os.replace. Each shard
                                      entry records {file, num_tokens, sha256, min_id, max_id}: the id
                                      range lets a loader reject ids >= the model's vocabulary without
                                      reading the shard.
    tokenizer-<sha12>.model | .json   the tokenizer, named by its content hash
    train-00000-<sha12>.bin ...       raw little-endian uint16 (vocab <= 65536) or uint32 ids,
    val-00000-<sha12>.bin ...         readable with np.memmap; no header

Determinism: the corpus is cut into chunks at content-defined boundaries (see ingest.py);
chunks are encoded in parallel but written in chunk order, so the bytes do not depend on
`data.num_workers`. The train/val split is a function of chunk index and `data.seed`.

Atomicity: everything is written into a staging directory inside output_dir, fsynced and
moved into place, and index.json is replaced last. Shard and tokenizer names carry their
content hash, so moving new files in never changes the bytes of a file the previous index
refers to: a prepare interrupted at any point leaves the previous index and all of its
files valid. Files no index refers to are deleted after the commit.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np
from tqdm import tqdm

from .. import __version__
from ..config.schema import DataConfig
from ..paths import dir_problem
from . import INDEX_FILE, INDEX_VERSION, DataError
from .ingest import Chunk, Corpus, check_source, open_corpus
from .tokenizers import (CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer, tokenizer_from_bytes,
                         train_sentencepiece)

SPLITS = ("train", "val")
# Corpora smaller than this per worker are tokenized in-process.
MIN_BYTES_PER_WORKER = 8 << 20
# Chunks per worker round trip: each trip costs ~ms of IPC in the parent, so send about
# _CALLS_PER_WORKER batches per worker (load balance), each at most _MAX_CALL_BYTES of text.
_CALLS_PER_WORKER = 16
_MAX_CALL_BYTES = 8 << 20
_STAGING_PREFIX = ".staging-"
_OWNED_FILE = re.compile(r"^(?:(?:train|val)-\d{5}-[0-9a-f]{12}\.bin|tokenizer-[0-9a-f]{12}\.(?:model|json))$")
# The tokenizer kinds read from data.tokenizer.path rather than trained on the corpus.
_GIVEN_KINDS = ("file", "hf")


def prepare(cfg: DataConfig, progress: bool = True) -> dict:
    """Tokenize `cfg.source` into packed shards under `cfg.output_dir`; returns the index."""
    check_output_dir(cfg)  # a DataError naming the key, rather than an OSError from makedirs
    out = cfg.output_dir
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    try:
        with _exclusive(out):
            for name in os.listdir(out):  # left by a killed run; safe to remove under the lock
                if name.startswith(_STAGING_PREFIX):
                    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
            staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out)
            try:
                index = _prepare_into(cfg, staging, progress)
                _commit(staging, out, index)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        if created:  # nothing of ours worth keeping
            shutil.rmtree(out, ignore_errors=True)
        raise
    return index


def preflight(cfg: DataConfig, model_vocab_size: Optional[int] = None) -> None:
    """Cheap checks of what `prepare(cfg)` needs, for callers that prepare later (pretrain, after its
    process group starts): the source exists, is not empty and decodes (`ingest.check_source`), a
    `tokenizer.kind=file|hf` tokenizer loads (and, given `model_vocab_size`, fits in model.vocab_size),
    and `output_dir` is (or can be created as) a writable directory. Raises DataError naming the key
    and file; writes nothing."""
    check_source(cfg)
    given = given_tokenizer(cfg)
    if given is not None and model_vocab_size is not None and given.vocab_size > model_vocab_size:
        raise DataError(f"data.tokenizer.path: the tokenizer at {cfg.tokenizer.path} has {given.vocab_size} ids, "
                        f"more than model.vocab_size={model_vocab_size}; set model.vocab_size >= {given.vocab_size}")
    check_output_dir(cfg)


def check_output_dir(cfg: DataConfig) -> None:
    """`output_dir` is (or can be created as) a writable directory. Raises DataError; writes nothing."""
    problem = dir_problem(cfg.output_dir)
    if problem:
        raise DataError(f"data.output_dir: {problem}")


def assign_splits(num_chunks: int, val_fraction: float, seed: int) -> list[str]:
    """Systematic sampling: chunk i is validation iff floor((i+1)f + u) > floor(i f + u), with
    u in [0, 1) drawn from `seed`. Gives floor(n f + u) validation chunks spread evenly over the
    corpus, and depends on nothing but (i, f, seed)."""
    u = np.random.default_rng(seed).random()
    i = np.arange(num_chunks)
    is_val = np.floor((i + 1) * val_fraction + u) > np.floor(i * val_fraction + u)
    return ["val" if v else "train" for v in is_val]


def _prepare_into(cfg: DataConfig, staging: str, progress: bool) -> dict:
    given = given_tokenizer(cfg)  # before the corpus: converting Parquet/JSONL to Arrow can take hours
    corpus = open_corpus(cfg, cache_dir=os.path.join(staging, "hf_cache"))
    splits = assign_splits(len(corpus.chunks), cfg.val_fraction, cfg.seed)
    for split in SPLITS:
        if split not in splits:
            raise DataError(
                f"data.val_fraction={cfg.val_fraction}: the corpus has {len(corpus.chunks)} chunk(s) of "
                f"~{corpus.chunk_bytes // 1024} KiB, too few to give the {split} split any; use more data or "
                "change data.val_fraction"
            )
    state = _WorkerState(corpus.reader, cfg.decode_errors)
    # Worker start-up (~0.5 s each) only pays off on larger corpora; output is identical either way.
    workers = min(cfg.num_workers, max(1, _total_bytes(corpus.chunks) // MIN_BYTES_PER_WORKER))
    with _ChunkMap(workers, state) as chunk_map:
        tokenizer = given or _make_tokenizer(cfg, corpus, splits, state, chunk_map, progress)
        tokenizer_file = f"tokenizer-{tokenizer.hash[:12]}{tokenizer.suffix}"
        _write_file(os.path.join(staging, tokenizer_file), tokenizer.to_bytes())
        dtype = np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<u4")
        writers = {s: _ShardWriter(staging, s, dtype, cfg.shard_tokens) for s in SPLITS}
        try:
            stats, replaced = _tokenize(corpus, splits, chunk_map, os.path.join(staging, tokenizer_file),
                                        dtype, writers, progress)
            shards = {s: w.close() for s, w in writers.items()}
        finally:
            for w in writers.values():
                w.abort()
    for split in SPLITS:
        if not shards[split]:
            raise DataError(f"data.source: the {split} split of {cfg.source!r} tokenized to 0 tokens")
    return _index(cfg, corpus, tokenizer, tokenizer_file, dtype, shards, stats, replaced)


def _index(cfg: DataConfig, corpus: Corpus, tokenizer: Tokenizer, tokenizer_file: str, dtype: np.dtype,
           shards: dict, stats: dict, replaced: Counter) -> dict:
    tokenizer_info = {"kind": tokenizer.kind, "file": tokenizer_file, "sha256": tokenizer.hash}
    if cfg.tokenizer.kind == "sentencepiece":
        tokenizer_info.update(model_type=cfg.tokenizer.model_type, byte_fallback=cfg.tokenizer.byte_fallback)
    elif cfg.tokenizer.kind in _GIVEN_KINDS:
        tokenizer_info["source_path"] = cfg.tokenizer.path
    # Everything that determines the output; nothing that does not (so re-runs are byte-identical).
    recorded = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("output_dir", "num_workers")}
    return {
        "version": INDEX_VERSION,
        "created_by": f"megaroute {__version__}",
        "dtype": dtype.name,
        "byte_order": "little",
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "seq_len": cfg.seq_len,
        "tokenizer": tokenizer_info,
        "source": corpus.description,
        "split": {"method": "systematic-chunk", "val_fraction": cfg.val_fraction, "seed": cfg.seed,
                  "chunk_bytes": corpus.chunk_bytes},
        "splits": {
            s: {"num_tokens": sum(x["num_tokens"] for x in shards[s]), **stats[s], "shards": shards[s]}
            for s in SPLITS
        },
        "decode_errors": {"mode": cfg.decode_errors, "replaced": sum(replaced.values()),
                          "by_file": dict(sorted(replaced.items()))},
        "config": recorded,
    }


# ---------------------------------------------------------------------------------------
# Tokenizer


def given_tokenizer(cfg: DataConfig) -> Optional[Tokenizer]:
    """The tokenizer data.tokenizer.path names (kind file: a SentencePiece `.model` or megaroute tokenizer
    file; kind hf: a Hugging Face tokenizer directory), or None for the kinds trained on the corpus.
    Raises DataError naming data.tokenizer.path."""
    tcfg = cfg.tokenizer
    if tcfg.kind == "hf":
        return HFTokenizer.from_dir(tcfg.path)
    if tcfg.kind == "file":
        if not os.path.isfile(tcfg.path):
            raise DataError(f"data.tokenizer.path: {tcfg.path} not found")
        with open(tcfg.path, "rb") as f:
            return tokenizer_from_bytes(f.read(), os.path.splitext(tcfg.path)[1], tcfg.path)
    return None


def _make_tokenizer(cfg: DataConfig, corpus: Corpus, splits: list[str], state, chunk_map, progress: bool) -> Tokenizer:
    tcfg = cfg.tokenizer
    if tcfg.kind == "char":
        chars: set[str] = set()
        bar = tqdm(total=_total_bytes(corpus.chunks), unit="B", unit_scale=True, desc="scan chars", disable=not progress)
        with bar:
            for chunk, found in zip(corpus.chunks, chunk_map(_scan_chars, corpus.chunks)):
                chars |= found
                bar.update(chunk.nbytes)
        if len(chars) > tcfg.vocab_size:
            raise DataError(f"data.tokenizer.vocab_size={tcfg.vocab_size}: the corpus has {len(chars)} distinct characters")
        return CharTokenizer(chars)
    return train_sentencepiece(_training_sample(cfg, corpus, splits, state), tcfg.vocab_size,
                               tcfg.model_type, tcfg.byte_fallback)


def _training_sample(cfg: DataConfig, corpus: Corpus, splits: list[str], state) -> Iterator[str]:
    """Lines of ~sample_chars characters from train chunks taken in a seeded random order."""
    train = [i for i, s in enumerate(splits) if s == "train"]
    budget = cfg.tokenizer.sample_chars
    for i in np.random.default_rng(cfg.seed).permutation(train):
        for text, _ in state.read(corpus.chunks[i]).pieces:
            text = text[:budget]
            budget -= len(text)
            yield from (line for line in text.split("\n") if line)
            if budget <= 0:
                return


# ---------------------------------------------------------------------------------------
# Parallel map over chunks


@dataclasses.dataclass
class _Encoded:
    tokens: np.ndarray
    documents: int
    replaced: int


class _WorkerState:
    """What a worker needs: the corpus reader and, once known, the tokenizer (from its file)."""

    def __init__(self, reader, decode_errors: str):
        self.reader = reader
        self.decode_errors = decode_errors
        self._tokenizer: Optional[Tokenizer] = None

    def read(self, chunk: Chunk):
        return self.reader.read(chunk, self.decode_errors)

    def tokenizer(self, path: str) -> Tokenizer:
        if self._tokenizer is None or self._tokenizer.path != path:
            self._tokenizer = load_tokenizer(path)
        return self._tokenizer


def _scan_chars(state: _WorkerState, chunk: Chunk) -> set[str]:
    found: set[str] = set()
    for text, _ in state.read(chunk).pieces:
        found.update(text)
    return found


def _encode_chunk(state: _WorkerState, chunk: Chunk, tokenizer_file: str, dtype: np.dtype) -> _Encoded:
    tokenizer = state.tokenizer(tokenizer_file)
    text = state.read(chunk)
    parts, documents = [], 0
    eos = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id], dtype=dtype)
    for piece, ends_document in text.pieces:
        parts.append(tokenizer.encode_array(piece, dtype))
        if ends_document:
            documents += 1
            if eos is not None:
                parts.append(eos)
    if not parts:
        tokens = np.empty(0, dtype)
    else:
        tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return _Encoded(tokens, documents, text.replaced)


# Set once per worker process by the pool initializer; never used in the parent.
_worker_state: Optional[_WorkerState] = None


def _init_worker(state: _WorkerState) -> None:
    global _worker_state
    _worker_state = state


def _call_in_worker(task):
    fn, chunk, args = task
    return fn(_worker_state, chunk, *args)


class _ChunkMap:
    """`chunk_map(fn, chunks, *args)` yields fn(state, chunk, *args) in chunk order, computed by
    `num_workers` processes (or inline when num_workers == 1)."""

    def __init__(self, num_workers: int, state: _WorkerState):
        self._state = state
        self._workers = num_workers
        self._pool = None
        if num_workers > 1:
            # spawn, not fork: the caller may have threads (pyarrow, torch) that fork would break.
            # An executor (unlike mp.Pool) fails instead of hanging when a worker dies.
            self._pool = ProcessPoolExecutor(num_workers, mp_context=mp.get_context("spawn"),
                                             initializer=_init_worker, initargs=(state,))
            self._pool.submit(int)  # start the workers now, overlapping tokenizer training

    def __call__(self, fn, chunks: list[Chunk], *args) -> Iterator:
        if self._pool is None:
            return (fn(self._state, c, *args) for c in chunks)
        by_count = len(chunks) // (self._workers * _CALLS_PER_WORKER)
        by_bytes = _MAX_CALL_BYTES // max(1, max((c.nbytes for c in chunks), default=1))
        per_call = max(1, min(by_count, by_bytes))
        tasks = [(fn, c, args) for c in chunks]
        return self._results(self._pool.map(_call_in_worker, tasks, chunksize=per_call))

    @staticmethod
    def _results(results: Iterator) -> Iterator:
        try:
            yield from results
        except BrokenProcessPool:
            raise DataError(
                "a prepare worker process died; if prepare() is called from a script, guard the call "
                "with `if __name__ == '__main__':` (workers are spawned and re-import the main module)"
            ) from None

    def __enter__(self) -> "_ChunkMap":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------
# Writing


def _total_bytes(chunks: list[Chunk]) -> int:
    return sum(c.nbytes for c in chunks)


def _tokenize(corpus: Corpus, splits: list[str], chunk_map, tokenizer_file: str, dtype, writers, progress: bool):
    stats = {s: {"num_documents": 0, "num_chunks": 0} for s in SPLITS}
    replaced: Counter = Counter()
    tokens = 0
    bar = tqdm(total=_total_bytes(corpus.chunks), unit="B", unit_scale=True, desc="tokenize", disable=not progress)
    with bar:
        for chunk, enc in zip(corpus.chunks, chunk_map(_encode_chunk, corpus.chunks, tokenizer_file, dtype)):
            split = splits[chunk.index]
            writers[split].write(enc.tokens)
            stats[split]["num_documents"] += enc.documents
            stats[split]["num_chunks"] += 1
            if enc.replaced:
                replaced[chunk.origin] += enc.replaced
            tokens += len(enc.tokens)
            if not bar.disable:
                bar.set_postfix(tokens=tokens, refresh=False)
            bar.update(chunk.nbytes)
    return stats, replaced


class _ShardWriter:
    """Streams token arrays into shards of at most `shard_tokens` tokens, hashing as it goes.
    A finished shard is renamed from `<split>-<i>.partial` to its content-addressed name."""

    def __init__(self, directory: str, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                self._tmp = os.path.join(self.directory, f"{self.split}-{len(self.shards):05d}.partial")
                self._file, self._sha, self._count = open(self._tmp, "wb"), hashlib.sha256(), 0
                self._min_id, self._max_id = None, None
            take = np.ascontiguousarray(tokens[: self.shard_tokens - self._count], dtype=self.dtype)
            if len(take):  # the id range of what is written, for the loader's cheap vocabulary check
                low, high = int(take.min()), int(take.max())
                self._min_id = low if self._min_id is None else min(self._min_id, low)
                self._max_id = high if self._max_id is None else max(self._max_id, high)
            data = memoryview(take).cast("B")
            self._file.write(data)
            self._sha.update(data)
            self._count += len(take)
            tokens = tokens[len(take) :]
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> list[dict]:
        if self._file is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        digest = self._sha.hexdigest()
        name = f"{self.split}-{len(self.shards):05d}-{digest[:12]}.bin"
        os.replace(self._tmp, os.path.join(self.directory, name))
        self.shards.append({"file": name, "num_tokens": self._count, "sha256": digest,
                            "min_id": self._min_id, "max_id": self._max_id})


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_index(staging: str, out: str, index: dict) -> None:
    tmp = os.path.join(staging, INDEX_FILE)
    _write_file(tmp, (json.dumps(index, indent=2) + "\n").encode())
    os.replace(tmp, os.path.join(out, INDEX_FILE))
    _fsync_dir(out)


def _commit(staging: str, out: str, index: dict) -> None:
    names = [index["tokenizer"]["file"]] + [s["file"] for split in index["splits"].values() for s in split["shards"]]
    for name in names:  # content-addressed: never changes a file the old index refers to
        os.replace(os.path.join(staging, name), os.path.join(out, name))
    _fsync_dir(out)
    _write_index(staging, out, index)
    keep = set(names)
    for name in os.listdir(out):
        if _OWNED_FILE.match(name) and name not in keep:
            os.remove(os.path.join(out, name))


@contextmanager
def _exclusive(directory: str):
    """One prepare per output directory at a time (flock on the directory itself)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"data.output_dir: another `prepare` is writing to {directory}") from None
        except OSError:
            pass  # a filesystem without flock (some NFS mounts): the lock is best effort
        yield
    finally:
        os.close(fd)
