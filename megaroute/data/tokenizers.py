"""Tokenizers: SentencePiece (trained here, or an existing `.model`) and character-level.

A tokenizer is fully defined by one serialized file (`.model` for SentencePiece, `.json`
for char); `.hash` is the sha256 of that file's bytes. The hash is recorded in the shard
index so training can refuse shards made with a different tokenizer.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Iterable, Optional, Protocol, Sequence

import numpy as np
import sentencepiece as spm

from . import INDEX_FILE, DataError

# SentencePiece's unigram trainer gives different pieces for different thread counts, so the
# count is a constant rather than os.cpu_count(): the same corpus gives the same tokenizer
# (and hash) on every machine and for every data.num_workers.
_TRAINER_THREADS = 4


class Tokenizer(Protocol):
    kind: str  # "sentencepiece" | "char"
    suffix: str  # file extension of the serialized form
    vocab_size: int
    eos_id: Optional[int]
    hash: str  # sha256 hex of the serialized file
    path: Optional[str]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        """Token ids as a numpy array (the fast path used by `prepare`)."""
        ...

    def to_bytes(self) -> bytes: ...


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SentencePieceTokenizer:
    kind = "sentencepiece"
    suffix = ".model"

    def __init__(self, model_proto: bytes, path: Optional[str] = None):
        self._proto = bytes(model_proto)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
        except RuntimeError as e:
            raise DataError(f"{path or 'tokenizer'}: not a valid SentencePiece model ({e})") from None
        self.vocab_size = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        self.eos_id = eos if eos >= 0 else None
        self.hash = _sha256(self._proto)
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def to_bytes(self) -> bytes:
        return self._proto

    def __reduce__(self):  # the SWIG processor does not pickle; the proto bytes do
        return (SentencePieceTokenizer, (self._proto, self.path))


class CharTokenizer:
    """One id per Unicode code point, ids in code-point order. No EOS token."""

    kind = "char"
    suffix = ".json"
    eos_id = None

    def __init__(self, chars: Iterable[str], path: Optional[str] = None):
        chars = sorted(set(chars))
        if not chars or any(len(c) != 1 for c in chars):
            raise DataError(f"{path or 'char tokenizer'}: vocabulary must be a non-empty set of single characters")
        self._chars = chars
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)
        self.vocab_size = len(chars)
        self.path = path
        self.hash = _sha256(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, path: Optional[str] = None) -> "CharTokenizer":
        try:
            spec = json.loads(data.decode("utf-8"))
            assert spec["kind"] == "char" and spec["version"] == 1
            chars = spec["chars"]
        except Exception:
            raise DataError(f"{path or 'char tokenizer'}: not a megaroute char tokenizer file") from None
        tok = cls(chars, path)
        tok.hash = _sha256(data)  # the file as it is on disk, even if not in canonical form
        return tok

    def to_bytes(self) -> bytes:
        return (json.dumps({"kind": "char", "version": 1, "chars": self._chars}, ensure_ascii=True) + "\n").encode()

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        # Vectorized lookup: code points -> rank in the sorted vocabulary.
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codepoints, cps)
        ok = ids < self.vocab_size
        ok[ok] = self._codepoints[ids[ok]] == cps[ok]
        if not ok.all():
            bad = chr(int(cps[np.argmin(ok)]))
            raise DataError(f"{self.path or 'char tokenizer'}: character {bad!r} is not in the vocabulary")
        return ids.astype(dtype)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._chars[int(i)] for i in ids)


def tokenizer_from_bytes(data: bytes, suffix: str, path: Optional[str] = None) -> Tokenizer:
    if suffix == ".model":
        return SentencePieceTokenizer(data, path)
    if suffix == ".json":
        return CharTokenizer.from_bytes(data, path)
    raise DataError(f"{path}: unknown tokenizer file type {suffix!r} (expected .model or .json)")


def load_tokenizer(output_dir_or_file: str) -> Tokenizer:
    """Load the tokenizer of a prepared dataset directory (via its index) or a tokenizer file."""
    path = output_dir_or_file
    if os.path.isdir(path):
        index_path = os.path.join(path, INDEX_FILE)
        if not os.path.isfile(index_path):
            raise DataError(f"{index_path}: not found; run `megaroute data prepare` first")
        with open(index_path) as f:
            try:
                name = json.load(f)["tokenizer"]["file"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{index_path}: malformed index (no tokenizer.file)") from None
        path = os.path.join(path, name)
    if not os.path.isfile(path):
        raise DataError(f"{path}: tokenizer file not found")
    with open(path, "rb") as f:
        data = f.read()
    return tokenizer_from_bytes(data, os.path.splitext(path)[1], path)


def train_sentencepiece(
    sentences: Iterable[str],
    vocab_size: int,
    model_type: str = "bpe",
    byte_fallback: bool = True,
) -> SentencePieceTokenizer:
    """Train a Llama-style SentencePiece model in memory.

    Identity normalization and no whitespace collapsing keep text exactly round-trippable
    (code, indentation); newline is a user-defined piece because the trainer sees text one
    line at a time and would otherwise never learn it. ids: unk=0, bos=1, eos=2, no pad.
    """
    sentences = iter(sentences)
    first = next(sentences, None)
    if first is None:
        raise DataError("data.tokenizer: the tokenizer training sample is empty")

    def all_sentences():
        yield first
        yield from sentences

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_sentences(),
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            byte_fallback=byte_fallback,
            character_coverage=0.9995 if byte_fallback else 1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=["\n"],
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            # Small corpora cannot always fill the requested vocab; the index records the real size.
            hard_vocab_limit=False,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            num_threads=_TRAINER_THREADS,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(f"data.tokenizer.vocab_size={vocab_size}: SentencePiece training failed: {e}") from None
    return SentencePieceTokenizer(model.getvalue())
