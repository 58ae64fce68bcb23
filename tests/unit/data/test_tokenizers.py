"""Tokenizers round-trip text; hashes identify the serialized file."""

import hashlib
import random
import string

import numpy as np
import pytest

from megaroute.config import DataConfig, TokenizerConfig
from megaroute.data import DataError
from megaroute.data.prepare import prepare
from megaroute.data.tokenizers import CharTokenizer, load_tokenizer, train_sentencepiece

# Newlines, runs of spaces, tabs, digits, accents and an emoji (byte fallback) must all survive.
SAMPLE = "First Citizen:\n  Before we proceed\tany further, hear me speak.\n\nAll: 1234 café ☃ 🐍 done.\n"


def corpus_lines(n_lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 8))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))).capitalize() + rng.choice(".,;!?")
            for _ in range(n_lines)]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_round_trips_text(model_type):
    tok = train_sentencepiece(corpus_lines(3000) + SAMPLE.split("\n"), vocab_size=600, model_type=model_type)
    assert tok.kind == "sentencepiece" and tok.vocab_size == 600 and tok.eos_id == 2
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert max(ids) < tok.vocab_size
    assert np.array_equal(tok.encode_array(SAMPLE), ids)
    assert tok.hash == hashlib.sha256(tok.to_bytes()).hexdigest()


def test_sentencepiece_training_is_deterministic():
    lines = corpus_lines(2000)
    a = train_sentencepiece(lines, vocab_size=500, model_type="unigram")
    b = train_sentencepiece(lines, vocab_size=500, model_type="unigram")
    assert a.to_bytes() == b.to_bytes() and a.hash == b.hash


def test_sentencepiece_bad_vocab_size_names_the_key():
    with pytest.raises(DataError, match="data.tokenizer.vocab_size"):
        train_sentencepiece(corpus_lines(200), vocab_size=20, byte_fallback=True)


def test_char_tokenizer_round_trips_and_rejects_unknown(tmp_path):
    tok = CharTokenizer(set(SAMPLE))
    assert tok.eos_id is None and tok.vocab_size == len(set(SAMPLE))
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert ids == [sorted(set(SAMPLE)).index(c) for c in SAMPLE]  # ids are code-point ranks
    with pytest.raises(DataError, match="'Z' is not in the vocabulary"):
        tok.encode("Z")
    path = tmp_path / "tok.json"
    path.write_bytes(tok.to_bytes())
    loaded = load_tokenizer(str(path))
    assert loaded.hash == tok.hash == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.encode(SAMPLE) == ids and loaded.path == str(path)


def test_existing_model_file_round_trips_and_keeps_ids(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines(6000)) + "\n" + SAMPLE)
    trained = prepare(DataConfig(source=str(corpus), output_dir=str(tmp_path / "a"), val_fraction=0.2,
                                 num_workers=1, tokenizer=TokenizerConfig(vocab_size=700)), progress=False)
    model_file = tmp_path / "a" / trained["tokenizer"]["file"]
    assert model_file.suffix == ".model"

    reused = prepare(DataConfig(source=str(corpus), output_dir=str(tmp_path / "b"), val_fraction=0.2, num_workers=1,
                                tokenizer=TokenizerConfig(kind="file", path=str(model_file))), progress=False)
    assert reused["tokenizer"]["sha256"] == trained["tokenizer"]["sha256"]
    assert reused["splits"] == trained["splits"]  # same ids, same shards
    tok = load_tokenizer(str(tmp_path / "b"))  # via the index
    assert tok.hash == trained["tokenizer"]["sha256"]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert load_tokenizer(str(model_file)).encode(SAMPLE) == tok.encode(SAMPLE)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="index.json: not found"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "broken.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="broken.model: not a valid SentencePiece model"):
        load_tokenizer(str(bad))
    missing = tmp_path / "nope.model"
    with pytest.raises(DataError, match="nope.model: tokenizer file not found"):
        load_tokenizer(str(missing))
