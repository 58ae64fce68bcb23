"""Tokenizers: SentencePiece (trained here, or an existing `.model`), character-level, and an
existing Hugging Face fast tokenizer (a directory with tokenizer.json, `HFTokenizer`).

A tokenizer is fully defined by one serialized file (`.model` for SentencePiece, `.json`
for char and hf); `.hash` is the sha256 of that file's bytes. The hash is recorded in the shard
index so training can refuse shards made with a different tokenizer.
"""

from __future__ import annotations

import functools
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
    kind: str  # "sentencepiece" | "char" | "hf"
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
        return _json_tokenizer(data, path)
    raise DataError(f"{path}: unknown tokenizer file type {suffix!r} (expected .model or .json)")


# ---------------------------------------------------------------------------------------
# An existing Hugging Face tokenizer (data.tokenizer.kind=hf)

HF_TOKENIZER_FILE = "tokenizer.json"
# Files of a Hugging Face tokenizer directory that name its special tokens; the first that names one wins.
_HF_SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_HF_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# The EOS when those files name none (GPT-2's hub files do not: its transformers class supplies
# <|endoftext|>): the first of these that is a special token of the tokenizer.
_HF_EOS_FALLBACKS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("data.tokenizer.kind=hf needs the `tokenizers` package: pip install 'megaroute[hf]'") from None
    return tokenizers


def hf_tokenizer_file(path: str) -> str:
    """The tokenizer.json of `path`: a Hugging Face tokenizer directory, or that file itself.
    DataError naming data.tokenizer.path when there is none."""
    if not path or not os.path.exists(path):
        raise DataError(f"data.tokenizer.path: {path} not found (kind hf needs a Hugging Face tokenizer directory "
                        f"with a {HF_TOKENIZER_FILE})")
    if os.path.isfile(path):
        return path
    file = os.path.join(path, HF_TOKENIZER_FILE)
    if not os.path.isfile(file):
        hint = ("; it has a SentencePiece tokenizer.model: use data.tokenizer.kind=file with data.tokenizer.path="
                "<that file>") if os.path.isfile(os.path.join(path, "tokenizer.model")) else ""
        raise DataError(f"data.tokenizer.path: {path} has no {HF_TOKENIZER_FILE} (kind hf reads a Hugging Face "
                        f"fast-tokenizer directory; vocab.json/merges.txt alone are not read){hint}")
    return file


def _json_vocab_size(spec, origin: str) -> int:
    """1 + the largest id of a parsed tokenizer.json: its model's vocabulary and its added tokens."""
    try:
        vocab = spec["model"]["vocab"]
        top = max(vocab.values()) if isinstance(vocab, dict) else len(vocab) - 1  # Unigram: a list
        top = max([top] + [int(t["id"]) for t in spec.get("added_tokens") or []])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise DataError(f"{origin}: not a Hugging Face tokenizer.json (no model.vocab)") from None
    return top + 1


def hf_vocab_size(path: str) -> int:
    """The vocabulary size of the Hugging Face tokenizer at `path` (directory or tokenizer.json), as
    `HFTokenizer.vocab_size` reports it, from the JSON alone (no `tokenizers` import): what config
    validation compares with model.vocab_size. Cached per file version."""
    file = hf_tokenizer_file(path)
    st = os.stat(file)
    return _cached_hf_vocab_size(os.path.realpath(file), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _cached_hf_vocab_size(file: str, mtime_ns: int, size: int) -> int:
    return _json_vocab_size(_read_json(file, "data.tokenizer.path: "), f"data.tokenizer.path: {file}")


def _read_json(file: str, prefix: str = ""):
    try:
        with open(file, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{prefix}{file}: not readable JSON ({type(e).__name__}: {e})") from None


def _hf_special_tokens(directory: str, tokenizer: dict) -> dict:
    """bos/eos/unk/pad token strings named by tokenizer_config.json or special_tokens_map.json (a string,
    or an AddedToken dict with "content"); the EOS falls back to a conventional special token."""
    special: dict[str, str] = {}
    for name in _HF_SPECIAL_FILES:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            continue
        spec = _read_json(file, "data.tokenizer.path: ")
        if not isinstance(spec, dict):
            continue
        for key in _HF_SPECIAL_KEYS:
            value = spec.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value and key not in special:
                special[key] = value
    if "eos_token" not in special:
        added = {t.get("content") for t in tokenizer.get("added_tokens") or [] if isinstance(t, dict) and t.get("special")}
        fallback = next((t for t in _HF_EOS_FALLBACKS if t in added), None)
        if fallback is not None:
            special["eos_token"] = fallback
    return {k: special[k] for k in _HF_SPECIAL_KEYS if k in special}


class HFTokenizer:
    """An existing Hugging Face fast tokenizer (its tokenizer.json), run by the `tokenizers` library.

    - Encoding adds no special tokens (`add_special_tokens=False`: a post-processor's BOS template is
      not applied), as for the other kinds; `prepare` appends `eos_id` after every document. A special
      token written literally in the text (e.g. "<|endoftext|>") encodes to that token, as in
      transformers. Decoding keeps special tokens.
    - `vocab_size` is 1 + the largest id, added tokens included: the embedding rows a model needs
      (model.vocab_size may be larger, e.g. rounded up to a multiple of 128).
    - `eos_id`: the `eos_token` of tokenizer_config.json, else of special_tokens_map.json, else the first
      of <|endoftext|>, <|end_of_text|>, </s>, <eos> that is a special token of the tokenizer; None when
      there is none (documents are then concatenated without a separator, as with `char`).
    - Serialized form (`tokenizer-<sha12>.json` beside the shards; `.hash` is its sha256): one JSON
      object {"kind": "hf", "version": 1, "special_tokens": {"eos_token": ..., ...}, "source_sha256":
      <sha256 of the tokenizer.json read>, "tokenizer": <that tokenizer.json>}, so that file alone
      reloads it (prepare's workers, training, the Hugging Face export).
    """

    kind = "hf"
    suffix = ".json"

    def __init__(self, spec: dict, data: bytes, path: Optional[str] = None, origin: Optional[str] = None):
        origin = origin or path or "hf tokenizer"
        tokenizers = _import_tokenizers()
        try:
            self._tk = tokenizers.Tokenizer.from_str(json.dumps(spec["tokenizer"]))
        except Exception as e:  # the Rust deserializer raises a bare Exception
            raise DataError(f"{origin}: not a valid Hugging Face tokenizer ({e})") from None
        self._spec, self._data = spec, bytes(data)
        self.special_tokens: dict[str, str] = dict(spec.get("special_tokens") or {})
        eos = self.special_tokens.get("eos_token")
        self.eos_id: Optional[int] = None if eos is None else self._tk.token_to_id(eos)
        if eos is not None and self.eos_id is None:
            raise DataError(f"{origin}: its eos_token {eos!r} is not in the tokenizer's vocabulary")
        self.vocab_size = max(self._tk.get_vocab(with_added_tokens=True).values()) + 1
        self.hash = _sha256(self._data)
        self.path = path

    @classmethod
    def from_dir(cls, path: str) -> "HFTokenizer":
        """The tokenizer of a Hugging Face tokenizer directory (or its tokenizer.json; tokenizer_config.json
        and special_tokens_map.json are read beside it). Errors name data.tokenizer.path."""
        file = hf_tokenizer_file(path)
        with open(file, "rb") as f:
            raw = f.read()
        try:
            tokenizer = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise DataError(f"data.tokenizer.path: {file} is not valid JSON ({e})") from None
        if not isinstance(tokenizer, dict) or "model" not in tokenizer:
            raise DataError(f"data.tokenizer.path: {file} is not a Hugging Face tokenizer.json (no model)")
        spec = {"kind": "hf", "version": 1, "special_tokens": _hf_special_tokens(os.path.dirname(file), tokenizer),
                "source_sha256": _sha256(raw), "tokenizer": tokenizer}
        data = (json.dumps(spec, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        return cls(spec, data, origin=f"data.tokenizer.path: {file}")

    @classmethod
    def from_bytes(cls, data: bytes, path: Optional[str] = None, spec: Optional[dict] = None) -> "HFTokenizer":
        if spec is None:
            try:
                spec = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                spec = None
        if not (isinstance(spec, dict) and spec.get("kind") == "hf" and spec.get("version") == 1
                and isinstance(spec.get("tokenizer"), dict)):
            raise DataError(f"{path or 'hf tokenizer'}: not a megaroute hf tokenizer file")
        return cls(spec, data, path)

    @property
    def tokenizer_json(self) -> str:
        """The Hugging Face tokenizer.json this tokenizer runs."""
        return json.dumps(self._spec["tokenizer"], ensure_ascii=False)

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        return np.asarray(self._tk.encode(text, add_special_tokens=False).ids, dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_bytes(self) -> bytes:
        return self._data

    def __reduce__(self):  # rebuilt from the serialized file, like SentencePiece
        return (HFTokenizer.from_bytes, (self._data, self.path))


def _json_tokenizer(data: bytes, path: Optional[str]) -> Tokenizer:
    """A megaroute `.json` tokenizer file: char or hf, told apart by its "kind"."""
    try:
        spec = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        spec = None
    if isinstance(spec, dict) and spec.get("kind") == "hf":
        return HFTokenizer.from_bytes(data, path, spec)
    if isinstance(spec, dict) and "kind" not in spec and "model" in spec:
        raise DataError(f"{path or 'tokenizer'}: a Hugging Face tokenizer.json, not a megaroute tokenizer file; "
                        "use data.tokenizer.kind=hf with data.tokenizer.path=<its directory>")
    return CharTokenizer.from_bytes(data, path)


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
