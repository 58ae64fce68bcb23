"""train/run.py helpers: the training data order's seed, the prepared data's fingerprint, the tracking process start."""

from __future__ import annotations

import itertools

import pytest
import torch

from megaroute.config import load_config
from megaroute.data.loader import PackedDataset
from megaroute.data.prepare import prepare
from megaroute.train.run import data_fingerprint, train_loader


def cfg(*overrides):
    return load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=4", "data.seq_len=16",
                              *overrides])


def make_prepared(root, text: str) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.txt").write_text(text)
    c = cfg("data.tokenizer.kind=char", f"data.source={root / 'corpus.txt'}", f"data.output_dir={root / 'out'}",
            "data.num_workers=1", "data.val_fraction=0.2")
    prepare(c.data, progress=False)
    return str(root / "out")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return make_prepared(tmp_path_factory.mktemp("run") / "a",
                         "".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(2000)))


def first_batches(c, prepared: str, n: int = 4) -> list[torch.Tensor]:
    ds = PackedDataset(prepared, "train", seq_len=c.data.seq_len)
    return [x for x, _ in itertools.islice(iter(train_loader(c, ds)), n)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_data_seed_defaults_to_none_and_the_training_order_follows_train_seed(prepared):
    assert cfg().train.data_seed is None
    one, two = cfg("train.seed=1"), cfg("train.seed=2")
    assert same(first_batches(one, prepared), first_batches(cfg("train.seed=1"), prepared))  # deterministic
    assert not same(first_batches(one, prepared), first_batches(two, prepared))
    # data.seed (the train/val split's seed) no longer orders the training data.
    assert same(first_batches(one, prepared), first_batches(cfg("train.seed=1", "data.seed=99"), prepared))
    ds = PackedDataset(prepared, "train", seq_len=16)
    assert train_loader(two, ds).state_dict()["seed"] == 2


def test_data_seed_holds_the_order_fixed_across_train_seeds(prepared):
    fixed = [cfg(f"train.seed={s}", "train.data_seed=7") for s in (1, 2, 3)]
    batches = [first_batches(c, prepared) for c in fixed]
    assert same(batches[0], batches[1]) and same(batches[0], batches[2])
    assert same(batches[0], first_batches(cfg("train.seed=7"), prepared))  # data_seed=7 is train.seed=7's order
    assert not same(batches[0], first_batches(cfg("train.seed=7", "train.data_seed=8"), prepared))


def test_data_fingerprint_follows_the_prepared_content(prepared, tmp_path):
    assert data_fingerprint(prepared) == data_fingerprint(prepared) and len(data_fingerprint(prepared)) == 16
    same_text = make_prepared(tmp_path / "b", open(prepared.rsplit("/", 1)[0] + "/corpus.txt").read())
    assert data_fingerprint(same_text) == data_fingerprint(prepared)  # another directory, same data
    other = make_prepared(tmp_path / "c", "".join(f"line {i}: another corpus\n" for i in range(2000)))
    assert data_fingerprint(other) != data_fingerprint(prepared)


def test_the_tracking_process_starts_on_rank_0_only_and_a_failed_start_is_not_fatal(monkeypatch):
    """pretrain starts rank 0's tracking process before DeepSpeed; if it cannot (no fork, no fds), the
    launch goes on and the tracker tries again when the run is known (and warns if that fails too)."""
    from megaroute.train import run
    from megaroute.train.env import DistEnv

    started = []

    def spawn(uri):
        started.append(uri)
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(run, "TrackingProcess", spawn)
    c = cfg("tracking.uri=sqlite:////tmp/never.db")
    rank0, rank1 = (DistEnv(rank=r, world_size=2, local_rank=r, backend="gloo", device="cpu") for r in (0, 1))
    assert run._start_tracking(c, rank1) is None and started == []
    assert run._start_tracking(c, rank0) is None and started == ["sqlite:////tmp/never.db"]
    assert run._start_tracking(cfg("tracking.enabled=false"), rank0) is None and len(started) == 1
