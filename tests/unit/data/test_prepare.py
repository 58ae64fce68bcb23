"""prepare: packed shards + index, determinism, ingestion formats, bad input, atomicity."""

import json
import os
import random
import socket
import string
import time
from pathlib import Path

import numpy as np
import pytest

import megaroute.data.prepare as prep
from megaroute.config import DataConfig, TokenizerConfig
from megaroute.data import DataError
from megaroute.data.ingest import MIN_CHUNK_BYTES as CHUNK_BYTES, chunk_bytes_for, open_corpus
from megaroute.data.loader import PackedDataset
from megaroute.data.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[3]


def make_text(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 9))) for _ in range(500)]
    lines, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(2, 15))) + rng.choice(".,;:!?")
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


def config(source, out, **kw) -> DataConfig:
    kw.setdefault("tokenizer", TokenizerConfig(kind="char"))
    kw.setdefault("val_fraction", 0.2)
    kw.setdefault("num_workers", 1)
    return DataConfig(source=str(source), output_dir=str(out), **kw)


def stream(out: Path, index: dict, split: str) -> np.ndarray:
    return np.concatenate([np.fromfile(out / s["file"], dtype=index["dtype"]) for s in index["splits"][split]["shards"]])


def dir_bytes(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(make_text(12 * CHUNK_BYTES))
    return path


def test_index_describes_shards_and_stream_is_the_text(tmp_path, corpus):
    out = tmp_path / "out"
    index = prep.prepare(config(corpus, out, shard_tokens=50_000), progress=False)
    assert json.loads((out / "index.json").read_text()) == index
    assert index["dtype"] == "uint16" and index["eos_id"] is None and index["version"] == 1
    tok = load_tokenizer(str(out))
    assert index["vocab_size"] == tok.vocab_size and index["tokenizer"]["sha256"] == tok.hash
    train, val = index["splits"]["train"], index["splits"]["val"]
    assert len(train["shards"]) > 1 and all(s["num_tokens"] <= 50_000 for s in train["shards"])
    for split in ("train", "val"):
        for shard in index["splits"][split]["shards"]:
            assert (out / shard["file"]).stat().st_size == 2 * shard["num_tokens"]
            ids = np.fromfile(out / shard["file"], dtype=np.uint16)  # the id range the loader checks cheaply
            assert (shard["min_id"], shard["max_id"]) == (int(ids.min()), int(ids.max()))
    assert set(os.listdir(out)) == {"index.json", index["tokenizer"]["file"],
                                    *(s["file"] for sp in index["splits"].values() for s in sp["shards"])}

    # Re-interleave the two streams chunk by chunk (char tokens: one per character): the
    # result is the corpus, i.e. nothing was lost, duplicated or reordered.
    text = corpus.read_text()
    chunks = open_corpus(config(corpus, out), str(tmp_path / "cache")).chunks
    splits = prep.assign_splits(len(chunks), 0.2, 1234)
    assert (splits.count("train"), splits.count("val")) == (train["num_chunks"], val["num_chunks"])
    assert 0 < val["num_chunks"] < train["num_chunks"]
    streams = {s: iter(tok.decode(stream(out, index, s))) for s in ("train", "val")}
    rebuilt = "".join("".join(next(streams[split]) for _ in range(c.end - c.start)) for c, split in zip(chunks, splits))
    assert rebuilt == text


def test_assign_splits_is_deterministic_and_proportional():
    a = prep.assign_splits(1000, 0.05, seed=7)
    assert a == prep.assign_splits(1000, 0.05, seed=7)
    assert a != prep.assign_splits(1000, 0.05, seed=8)
    assert a.count("val") in (50, 51)
    gaps = np.diff([i for i, s in enumerate(a) if s == "val"])
    assert gaps.min() >= 19 and gaps.max() <= 21  # spread evenly, not clumped


def test_chunk_size_grows_with_the_corpus():
    assert chunk_bytes_for(1) == chunk_bytes_for(50 << 20) == CHUNK_BYTES
    assert chunk_bytes_for(1 << 30) == 256 << 10  # 1 GiB: 4096 chunks of 256 KiB
    assert chunk_bytes_for(1 << 40) == 4 << 20  # capped


@pytest.mark.parametrize("tokenizer", [TokenizerConfig(kind="char"), TokenizerConfig(vocab_size=400, model_type="unigram")],
                         ids=["char", "sentencepiece"])
def test_byte_identical_for_any_num_workers_and_on_rerun(tmp_path, corpus, monkeypatch, tokenizer):
    one = prep.prepare(config(corpus, tmp_path / "one", shard_tokens=40_000, tokenizer=tokenizer), progress=False)
    monkeypatch.setattr(prep, "MIN_BYTES_PER_WORKER", 1)  # force the process pool on a small corpus
    two = prep.prepare(config(corpus, tmp_path / "two", num_workers=2, shard_tokens=40_000, tokenizer=tokenizer),
                       progress=True)
    assert one == two
    assert dir_bytes(tmp_path / "one") == dir_bytes(tmp_path / "two")
    before = dir_bytes(tmp_path / "one")
    prep.prepare(config(corpus, tmp_path / "one", shard_tokens=40_000, tokenizer=tokenizer), progress=False)
    assert dir_bytes(tmp_path / "one") == before


def test_sentencepiece_prepare_appends_eos_per_document(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(6):
        (src / f"part{i}.txt").write_text(make_text(CHUNK_BYTES // 2, seed=i))
    (src / ".hidden").write_text("ignored")
    index = prep.prepare(config(src, tmp_path / "out", tokenizer=TokenizerConfig(vocab_size=500), val_fraction=0.3),
                         progress=False)
    assert index["eos_id"] == 2 and len(index["source"]["files"]) == 6
    n_docs = index["splits"]["train"]["num_documents"] + index["splits"]["val"]["num_documents"]
    eos = sum(int((stream(tmp_path / "out", index, s) == 2).sum()) for s in ("train", "val"))
    assert n_docs == eos == 6


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_structured_formats_through_datasets(tmp_path, fmt):
    import datasets

    docs = [make_text(2000, seed=i) for i in range(40)] + [""]  # an empty document is skipped
    ds = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
    src = tmp_path / f"docs.{fmt}"
    if fmt == "jsonl":
        ds.to_json(str(src))
    elif fmt == "parquet":
        ds.to_parquet(str(src))
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        src = next((tmp_path / "saved").glob("*.arrow"))
    out = tmp_path / "out"
    index = prep.prepare(config(src, out, val_fraction=0.25), progress=False)
    assert index["source"]["kind"] == fmt and index["source"]["rows"] == 41
    tok = load_tokenizer(str(out))
    text = tok.decode(stream(out, index, "train")) + tok.decode(stream(out, index, "val"))
    assert sorted(text) == sorted("".join(docs))
    assert index["splits"]["train"]["num_documents"] + index["splits"]["val"]["num_documents"] == 40
    assert not any(name.startswith(".staging") for name in os.listdir(out))

    with pytest.raises(DataError, match="data.text_field: column 'body' not found"):
        prep.prepare(config(src, tmp_path / "bad", text_field="body"), progress=False)


def test_uint32_when_vocab_exceeds_uint16(tmp_path):
    chars = [chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c < 0xE000]
    random.Random(0).shuffle(chars)
    src = tmp_path / "wide.txt"
    src.write_text("\n".join("".join(chars[i : i + 500]) for i in range(0, len(chars), 500)) + "\n")
    index = prep.prepare(config(src, tmp_path / "out", tokenizer=TokenizerConfig(kind="char", vocab_size=100_000)),
                         progress=False)
    assert index["dtype"] == "uint32" and index["vocab_size"] > 1 << 16
    ds = PackedDataset(str(tmp_path / "out"), "train", seq_len=64, verify="full")
    assert ds.tokens(0, ds.num_tokens).max() >= 1 << 16
    with pytest.raises(DataError, match="data.tokenizer.vocab_size=8192: the corpus has"):
        prep.prepare(config(src, tmp_path / "small"), progress=False)


# ---------------------------------------------------------------------------------------
# Bad input


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(DataError, match=r"data.source: '.*nope.txt' does not exist"):
        prep.prepare(config(tmp_path / "nope.txt", tmp_path / "o1"), progress=False)
    empty = tmp_path / "empty.txt"
    empty.touch()
    with pytest.raises(DataError, match=r"data.source: input is empty: .*empty.txt"):
        prep.prepare(config(empty, tmp_path / "o2"), progress=False)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="contains no files"):
        prep.prepare(config(tmp_path / "emptydir", tmp_path / "o3"), progress=False)
    with pytest.raises(DataError, match="no files match"):
        prep.prepare(config(tmp_path / "*.parquet", tmp_path / "o4"), progress=False)
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.touch()
    with pytest.raises(DataError, match=r"input is empty: .*empty.jsonl"):
        prep.prepare(config(empty_jsonl, tmp_path / "o5"), progress=False)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("just one chunk\n")
    with pytest.raises(DataError, match=r"data.val_fraction=0.2: the corpus has 1 chunk"):
        prep.prepare(config(tiny, tmp_path / "o6"), progress=False)
    # Nothing half-written: output directories that did not exist are not left behind.
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))


def _with_bad_bytes(tmp_path) -> tuple[Path, int]:
    good = make_text(4 * CHUNK_BYTES).encode()
    # Two invalid sequences (a lone continuation byte, a truncated 3-byte sequence) and one
    # genuine U+FFFD that must not be counted as a substitution.
    data = good[:30_000] + b"\x80" + good[30_000:50_000] + "\ufffd".encode() + b"\xe2\x82" + b"\n" + good[50_000:]
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    return path, 30_000


def test_undecodable_bytes_replace_mode_counts_substitutions(tmp_path):
    path, _ = _with_bad_bytes(tmp_path)
    index = prep.prepare(config(path, tmp_path / "out", decode_errors="replace"), progress=False)
    assert index["decode_errors"] == {"mode": "replace", "replaced": 2, "by_file": {str(path): 2}}
    tok = load_tokenizer(str(tmp_path / "out"))
    text = tok.decode(stream(tmp_path / "out", index, "train")) + tok.decode(stream(tmp_path / "out", index, "val"))
    assert text.count("\ufffd") == 3


def test_undecodable_bytes_strict_mode_names_file_and_offset(tmp_path):
    path, offset = _with_bad_bytes(tmp_path)
    with pytest.raises(DataError, match=rf"bad.txt: invalid UTF-8 at byte offset {offset} .*data.decode_errors=replace"):
        prep.prepare(config(path, tmp_path / "out", decode_errors="strict"), progress=False)
    assert not (tmp_path / "out").exists()


def test_strict_utf8_scan_names_the_offset_across_block_boundaries(tmp_path, monkeypatch):
    import megaroute.data.ingest as ingest

    path, offset = _with_bad_bytes(tmp_path)
    for block in (7, 4096, 1 << 20):  # 7: the truncated 3-byte sequence straddles blocks
        monkeypatch.setattr(ingest, "_SCAN_BLOCK_BYTES", block)
        with pytest.raises(DataError, match=rf"bad.txt: invalid UTF-8 at byte offset {offset} .*decode_errors=replace"):
            ingest.check_source(config(path, tmp_path / "out", decode_errors="strict"))
    # The same offset for a sequence cut by the end of the file (an incomplete final character).
    good = make_text(5000).encode()
    (tmp_path / "cut.txt").write_bytes(good + "é".encode()[:1])
    monkeypatch.setattr(ingest, "_SCAN_BLOCK_BYTES", 64)
    with pytest.raises(DataError, match=rf"cut.txt: invalid UTF-8 at byte offset {len(good)} "):
        ingest.check_source(config(tmp_path / "cut.txt", tmp_path / "out", decode_errors="strict"))
    ingest.check_source(config(path, tmp_path / "out", decode_errors="replace"))  # replace mode: by design, fine
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", ["replace", "strict"])
def test_binary_file_is_not_text_in_either_mode(tmp_path, mode):
    import gzip

    import megaroute.data.ingest as ingest

    gz = tmp_path / "corpus.txt.gz"
    gz.write_bytes(gzip.compress(make_text(50_000).encode()))
    for check in (lambda c: ingest.check_source(c), lambda c: prep.prepare(c, progress=False)):
        with pytest.raises(DataError, match=r"data.source: .*corpus.txt.gz is not a text file \(gzip-compressed"):
            check(config(gz, tmp_path / "out", decode_errors=mode))
    shard = tmp_path / "shards" / "train-00000.bin"  # e.g. data.source pointed at prepared output
    shard.parent.mkdir()
    np.arange(60_000, dtype=np.uint16).tofile(shard)
    with pytest.raises(DataError, match=r"train-00000.bin is not a text file \(binary: NUL byte at offset 0\)"):
        ingest.check_source(config(shard.parent, tmp_path / "out", decode_errors=mode))


def test_structured_inputs_undecodable(tmp_path):
    import gzip

    import megaroute.data.ingest as ingest

    # JSONL with invalid UTF-8: datasets loads it and fails only on access, with a bare
    # UnicodeDecodeError; both the pre-flight check and prepare name the file and offset.
    lines = b"".join(b'{"text": "%s"}\n' % make_text(200, seed=i).replace("\n", " ").encode() for i in range(200))
    bad = lines + b'{"text": "bad \xff byte"}\n'
    (tmp_path / "bad.jsonl").write_bytes(bad)
    for check in (lambda c: ingest.check_source(c), lambda c: prep.prepare(c, progress=False)):
        with pytest.raises(DataError,
                           match=rf"bad.jsonl: invalid UTF-8 at byte offset {len(lines) + 14} .*JSON must be UTF-8"):
            check(config(tmp_path / "bad.jsonl", tmp_path / "out"))
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(bad))
    with pytest.raises(DataError, match=rf"bad.jsonl.gz: invalid UTF-8 at byte offset {len(lines) + 14} "):
        ingest.check_source(config(tmp_path / "bad.jsonl.gz", tmp_path / "out"))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(lines)[:-20])
    with pytest.raises(DataError, match=r"data.source: could not read .*cut.jsonl.gz: EOFError"):
        ingest.check_source(config(tmp_path / "cut.jsonl.gz", tmp_path / "out"))
    (tmp_path / "good.jsonl").write_bytes(lines)
    ingest.check_source(config(tmp_path / "good.jsonl", tmp_path / "out"))

    (tmp_path / "fake.parquet").write_text("this is not parquet\n" * 10)
    (tmp_path / "fake.arrow").write_text("nor is this arrow\n" * 10)
    for name, fmt in (("fake.parquet", "parquet"), ("fake.arrow", "arrow")):
        for check in (lambda c: ingest.check_source(c), lambda c: prep.prepare(c, progress=False)):
            with pytest.raises(DataError, match=rf"data.source: .*{name} is not a readable {fmt} file"):
                check(config(tmp_path / name, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_check_source_rejects_what_prepare_rejects_without_writing(tmp_path):
    import datasets

    import megaroute.data.ingest as ingest

    (tmp_path / "empty.txt").touch()
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "empty.jsonl").touch()
    cases = [(tmp_path / "nope.txt", r"'.*nope.txt' does not exist"), (tmp_path / "empty.txt", "input is empty"),
             (tmp_path / "emptydir", "contains no files"), (tmp_path / "*.parquet", "no files match"),
             (tmp_path / "empty.jsonl", r"input is empty: .*empty.jsonl")]
    for source, message in cases:
        with pytest.raises(DataError, match=message):
            ingest.check_source(config(source, tmp_path / "out"))
    src = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"body": ["some text"] * 10}).to_parquet(str(src))
    with pytest.raises(DataError, match=r"data.text_field: column 'text' not found in .*docs.parquet "
                                        r"\(columns: body\)"):
        ingest.check_source(config(src, tmp_path / "out"))
    ingest.check_source(config(src, tmp_path / "out", text_field="body"))
    assert not (tmp_path / "out").exists()


def test_hub_name_offline_fails_fast_without_network(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the offline check must not touch the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataError, match=r"'HuggingFaceFW/fineweb-edu' is not a local path.*HF_HUB_OFFLINE.*offline"):
        prep.prepare(config("HuggingFaceFW/fineweb-edu", tmp_path / "out", text_field="text"), progress=False)
    assert time.monotonic() - start < 5
    assert not (tmp_path / "out").exists()


def test_hub_unreachable_fails_fast(tmp_path, monkeypatch):
    def unreachable(*args, **kwargs):
        raise OSError("Network is unreachable")

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"huggingface.co:443 is unreachable \(Network is unreachable\).*offline"):
        prep.prepare(config("some-org/some-dataset", tmp_path / "out", format="hub"), progress=False)
    assert time.monotonic() - start < 5


def test_local_looking_missing_path_is_not_treated_as_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError, match="'data/missing' does not exist"):
        prep.prepare(config("data/missing", tmp_path / "out"), progress=False)


# ---------------------------------------------------------------------------------------
# Atomicity


def _assert_consistent(out: Path, index_bytes: bytes) -> None:
    """The index is unchanged and every file it names is intact."""
    assert (out / "index.json").read_bytes() == index_bytes
    for split in ("train", "val"):
        PackedDataset(str(out), split, seq_len=8, verify="full")
    assert not any(name.startswith(".staging") for name in os.listdir(out))


@pytest.mark.parametrize("where", ["writer", "index"])
def test_interrupted_prepare_keeps_previous_output(tmp_path, corpus, monkeypatch, where):
    out = tmp_path / "out"
    prep.prepare(config(corpus, out, shard_tokens=30_000), progress=False)
    good_index = (out / "index.json").read_bytes()

    if where == "writer":  # mid-way through writing shards
        original, calls = prep._ShardWriter.write, []

        def write(self, tokens):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt("simulated kill")
            original(self, tokens)

        monkeypatch.setattr(prep._ShardWriter, "write", write)
    else:  # after the new shards were moved in, before the new index replaced the old one
        def write_index(*args):
            raise KeyboardInterrupt("simulated kill")

        monkeypatch.setattr(prep, "_write_index", write_index)

    # Different content (seed changes the split), so the new shards differ from the old ones.
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(config(corpus, out, shard_tokens=30_000, seed=99), progress=False)
    _assert_consistent(out, good_index)

    monkeypatch.undo()
    index = prep.prepare(config(corpus, out, shard_tokens=30_000, seed=99), progress=False)
    assert (out / "index.json").read_bytes() != good_index
    _assert_consistent(out, (out / "index.json").read_bytes())
    referenced = {index["tokenizer"]["file"], *(s["file"] for sp in index["splits"].values() for s in sp["shards"])}
    assert set(os.listdir(out)) == referenced | {"index.json"}  # the old shards were collected


def test_first_prepare_interrupted_leaves_no_index(tmp_path, corpus, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(prep._ShardWriter, "write", lambda self, tokens: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        prep.prepare(config(corpus, out), progress=False)
    assert os.listdir(out) == []


def test_bundled_configs_exist_and_load():
    from megaroute.config import load_config

    for name in ("tinyshakespeare_char", "tinyshakespeare_bpe"):
        cfg = load_config(str(REPO / "configs" / "data" / f"{name}.yaml"))
        assert cfg.data.source == "data/tinyshakespeare.txt"
        assert (REPO / cfg.data.source).is_file()


# ---------------------------------------------------------------------------------------
# A local FineWeb-Edu-style Parquet directory with an existing Hugging Face tokenizer (kind hf)


def _fineweb_like(root: Path) -> list[str]:
    """Parquet shards under root/sample/10BT/ with FineWeb-Edu's extra columns, next to what a download
    also holds (README.md, a hidden .cache/); returns the non-empty documents in shard order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = root / "sample" / "10BT"
    shards.mkdir(parents=True)
    rng, docs = random.Random(0), []
    for i in range(3):
        texts = [make_text(rng.randint(200, 3000), seed=10 * i + j) for j in range(30)]
        texts[3] = ""  # an empty document is skipped
        texts[5] += " ünïcødé ☃ 🐍\n\ttabs"
        pq.write_table(pa.table({"text": texts, "id": [f"<urn:uuid:{i}-{j}>" for j in range(30)],
                                 "score": [rng.random() * 5 for _ in range(30)], "int_score": [3] * 30}),
                       shards / f"{i:03d}_00000.parquet", row_group_size=7)
        docs += [t for t in texts if t]
    (root / "README.md").write_text("---\nlicense: odc-by\n---\n# FineWeb-Edu\n")
    (root / ".cache").mkdir()
    (root / ".cache" / "download.lock").write_text("")
    return docs


def test_fineweb_parquet_directory_with_hf_tokenizer_end_to_end(tmp_path):
    """The shipped data config, pointed at local files: a directory of Parquet shards and a Hugging Face
    tokenizer directory. Every document is its ids then the EOS; nothing is lost or duplicated."""
    from dataclasses import replace

    from megaroute.config import load_config
    from megaroute.data.tokenizers import HFTokenizer

    from .hf_tokenizer_dirs import bpe_tokenizer_dir

    docs = _fineweb_like(tmp_path / "fineweb-edu")
    tok_dir = bpe_tokenizer_dir(tmp_path / "gpt2")
    out = tmp_path / "prepared"
    cfg = load_config(str(REPO / "configs" / "data" / "fineweb_edu_parquet.yaml"),
                      [f"data.source={tmp_path / 'fineweb-edu'}", f"data.tokenizer.path={tok_dir}",
                       f"data.output_dir={out}", "data.num_workers=1", "data.val_fraction=0.2"])
    assert (cfg.data.format, cfg.data.tokenizer.kind) == ("parquet", "hf")
    index = prep.prepare(cfg.data, progress=False)

    ref = HFTokenizer.from_dir(str(tok_dir))
    tok = load_tokenizer(str(out))
    assert tok.kind == index["tokenizer"]["kind"] == "hf" and tok.hash == ref.hash == index["tokenizer"]["sha256"]
    assert (index["vocab_size"], index["eos_id"], index["dtype"]) == (ref.vocab_size, ref.eos_id, "uint16")
    assert ref.eos_id is not None and index["tokenizer"]["source_path"] == str(tok_dir)
    shards = sorted(str(p) for p in (tmp_path / "fineweb-edu").rglob("*.parquet"))
    assert [f["path"] for f in index["source"]["files"]] == shards  # README.md and .cache/ are not read
    assert index["source"]["rows"] == 90

    train, val = stream(out, index, "train"), stream(out, index, "val")
    splits = index["splits"]
    assert splits["train"]["num_documents"] + splits["val"]["num_documents"] == len(docs)
    assert splits["train"]["num_tokens"] == len(train) and splits["val"]["num_tokens"] == len(val)
    assert len(train) + len(val) == sum(len(ref.encode(d)) + 1 for d in docs)
    decoded = []
    for ids in (train, val):
        assert ids[-1] == ref.eos_id  # whole documents per split
        ends = np.flatnonzero(ids == ref.eos_id)
        decoded += [tok.decode(piece[:-1]) for piece in np.split(ids, ends + 1)[:-1]]
    assert sorted(decoded) == sorted(docs)
    assert [d for d in docs if d in set(decoded[:splits["train"]["num_documents"]])] == \
           decoded[:splits["train"]["num_documents"]]  # in corpus order

    # What a run opens: the model's padded vocabulary (50304) and the tokenizer hash.
    ds = PackedDataset(str(out), "train", seq_len=64, vocab_size=cfg.model.vocab_size, tokenizer_hash=tok.hash,
                       verify="full")
    assert ds.num_tokens == len(train)
    # Deterministic: the same config gives the same bytes.
    prep.prepare(replace(cfg.data, output_dir=str(tmp_path / "again")), progress=False)
    assert dir_bytes(out) == dir_bytes(tmp_path / "again")


def test_parquet_directory_takes_its_parquet_files(tmp_path):
    import megaroute.data.ingest as ingest

    _fineweb_like(tmp_path / "ds")
    with pytest.raises(DataError, match=r"mixes formats \['parquet', 'text'\]; set data.format"):
        ingest.check_source(config(tmp_path / "ds", tmp_path / "out"))  # auto: README.md is text
    ingest.check_source(config(tmp_path / "ds", tmp_path / "out", format="parquet"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("text\n")
    with pytest.raises(DataError, match=r"data.source: directory '.*notes' has no parquet files"):
        prep.prepare(config(tmp_path / "notes", tmp_path / "o2", format="parquet"), progress=False)
    assert not (tmp_path / "o2").exists()


def test_hf_tokenizer_checked_before_the_corpus_is_read(tmp_path, monkeypatch):
    from dataclasses import replace

    from .hf_tokenizer_dirs import bpe_tokenizer_dir

    _fineweb_like(tmp_path / "ds")
    cfg = config(tmp_path / "ds", tmp_path / "out", format="parquet",
                 tokenizer=TokenizerConfig(kind="hf", path=str(tmp_path / "nope")))
    monkeypatch.setattr(prep, "open_corpus", lambda *a, **k: pytest.fail("the corpus was opened"))
    for check in (lambda c: prep.prepare(c, progress=False), prep.preflight):
        with pytest.raises(DataError, match=r"^data.tokenizer.path: .*nope not found"):
            check(cfg)
    assert not (tmp_path / "out").exists()
    # With the model's vocabulary (the launcher's data check): a tokenizer larger than the model is refused.
    good = replace(cfg, tokenizer=TokenizerConfig(kind="hf", path=str(bpe_tokenizer_dir(tmp_path / "tok"))))
    prep.preflight(good, model_vocab_size=512)
    with pytest.raises(DataError, match=r"^data.tokenizer.path: the tokenizer at .*tok has \d+ ids, more than "
                                        r"model.vocab_size=256; set model.vocab_size >= \d+"):
        prep.preflight(good, model_vocab_size=256)
