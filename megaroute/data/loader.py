"""Fixed-length samples from packed shards, in a seeded global order that survives resume
and changes of the data-parallel size.

Sample i of a split is tokens[i*L : i*L + L + 1] of the concatenated shards (L = seq_len),
crossing shard boundaries where needed; inputs are its first L tokens, targets its last L.

Global order and sharding (what `SequenceLoader` guarantees):

    stream  = perm(seed + 0) ++ perm(seed + 1) ++ ...     one permutation of all samples per epoch
    step s  = stream[s*G : (s+1)*G]                       G = global_batch_size
    rank r  = step s [r*G/dp : (r+1)*G/dp]                split into micro-batches in order

Within an epoch no sample repeats and none is skipped; a step that straddles an epoch boundary
takes the end of one permutation and the start of the next. The stream and the step batches
depend only on (dataset, seed, G), never on the data-parallel size, so a run saved at dp=2 resumes at dp=1 (or 4) with the same global batches, as long as
G is unchanged; per-rank micro-batches differ, their union per step does not. Tensor-parallel
ranks of one data-parallel group pass the same dp_rank and get identical batches.
"""

from __future__ import annotations

import bisect
import json
import os
import warnings
from typing import Iterator, Optional

import numpy as np
import torch

from . import INDEX_FILE, INDEX_VERSION, DataError
from ..hashing import sha256_file

_SUPPORTED_DTYPES = ("uint16", "uint32")


def _mapped(path: str, dtype: np.dtype, n: int) -> np.ndarray:
    """The shard's n tokens, memory-mapped (an empty shard: an empty array; mmap refuses empty files)."""
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)).view(np.ndarray) if n else np.empty(0, dtype)


class PackedDataset:
    """One split of a prepared directory, validated against its index.

    verify="size" checks every shard's existence and size, and its token-id range against the
    vocabulary (cheap, safe on every start); verify="full" also checks sha256 checksums, the
    tokenizer file, and the ids themselves (reads every byte). Problems raise DataError naming
    the file or key.

    Vocabulary: ids must be < the index's `vocab_size` (the tokenizer) and < `vocab_size` (the
    model's, when given). `prepare` records each shard's `min_id`/`max_id` in the index, so the
    check costs nothing when a shard is mapped. An index written before those fields existed has
    its shards scanned instead (one pass over each shard of the split, every time it is opened,
    with a warning); re-running `megaroute data prepare` (byte-identical shards) records the
    ranges and makes the check free again.
    """

    def __init__(
        self,
        output_dir: str,
        split: str = "train",
        seq_len: Optional[int] = None,
        vocab_size: Optional[int] = None,
        tokenizer_hash: Optional[str] = None,
        verify: str = "size",
    ):
        if verify not in ("size", "full"):
            raise ValueError(f"verify must be 'size' or 'full', got {verify!r}")
        self.output_dir = output_dir
        self.split = split
        self.index_path = os.path.join(output_dir, INDEX_FILE)
        self.index = _read_index(self.index_path)
        idx = self.index
        if split not in idx["splits"]:
            raise DataError(f"{self.index_path}: no split {split!r} (has {', '.join(idx['splits'])})")
        if idx["dtype"] not in _SUPPORTED_DTYPES:
            raise DataError(f"{self.index_path}: unsupported dtype {idx['dtype']!r}")
        self.dtype = np.dtype(idx["dtype"]).newbyteorder("<")
        self.vocab_size: int = idx["vocab_size"]
        self.eos_id: Optional[int] = idx["eos_id"]
        self.tokenizer_hash: str = idx["tokenizer"]["sha256"]
        self.seq_len = int(seq_len if seq_len is not None else idx["seq_len"])

        if vocab_size is not None and self.vocab_size > vocab_size:
            raise DataError(
                f"{self.index_path}: the tokenizer has vocab_size {self.vocab_size}, so token ids reach "
                f"{self.vocab_size - 1} >= model.vocab_size={vocab_size}; set model.vocab_size >= {self.vocab_size}"
            )
        if tokenizer_hash is not None and tokenizer_hash != self.tokenizer_hash:
            raise DataError(
                f"{self.index_path}: shards were made with tokenizer sha256 {self.tokenizer_hash[:16]}..., "
                f"expected {tokenizer_hash[:16]}... (tokenizer changed since the run started?)"
            )
        if verify == "full":
            self._verify_tokenizer_file()

        self.files: list[str] = []
        self._shards: list[np.memmap] = []
        self._starts: list[int] = []
        self.scanned_for_ids: list[str] = []  # shards whose id range the index lacked (old index)
        total = 0
        for shard in idx["splits"][split]["shards"]:
            path = os.path.join(output_dir, shard["file"])
            self._check_shard(path, shard, verify)
            self.files.append(path)
            self._starts.append(total)
            # A plain ndarray view (_mapped): slicing it skips np.memmap's per-slice bookkeeping.
            self._shards.append(_mapped(path, self.dtype, shard["num_tokens"]))
            self._check_id_range(path, shard, self._shards[-1], vocab_size)
            total += shard["num_tokens"]
        if self.scanned_for_ids:
            warnings.warn(
                f"{self.index_path} records no token-id range for {len(self.scanned_for_ids)} {split!r} shard(s) "
                "(written by an older megaroute), so they were scanned for ids >= the vocabulary; re-run "
                "`megaroute data prepare` for this data.output_dir to record the ranges and skip the scan",
                stacklevel=2)
        self.num_tokens = total
        if self.seq_len < 1 or total < self.seq_len + 1:
            raise DataError(
                f"data.seq_len={self.seq_len}: a sample needs seq_len + 1 = {self.seq_len + 1} tokens but the "
                f"{split!r} split of {output_dir} has {total}"
            )

    def _check_id_range(self, path: str, shard: dict, data: np.ndarray, model_vocab: Optional[int]) -> None:
        """Every id of the shard < the tokenizer's and the model's vocabulary, from the index's
        `max_id` (free) or, for an index without one, from a scan of the shard."""
        top = shard.get("max_id")
        if top is None:
            top = int(data.max()) if len(data) else -1
            self.scanned_for_ids.append(path)
            where = "found by scanning it"
        else:
            top = int(top)
            where = f"max_id in {self.index_path}"
        if model_vocab is not None and top >= model_vocab:
            raise DataError(f"{path}: token ids reach {top} ({where}) >= model.vocab_size={model_vocab}; "
                            "training on it would index past the embedding table")
        if top >= self.vocab_size:
            raise DataError(f"{path}: token ids reach {top} ({where}) >= vocab_size {self.vocab_size} of the "
                            f"tokenizer in {self.index_path}: the shard was not made with this index's tokenizer")

    def _verify_tokenizer_file(self) -> None:
        path = os.path.join(self.output_dir, self.index["tokenizer"]["file"])
        if not os.path.isfile(path):
            raise DataError(f"{path}: tokenizer file listed in {self.index_path} is missing")
        if sha256_file(path) != self.tokenizer_hash:
            raise DataError(f"{path}: sha256 differs from tokenizer.sha256 in {self.index_path}")

    def _check_shard(self, path: str, shard: dict, verify: str) -> None:
        if not os.path.isfile(path):
            raise DataError(f"{path}: shard listed in {self.index_path} is missing")
        expected = shard["num_tokens"] * self.dtype.itemsize
        actual = os.path.getsize(path)
        if actual != expected:
            raise DataError(
                f"{path}: size is {actual} bytes but {self.index_path} says {shard['num_tokens']} tokens "
                f"x {self.dtype.itemsize} bytes = {expected}"
            )
        if verify == "full":
            if sha256_file(path) != shard["sha256"]:
                raise DataError(f"{path}: sha256 checksum differs from {self.index_path} (corrupt shard)")
            data = _mapped(path, self.dtype, actual // self.dtype.itemsize)
            top = int(data.max()) if len(data) else -1
            if top >= self.vocab_size:
                raise DataError(f"{path}: token id {top} >= vocab_size {self.vocab_size} from {self.index_path}")
            recorded = (shard.get("min_id"), shard.get("max_id"))
            if recorded != (None, None) and len(data) and recorded != (int(data.min()), top):
                raise DataError(f"{path}: holds ids in [{int(data.min())}, {top}] but {self.index_path} records "
                                f"min_id={recorded[0]}, max_id={recorded[1]}")

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] of the packed stream as int64, crossing shard boundaries."""
        out = np.empty(stop - start, dtype=np.int64)
        shard = bisect.bisect_right(self._starts, start) - 1
        pos = start
        while pos < stop:
            data, base = self._shards[shard], self._starts[shard]
            take = min(stop, base + len(data)) - pos
            out[pos - start : pos - start + take] = data[pos - base : pos - base + take]
            pos += take
            shard += 1
        return out

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        return torch.from_numpy(self.tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1))

    def batch_array(self, sample_ids) -> np.ndarray:
        """[len(sample_ids), seq_len + 1] int64 array."""
        L = self.seq_len
        batch = np.empty((len(sample_ids), L + 1), dtype=np.int64)
        for row, i in enumerate(sample_ids):
            start = int(i) * L
            shard = bisect.bisect_right(self._starts, start) - 1
            offset = start - self._starts[shard]
            data = self._shards[shard]
            if offset + L + 1 <= len(data):
                batch[row] = data[offset : offset + L + 1]
            else:  # crosses into the next shard
                batch[row] = self.tokens(start, start + L + 1)
        return batch

    def get_batch(self, sample_ids) -> torch.Tensor:
        """[len(sample_ids), seq_len + 1] int64 tensor."""
        return torch.from_numpy(self.batch_array(sample_ids))


class SequenceLoader:
    """Infinite iterator of (inputs, targets) int64 tensors [micro_batch_size, seq_len] for one
    data-parallel rank; see the module docstring for the order and the re-sharding rule.

    State is one counter, `consumed_samples` (global, over all ranks): each yielded micro-batch
    advances it by micro_batch_size * dp_size, since all ranks step in lockstep. Resuming from a
    state saved at an optimizer-step boundary works for any dp_size with the same
    global_batch_size; mid-step states need the same micro_batch_size * dp_size.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ):
        if micro_batch_size < 1 or global_batch_size < 1:
            raise DataError("train.micro_batch_size and train.global_batch_size must be >= 1")
        if global_batch_size % (micro_batch_size * dp_size):
            raise DataError(
                f"train.global_batch_size={global_batch_size} is not divisible by micro_batch_size x dp_size "
                f"= {micro_batch_size} x {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed_samples = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    @property
    def micro_batches_per_step(self) -> int:
        """Gradient-accumulation steps: micro-batches per rank per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # only the current and next epoch are ever needed
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        return self._perms[epoch]

    def global_sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at positions [start, start + count) of the global stream."""
        epoch, offset = divmod(start, self.num_samples)
        if offset + count <= self.num_samples:  # the usual case: inside one epoch
            return self._permutation(epoch)[offset : offset + count]
        positions = np.arange(start, start + count)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._permutation(int(e))[offsets[mask]]
        return out

    def sample_ids_for_step(self, step: int) -> np.ndarray:
        """This rank's sample ids for optimizer step `step`, in micro-batch order."""
        per_rank = self.global_batch_size // self.dp_size
        return self.global_sample_ids(step * self.global_batch_size + self.dp_rank * per_rank, per_rank)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        step, within = divmod(self.consumed_samples, self.global_batch_size)
        micro = within // (self.micro_batch_size * self.dp_size)
        ids = self.sample_ids_for_step(step)[micro * self.micro_batch_size : (micro + 1) * self.micro_batch_size]
        batch = self.dataset.batch_array(ids)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        # Split in numpy: two contiguous copies without a trip through the torch dispatcher.
        return torch.from_numpy(np.ascontiguousarray(batch[:, :-1])), torch.from_numpy(np.ascontiguousarray(batch[:, 1:]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "epoch": self.epoch,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "micro_step_samples": self.micro_batch_size * self.dp_size,
        }

    def load_state_dict(self, state: dict) -> None:
        consumed = int(state["consumed_samples"])
        saved_n = state.get("num_samples", self.num_samples)
        if saved_n != self.num_samples:
            raise DataError(
                f"loader state was saved for {saved_n} samples but the dataset now has {self.num_samples} "
                "(different data or data.seq_len): the sample order cannot be resumed"
            )
        micro_step = self.micro_batch_size * self.dp_size
        within = consumed % self.global_batch_size
        if state.get("global_batch_size", self.global_batch_size) != self.global_batch_size and within:
            raise DataError(
                f"train.global_batch_size={self.global_batch_size} differs from the saved "
                f"{state['global_batch_size']} and consumed_samples={consumed} is not a multiple of it"
            )
        if within and state.get("micro_step_samples", micro_step) != micro_step:
            raise DataError(
                f"loader state was saved mid-step (consumed_samples={consumed}); resuming it needs the same "
                f"micro_batch_size x dp_size ({state['micro_step_samples']}), got {micro_step}"
            )
        if within % micro_step:
            raise DataError(f"consumed_samples={consumed} is not a multiple of micro_batch_size x dp_size = {micro_step}")
        self.seed = int(state["seed"])
        self._perms.clear()
        self.consumed_samples = consumed


def _read_index(path: str) -> dict:
    if not os.path.isfile(path):
        raise DataError(f"{path}: not found; run `megaroute data prepare` for this data.output_dir")
    try:
        with open(path) as f:
            index = json.load(f)
        for key in ("version", "dtype", "vocab_size", "eos_id", "seq_len", "tokenizer", "splits"):
            index[key]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: malformed index ({type(e).__name__}: {e})") from None
    if index["version"] != INDEX_VERSION:
        raise DataError(f"{path}: index format version {index['version']}, this megaroute reads {INDEX_VERSION}")
    return index
