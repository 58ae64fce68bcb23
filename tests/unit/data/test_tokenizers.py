"""Tokenizers round-trip text; hashes identify the serialized file."""

import hashlib
import json
import pickle
import random
import string

import numpy as np
import pytest

from megaroute.config import DataConfig, TokenizerConfig
from megaroute.data import DataError
from megaroute.data.prepare import prepare
from megaroute.data.tokenizers import CharTokenizer, HFTokenizer, hf_vocab_size, load_tokenizer, train_sentencepiece

from .hf_tokenizer_dirs import BOS, EOS, bpe_tokenizer_dir, gpt2_sized_tokenizer_dir

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


# ---------------------------------------------------------------------------------------
# kind hf: an existing Hugging Face tokenizer directory

HF_TEXTS = [SAMPLE, "", "hello world", "  leading spaces\n\n\ttabs", "The quick brown fox jumps over the lazy dog." * 5,
            "ünïcødé ☃ 🐍 中文 0123456789", "an <|endoftext|> inside the text"]


@pytest.fixture
def offline(monkeypatch):
    """transformers and huggingface_hub must not try the network: every tokenizer here is a local directory."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")


@pytest.mark.parametrize("bos_template", [False, True])
def test_hf_tokenizer_ids_equal_auto_tokenizer(tmp_path, offline, bos_template):
    from transformers import AutoTokenizer

    path = bpe_tokenizer_dir(tmp_path / "tok", bos_template=bos_template)
    ours = HFTokenizer.from_dir(str(path))
    theirs = AutoTokenizer.from_pretrained(str(path))
    assert ours.kind == "hf" and ours.vocab_size == len(theirs) == hf_vocab_size(str(path))
    assert ours.eos_id == theirs.eos_token_id == theirs.convert_tokens_to_ids(EOS)
    for text in HF_TEXTS:
        ids = ours.encode(text)
        # No special tokens are added (no BOS even where the tokenizer's template has one), as for the
        # other kinds; prepare appends the EOS after each document.
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert np.array_equal(ours.encode_array(text, np.uint16), ids) and ours.encode_array(text).dtype == np.int64
        assert ours.decode(ids) == text  # byte-level BPE: exact round trip, special tokens kept
    assert ours.encode("an <|endoftext|> inside").count(ours.eos_id) == 1  # a literal special token is that token
    if bos_template:
        assert theirs("a")["input_ids"][0] == theirs.convert_tokens_to_ids(BOS) != ours.encode("a")[0]


def test_hf_tokenizer_file_is_self_contained_and_hashed(tmp_path, offline):
    path = bpe_tokenizer_dir(tmp_path / "tok")
    tok = HFTokenizer.from_dir(str(path))
    again = HFTokenizer.from_dir(str(path / "tokenizer.json"))  # the file itself works too
    assert again.to_bytes() == tok.to_bytes() and tok.hash == hashlib.sha256(tok.to_bytes()).hexdigest()
    spec = json.loads(tok.to_bytes())
    assert spec["kind"] == "hf" and spec["special_tokens"] == {"eos_token": EOS}
    assert spec["source_sha256"] == hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()

    saved = tmp_path / "tokenizer-x.json"
    saved.write_bytes(tok.to_bytes())
    loaded = load_tokenizer(str(saved))  # what prepare's workers, training and the HF export load
    assert (loaded.kind, loaded.hash, loaded.eos_id, loaded.vocab_size, loaded.path) == \
           ("hf", tok.hash, tok.eos_id, tok.vocab_size, str(saved))
    unpickled = pickle.loads(pickle.dumps(loaded))
    for text in HF_TEXTS:
        assert loaded.encode(text) == unpickled.encode(text) == tok.encode(text)
    assert unpickled.hash == tok.hash and unpickled.path == str(saved)


def test_hf_tokenizer_special_tokens_from_the_directory(tmp_path, offline):
    # Like the hub's openai-community/gpt2: tokenizer_config.json names no EOS; <|endoftext|> is taken.
    gpt2 = HFTokenizer.from_dir(str(gpt2_sized_tokenizer_dir(tmp_path / "gpt2")))
    assert (gpt2.vocab_size, gpt2.eos_id) == (50257, 50256) == (hf_vocab_size(str(tmp_path / "gpt2")), 50256)
    assert gpt2.encode("w5 w7 nope") == [5, 7, 0]
    # special_tokens_map.json (AddedToken dict form) when tokenizer_config.json names none.
    tok = HFTokenizer.from_dir(str(bpe_tokenizer_dir(tmp_path / "map", tokenizer_config={}, bos_template=True,
                                                     special_tokens_map={"eos_token": {"content": BOS}})))
    assert [tok.eos_id] == tok.encode(BOS) and tok.special_tokens == {"eos_token": BOS}
    # No EOS anywhere: none (documents are concatenated, as with the char kind).
    no_eos = tmp_path / "no_eos"
    bpe_tokenizer_dir(no_eos, tokenizer_config=None)
    spec = json.loads((no_eos / "tokenizer.json").read_text())
    spec["added_tokens"][0]["special"] = False
    (no_eos / "tokenizer.json").write_text(json.dumps(spec))
    assert HFTokenizer.from_dir(str(no_eos)).eos_id is None
    # An EOS the vocabulary lacks is an error, naming the directory's file.
    bad = bpe_tokenizer_dir(tmp_path / "bad", tokenizer_config={"eos_token": "</s>"})
    with pytest.raises(DataError, match=r"data.tokenizer.path: .*tokenizer.json: its eos_token '</s>' is not in"):
        HFTokenizer.from_dir(str(bad))


def test_hf_tokenizer_bad_paths_name_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data.tokenizer.path: .*missing not found"):
        HFTokenizer.from_dir(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.tokenizer.path: .*empty has no tokenizer.json"):
        HFTokenizer.from_dir(str(tmp_path / "empty"))
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(DataError, match="use data.tokenizer.kind=file"):
        HFTokenizer.from_dir(str(tmp_path / "sp"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"data.tokenizer.path: .*tokenizer.json is not valid JSON"):
        HFTokenizer.from_dir(str(tmp_path / "junk"))
    with pytest.raises(DataError, match=r"data.tokenizer.path: .*tokenizer.json"):
        hf_vocab_size(str(tmp_path / "junk"))
    (tmp_path / "junk" / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(DataError, match=r"data.tokenizer.path: .*tokenizer.json: not a valid Hugging Face tokenizer"):
        HFTokenizer.from_dir(str(tmp_path / "junk"))
    # A raw tokenizer.json is not a megaroute tokenizer file: the error says how to use it.
    raw = bpe_tokenizer_dir(tmp_path / "raw") / "tokenizer.json"
    with pytest.raises(DataError, match="use data.tokenizer.kind=hf"):
        load_tokenizer(str(raw))


def test_hf_kind_needs_a_path():
    from megaroute.config import ConfigError

    with pytest.raises(ConfigError, match="data.tokenizer.path"):
        DataConfig(tokenizer=TokenizerConfig(kind="hf")).validate("data")
