"""PackedDataset validation and the resumable, re-shardable SequenceLoader."""

import hashlib
import json
import os
import random
import shutil
import string

import numpy as np
import pytest
import torch

from megaroute.config import DataConfig, TokenizerConfig
from megaroute.data import DataError
from megaroute.data.loader import PackedDataset, SequenceLoader
from megaroute.data.prepare import prepare
from megaroute.hashing import sha256_file

SEQ = 32


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """~60k char tokens in train, several shards so samples cross shard boundaries."""
    tmp = tmp_path_factory.mktemp("loader")
    rng = random.Random(0)
    text = "\n".join("".join(rng.choice(string.ascii_letters + " ") for _ in range(rng.randint(5, 80)))
                     for _ in range(1800)) + "\n"
    (tmp / "corpus.txt").write_text(text)
    out = tmp / "out"
    cfg = DataConfig(source=str(tmp / "corpus.txt"), output_dir=str(out), tokenizer=TokenizerConfig(kind="char"),
                     val_fraction=0.2, num_workers=1, shard_tokens=7_001, seq_len=SEQ)
    prepare(cfg, progress=False)
    return str(out)


def copy_prepared(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def index_of(path: str) -> dict:
    with open(f"{path}/index.json") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------
# PackedDataset


def test_samples_are_windows_of_the_packed_stream(prepared):
    ds = PackedDataset(prepared, "train", verify="full")
    index = index_of(prepared)
    shards = index["splits"]["train"]["shards"]
    assert len(shards) > 3 and ds.seq_len == SEQ  # seq_len defaults to the prepared data.seq_len
    stream = np.concatenate([np.fromfile(f"{prepared}/{s['file']}", dtype=np.uint16) for s in shards]).astype(np.int64)
    assert ds.num_tokens == len(stream) and len(ds) == (len(stream) - 1) // SEQ
    boundary = shards[0]["num_tokens"]  # a sample that straddles the first shard boundary
    for i in (0, boundary // SEQ, len(ds) - 1):
        assert torch.equal(ds[i], torch.from_numpy(stream[i * SEQ : i * SEQ + SEQ + 1]))
    batch = ds.get_batch([3, 1, boundary // SEQ])
    assert batch.shape == (3, SEQ + 1) and batch.dtype == torch.int64
    assert torch.equal(batch[1], ds[1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_missing_index_and_split(tmp_path, prepared):
    with pytest.raises(DataError, match="index.json: not found"):
        PackedDataset(str(tmp_path), "train")
    with pytest.raises(DataError, match="no split 'test'"):
        PackedDataset(prepared, "test")


def test_shard_size_mismatch_names_the_file(tmp_path, prepared):
    out = copy_prepared(prepared, tmp_path / "d")
    shard = index_of(out)["splits"]["train"]["shards"][1]["file"]
    with open(f"{out}/{shard}", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match=rf"{shard}: size is \d+ bytes but .*index.json says"):
        PackedDataset(out, "train", seq_len=SEQ)


def test_an_empty_shard_listed_with_zero_tokens_is_read_as_empty(tmp_path, prepared):
    # mmap refuses empty files: np.memmap raised "cannot mmap an empty file", naming no shard
    out = copy_prepared(prepared, tmp_path / "d")
    index = index_of(out)
    shards = index["splits"]["train"]["shards"]
    shards.insert(1, {**shards[1], "file": "train-empty.bin", "num_tokens": 0, "sha256": sha256_file(os.devnull)})
    (tmp_path / "d" / "train-empty.bin").write_bytes(b"")
    with open(f"{out}/index.json", "w") as f:
        json.dump(index, f)
    for verify in ("size", "full"):
        ds = PackedDataset(out, "train", seq_len=SEQ, verify=verify)
        assert ds.num_tokens == PackedDataset(prepared, "train", seq_len=SEQ).num_tokens


def test_missing_shard_names_the_file(tmp_path, prepared):
    out = copy_prepared(prepared, tmp_path / "d")
    shard = index_of(out)["splits"]["val"]["shards"][0]["file"]
    (tmp_path / "d" / shard).unlink()
    with pytest.raises(DataError, match=rf"{shard}: shard listed in .* is missing"):
        PackedDataset(out, "val", seq_len=SEQ)


def test_checksum_mismatch_detected_in_full_mode(tmp_path, prepared):
    out = copy_prepared(prepared, tmp_path / "d")
    shard = index_of(out)["splits"]["train"]["shards"][2]["file"]
    data = np.fromfile(f"{out}/{shard}", dtype=np.uint16)
    data[100] = (data[100] + 1) % 5  # same size, different bytes
    data.tofile(f"{out}/{shard}")
    PackedDataset(out, "train", seq_len=SEQ)  # size mode does not read the data
    with pytest.raises(DataError, match=rf"{shard}: sha256 checksum differs"):
        PackedDataset(out, "train", seq_len=SEQ, verify="full")


def test_token_ids_beyond_vocab(tmp_path, prepared):
    vocab = index_of(prepared)["vocab_size"]
    with pytest.raises(DataError, match=rf"vocab_size {vocab}.*>= model.vocab_size={vocab - 1}"):
        PackedDataset(prepared, "train", seq_len=SEQ, vocab_size=vocab - 1)
    PackedDataset(prepared, "train", seq_len=SEQ, vocab_size=vocab)

    # A shard whose ids exceed its own index's vocab (checksum consistent, e.g. a buggy writer).
    out = copy_prepared(prepared, tmp_path / "d")
    index = index_of(out)
    shard = index["splits"]["train"]["shards"][0]
    data = np.fromfile(f"{out}/{shard['file']}", dtype=np.uint16)
    data[7] = vocab + 3
    data.tofile(f"{out}/{shard['file']}")
    shard["sha256"] = hashlib.sha256(data.tobytes()).hexdigest()
    with open(f"{out}/index.json", "w") as f:
        json.dump(index, f)
    with pytest.raises(DataError, match=rf"{shard['file']}: token id {vocab + 3} >= vocab_size {vocab}"):
        PackedDataset(out, "train", seq_len=SEQ, verify="full")


def test_tokenizer_hash_mismatch(tmp_path, prepared):
    good = index_of(prepared)["tokenizer"]["sha256"]
    PackedDataset(prepared, "train", seq_len=SEQ, tokenizer_hash=good)
    with pytest.raises(DataError, match="shards were made with tokenizer sha256"):
        PackedDataset(prepared, "train", seq_len=SEQ, tokenizer_hash="0" * 64)
    out = copy_prepared(prepared, tmp_path / "d")
    tok_file = tmp_path / "d" / index_of(out)["tokenizer"]["file"]
    tok_file.write_bytes(tok_file.read_bytes().replace(b'"a"', b'"@"'))
    with pytest.raises(DataError, match=rf"{tok_file.name}: sha256 differs from tokenizer.sha256"):
        PackedDataset(out, "train", seq_len=SEQ, verify="full")


def test_seq_len_longer_than_data(prepared):
    val_tokens = index_of(prepared)["splits"]["val"]["num_tokens"]
    PackedDataset(prepared, "val", seq_len=val_tokens - 1)  # exactly one sample
    with pytest.raises(DataError, match=rf"data.seq_len={val_tokens}: a sample needs .* has {val_tokens}"):
        PackedDataset(prepared, "val", seq_len=val_tokens)


# ---------------------------------------------------------------------------------------
# SequenceLoader


def loaders(ds, dp_size, mbs=4, gbs=16, seed=5):
    return [SequenceLoader(ds, mbs, gbs, dp_rank=r, dp_size=dp_size, seed=seed) for r in range(dp_size)]


def test_batches_are_inputs_and_shifted_targets(prepared):
    ds = PackedDataset(prepared, "train")
    (loader,) = loaders(ds, 1)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
    full = ds.get_batch(loader.sample_ids_for_step(0)[:4])
    assert torch.equal(x, full[:, :-1]) and torch.equal(y, full[:, 1:])
    assert loader.consumed_samples == 4


def test_resume_two_dp_ranks_next_100_batches_identical(prepared):
    ds = PackedDataset(prepared, "train", seq_len=2 * SEQ)  # fewer samples: the run crosses an epoch
    n_before, n_after = 37, 100  # 37 micro-batches: a mid-step save (2 micro-batches per step)
    reference = loaders(ds, 2)
    expected = [[next(iter(l)) for _ in range(n_before + n_after)] for l in reference]
    assert reference[0].epoch >= 1  # the run crosses an epoch boundary

    first = loaders(ds, 2)
    for loader in first:
        for _ in range(n_before):
            loader.next_batch()
    states = [l.state_dict() for l in first]
    assert states[0] == states[1] and states[0]["consumed_samples"] == n_before * 4 * 2
    assert set(states[0]) >= {"consumed_samples", "seed", "epoch"}

    resumed = loaders(ds, 2, seed=999)  # the seed comes back from the state
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    for rank, loader in enumerate(resumed):
        it = iter(loader)
        for k in range(n_after):
            x, y = next(it)
            ex, ey = expected[rank][n_before + k]
            assert torch.equal(x, ex) and torch.equal(y, ey), (rank, k)


def test_epoch_covers_dataset_once_and_ranks_are_disjoint(prepared):
    ds = PackedDataset(prepared, "train")
    n = len(ds)
    ranks = loaders(ds, 2)
    steps = -(-2 * n // 16)  # two epochs' worth of steps
    per_step = [np.concatenate([l.sample_ids_for_step(s) for l in ranks]) for s in range(steps)]
    for s in range(5):
        assert len(set(ranks[0].sample_ids_for_step(s)) & set(ranks[1].sample_ids_for_step(s))) == 0
    stream = np.concatenate(per_step)
    for epoch in range(2):
        ids = stream[epoch * n : (epoch + 1) * n]
        assert np.array_equal(np.sort(ids), np.arange(n)), epoch  # every sample once, no repeats
    assert not np.array_equal(stream[:n], stream[n : 2 * n])  # epochs are reshuffled

    it = iter(ranks[1])
    for step in range(3):
        for micro in range(ranks[1].micro_batches_per_step):
            x, _ = next(it)
            ids = ranks[1].sample_ids_for_step(step)[micro * 4 : micro * 4 + 4]
            assert torch.equal(x, ds.get_batch(ids)[:, :-1])


def _global_batches(group, steps):
    """Per optimizer step, the concatenation of every rank's micro-batches (rank order)."""
    out = []
    for _ in range(steps):
        parts = []
        for loader in group:
            parts += [loader.next_batch()[0] for _ in range(loader.micro_batches_per_step)]
        out.append(torch.cat(parts))
    return out


def test_resharding_two_ranks_to_one_keeps_global_order(prepared):
    ds = PackedDataset(prepared, "train")
    dp2 = _global_batches(loaders(ds, 2, mbs=4, gbs=16), 30)
    dp1 = _global_batches(loaders(ds, 1, mbs=8, gbs=16), 30)
    assert all(torch.equal(a, b) for a, b in zip(dp2, dp1))

    # Save at dp=2 after 10 steps, resume at dp=1: the remaining steps match the dp=2 run.
    saved = loaders(ds, 2, mbs=4, gbs=16)
    _global_batches(saved, 10)
    single = loaders(ds, 1, mbs=4, gbs=16)
    single[0].load_state_dict(saved[0].state_dict())
    resumed = _global_batches(single, 20)
    assert all(torch.equal(a, b) for a, b in zip(resumed, dp2[10:]))


def test_tensor_parallel_ranks_get_identical_batches(prepared):
    ds = PackedDataset(prepared, "train")
    tp0 = SequenceLoader(ds, 4, 16, dp_rank=1, dp_size=2, seed=3)
    tp1 = SequenceLoader(ds, 4, 16, dp_rank=1, dp_size=2, seed=3)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(tp0.next_batch(), tp1.next_batch()))


def test_loader_config_errors(prepared):
    ds = PackedDataset(prepared, "train")
    with pytest.raises(DataError, match="train.global_batch_size=20 is not divisible by micro_batch_size x dp_size = 4 x 2"):
        SequenceLoader(ds, 4, 20, dp_rank=0, dp_size=2)
    with pytest.raises(DataError, match="dp_rank=2 out of range"):
        SequenceLoader(ds, 4, 16, dp_rank=2, dp_size=2)

    loader = SequenceLoader(ds, 4, 16, dp_rank=0, dp_size=2)
    loader.next_batch()  # mid-step: 8 of 16 samples consumed
    state = loader.state_dict()
    with pytest.raises(DataError, match="saved mid-step"):
        SequenceLoader(ds, 4, 16, dp_rank=0, dp_size=1).load_state_dict(state)
    with pytest.raises(DataError, match="train.global_batch_size=32 differs from the saved 16"):
        SequenceLoader(ds, 4, 32, dp_rank=0, dp_size=2).load_state_dict(state)
    other = PackedDataset(ds.output_dir, "train", seq_len=SEQ * 2)
    with pytest.raises(DataError, match="saved for .* samples but the dataset now has"):
        SequenceLoader(other, 4, 16, dp_rank=0, dp_size=2).load_state_dict(state)


# ---------------------------------------------------------------------------------------
# Token-id range (recorded per shard by prepare, checked on every load without reading shards)


def write_index(path: str, index: dict) -> None:
    with open(f"{path}/index.json", "w") as f:
        json.dump(index, f)


def test_shard_ids_beyond_model_vocab_rejected_from_the_index(tmp_path, prepared):
    out = copy_prepared(prepared, tmp_path / "d")
    index = index_of(out)
    vocab = index["vocab_size"]
    shard = index["splits"]["train"]["shards"][2]
    # Only the index says so (the shard bytes are unchanged): the check reads the index, not the data.
    shard["max_id"] = vocab + 5
    write_index(out, index)
    with pytest.raises(DataError, match=rf"{shard['file']}: token ids reach {vocab + 5} \(max_id in .*index.json\) "
                                        rf">= model.vocab_size={vocab + 2}"):
        PackedDataset(out, "train", seq_len=SEQ, vocab_size=vocab + 2)
    PackedDataset(out, "val", seq_len=SEQ, vocab_size=vocab + 2)  # the val shards are fine


def test_shard_made_with_another_tokenizer_rejected(tmp_path, prepared):
    # An index whose tokenizer is smaller than its shards' ids (e.g. shards copied in from another
    # prepare): the tokenizer fits the model, the shards do not fit the tokenizer.
    out = copy_prepared(prepared, tmp_path / "d")
    index = index_of(out)
    first = index["splits"]["train"]["shards"][0]
    index["vocab_size"] = first["max_id"]
    write_index(out, index)
    with pytest.raises(DataError, match=rf"{first['file']}: token ids reach {first['max_id']} .*>= vocab_size "
                                        rf"{first['max_id']} of the tokenizer in .*index.json"):
        PackedDataset(out, "train", seq_len=SEQ, vocab_size=1000)


def test_old_index_without_id_ranges_is_scanned(tmp_path, prepared):
    out = copy_prepared(prepared, tmp_path / "d")
    index = index_of(out)
    vocab = index["vocab_size"]
    for split in index["splits"].values():
        for shard in split["shards"]:
            del shard["min_id"], shard["max_id"]
    write_index(out, index)
    with pytest.warns(UserWarning, match=r"records no token-id range .* re-run `megaroute data prepare`"):
        ds = PackedDataset(out, "train", seq_len=SEQ, vocab_size=vocab)
    assert ds.scanned_for_ids == ds.files
    shard = index["splits"]["train"]["shards"][1]["file"]
    data = np.fromfile(f"{out}/{shard}", dtype=np.uint16)
    data[5] = vocab
    data.tofile(f"{out}/{shard}")
    with pytest.raises(DataError, match=rf"{shard}: token ids reach {vocab} \(found by scanning it\) "
                                        rf">= model.vocab_size={vocab}"):
        PackedDataset(out, "train", seq_len=SEQ, vocab_size=vocab)


def test_full_verify_checks_the_recorded_id_range(tmp_path, prepared):
    out = copy_prepared(prepared, tmp_path / "d")
    index = index_of(out)
    shard = index["splits"]["val"]["shards"][0]
    shard["max_id"] -= 1  # understated: the cheap check would miss an id the index does not admit to
    write_index(out, index)
    PackedDataset(out, "val", seq_len=SEQ)
    with pytest.raises(DataError, match=rf"{shard['file']}: holds ids in \[\d+, {shard['max_id'] + 1}\] but .* "
                                        rf"records min_id=\d+, max_id={shard['max_id']}"):
        PackedDataset(out, "val", seq_len=SEQ, verify="full")
