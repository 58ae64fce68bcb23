"""Checkpoints on top of DeepSpeed's save/load, with a commit protocol and integrity checks.

    <root>/step_00000100/   DeepSpeed files, rank_XXXXX.pt (per-rank RNG), manifest.json
    <root>/latest           tag of the newest committed checkpoint

Commit: every rank writes its files -> barrier -> rank 0 hashes every file into
manifest.json (written atomically) -> rank 0 moves `latest` (atomically) -> barrier.
A tag without a manifest was never committed. On load the manifest is verified (sizes and
sha256); a corrupt or incomplete checkpoint is reported and the previous good one is used. When
checkpoints exist but none is intact, resuming stops with an error naming them rather than
starting over on top of them.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch

from ..hashing import sha256_file
from ..parallel import collectives

MANIFEST = "manifest.json"
LATEST = "latest"
TAG_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(tag: str) -> int:
    return int(TAG_RE.match(tag).group(1))


def _fsync_dir(path: str) -> None:
    """Makes a rename in `path` durable (best effort: some network filesystems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _files(tag_dir: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(tag_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), tag_dir)
            if rel != MANIFEST and ".tmp." not in rel:
                out.append(rel)
    return sorted(out)


def write_manifest(tag_dir: str, step: int) -> dict:
    rels = _files(tag_dir)
    # Hashing is I/O plus C code that releases the GIL: one thread per file (up to 8) keeps a
    # many-shard checkpoint's commit near the speed of the slowest file rather than their sum.
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(rels)))) as pool:
        digests = list(pool.map(lambda rel: sha256_file(os.path.join(tag_dir, rel)), rels))
    files = {rel: {"size": os.path.getsize(os.path.join(tag_dir, rel)), "sha256": digest}
             for rel, digest in zip(rels, digests)}
    manifest = {"tag": os.path.basename(tag_dir), "step": step, "created": time.time(), "files": files}
    _atomic_write(os.path.join(tag_dir, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def verify(tag_dir: str) -> list[str]:
    """Problems with a checkpoint directory; empty when it is complete and intact."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        return [f"{tag_dir}: no {MANIFEST} (checkpoint was never committed)"]
    try:
        with open(path) as f:
            manifest = json.load(f)
        entries = [(str(rel), int(meta["size"]), str(meta["sha256"])) for rel, meta in manifest["files"].items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{path}: unreadable manifest ({type(e).__name__}: {e})"]
    if not entries:
        return [f"{path}: lists no files"]
    problems = []
    for rel, size, sha in entries:
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            problems.append(f"{full}: missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{full}: size {os.path.getsize(full)} != manifest {size} (truncated?)")
        elif sha256_file(full) != sha:
            problems.append(f"{full}: sha256 mismatch (corrupted)")
    return problems


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, root: str, keep_last: int, rank: int):
        self.root = root
        self.keep_last = keep_last
        self.rank = rank
        self.loaded_tag: Optional[str] = None  # the tag `load` restored, if any

    def _barrier(self) -> None:
        collectives.barrier()

    def tags(self) -> list[str]:
        """Checkpoint tags on disk, oldest first."""
        if not os.path.isdir(self.root):
            return []
        found = [(int(m.group(1)), n) for n in os.listdir(self.root) if (m := TAG_RE.match(n))]
        return [n for _, n in sorted(found)]

    def latest_tag(self) -> Optional[str]:
        """The tag `latest` names; None when there is none (or it is not one of our tags)."""
        path = os.path.join(self.root, LATEST)
        try:
            with open(path) as f:
                tag = f.read().strip()
        except OSError:
            return None
        return tag if TAG_RE.match(tag) else None

    def _committed(self, tag: str) -> bool:
        return os.path.isfile(os.path.join(self.root, tag, MANIFEST))

    def save(self, engine, step: int, client_state: dict) -> str:
        """Collective: every rank must call it at the same step."""
        tag = tag_for(step)
        tag_dir = os.path.join(self.root, tag)
        if tag == self.loaded_tag:
            # Resumed at this very step and stopping before training one (e.g. the run was already
            # complete): the intact checkpoint we loaded holds exactly this state. Rewriting it would
            # delete what may be the only good checkpoint while the new copy is being written.
            if self.rank == 0 and self.latest_tag() != tag:
                _atomic_write(os.path.join(self.root, LATEST), tag)
            self._barrier()
            return tag
        if self.rank == 0 and os.path.isdir(tag_dir):
            if self._committed(tag) and self.latest_tag() == tag:
                # Replacing the committed checkpoint `latest` names (e.g. after resuming from an older
                # one): point `latest` at the previous committed one first, so a crash mid-save
                # leaves it at a complete checkpoint rather than at a half-written directory.
                older = [t for t in self.tags() if _step_of(t) < step and self._committed(t)]
                if older:
                    _atomic_write(os.path.join(self.root, LATEST), older[-1])
                else:
                    os.remove(os.path.join(self.root, LATEST))
            shutil.rmtree(tag_dir)  # a leftover (or a replaced checkpoint) of the same step
        self._barrier()
        engine.save_checkpoint(self.root, tag=tag, client_state=client_state, save_latest=False)
        torch.save(rng_state(), os.path.join(tag_dir, f"rank_{self.rank:05d}.pt"))
        self._barrier()
        if self.rank == 0:
            write_manifest(tag_dir, step)
            _atomic_write(os.path.join(self.root, LATEST), tag)
            self._apply_retention(tag)
        self._barrier()
        return tag

    def _apply_retention(self, latest: str) -> None:
        tags = self.tags()
        committed = [t for t in tags if self._committed(t)]
        keep = set(committed[-self.keep_last:]) | {latest}
        latest_step = _step_of(latest)
        for t in tags:
            uncommitted_leftover = t not in committed and _step_of(t) < latest_step
            if (t in committed and t not in keep) or uncommitted_leftover:
                shutil.rmtree(os.path.join(self.root, t), ignore_errors=True)

    def find_resumable(self, explicit: Optional[str] = None) -> Optional[str]:
        """Rank 0 picks the newest intact checkpoint (or checks `explicit`); all ranks get its tag,
        or all raise the same CheckpointError. None means there is nothing to resume from."""
        choice: tuple[Optional[str], Optional[str]] = (None, None)
        if self.rank == 0:
            try:
                choice = (self._choose(explicit), None)
            except CheckpointError as e:
                choice = (None, str(e))
        tag, error = collectives.broadcast_object(choice)
        if error:
            raise CheckpointError(error)
        return tag

    def _choose(self, explicit: Optional[str]) -> Optional[str]:
        if explicit:
            tag = os.path.basename(os.path.normpath(explicit))
            problems = verify(os.path.join(self.root, tag))
            for p in problems:
                warnings.warn(f"checkpoint {tag}: {p}", stacklevel=2)
            if problems:
                raise CheckpointError(f"checkpoint.resume={explicit!r} is not an intact checkpoint: "
                                      + "; ".join(problems))
            return tag
        # Every committed tag is a candidate, newest first, whatever `latest` says: a `latest` that is
        # garbage or names an older tag must not hide (and later overwrite) a newer good checkpoint.
        latest = self.latest_tag()
        corrupt: list[str] = []
        for tag in reversed(self.tags()):
            if not self._committed(tag):
                continue  # a save that never finished: not a checkpoint
            problems = verify(os.path.join(self.root, tag))
            if problems:
                warnings.warn(f"checkpoint {tag} is corrupt and will be skipped: {'; '.join(problems)}", stacklevel=2)
                corrupt.append(tag)
                continue
            if corrupt or latest != tag:
                warnings.warn(f"resuming from {tag}, the newest intact checkpoint (`latest` names "
                              f"{latest or 'no valid tag'}; corrupt: {', '.join(corrupt) or 'none'})", stacklevel=2)
            return tag
        if corrupt:
            # Starting over would overwrite them (and what a repair could recover): stop instead.
            raise CheckpointError(f"every checkpoint in {self.root} is corrupt ({', '.join(corrupt)}; see the "
                                  "warnings above). Repair or move them, or set checkpoint.resume=none to start over")
        if latest is not None:
            raise CheckpointError(f"{os.path.join(self.root, LATEST)} names {latest}, which is not a committed "
                                  "checkpoint (deleted?). Set checkpoint.resume=none to start over")
        return None

    def load(self, engine, tag: str) -> dict:
        """Collective: restores engine, optimizer and LR schedule state, and this rank's RNG."""
        path, client_state = engine.load_checkpoint(self.root, tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {self.root}")
        rng_path = os.path.join(self.root, tag, f"rank_{self.rank:05d}.pt")
        if os.path.isfile(rng_path):
            set_rng_state(torch.load(rng_path, weights_only=False))
        else:
            warnings.warn(f"{rng_path} missing (world size changed?); RNG state not restored", stacklevel=2)
        self.loaded_tag = tag
        return client_state or {}
