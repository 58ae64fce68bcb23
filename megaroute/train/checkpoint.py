"""Checkpoints on top of DeepSpeed's save/load, with a commit protocol and integrity checks.

    <run>/config.yaml               the run's resolved config
    <root>/step_00000100/           DeepSpeed files, rank_XXXXX.pt (per-rank RNG), manifest.json
    <root>/latest                   tag of the newest committed checkpoint      (root: <run>/checkpoints)

Commit: every rank writes its files -> barrier -> rank 0 hashes every file into
manifest.json (written atomically) -> rank 0 moves `latest` (atomically) -> barrier.
A tag without a manifest was never committed. On load the manifest is verified (sizes and
sha256); a corrupt or incomplete checkpoint is reported and the previous good one is used. When
checkpoints exist but none is intact, resuming stops with an error naming them rather than
starting over on top of them.

`resolve_checkpoint` is the one place a user-given checkpoint path (run directory, checkpoints
directory, tag directory or model-states file) is turned into a checkpoint: resume, init_from, the
converter and the audit all go through it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..config import ConfigError
from ..hashing import sha256_file
from ..model.routing import is_controller_param
from ..model.routing.moe import MoEFFN
from ..parallel import collectives, shard_full_state_dict

MANIFEST = "manifest.json"
LATEST = "latest"
TAG_RE = re.compile(r"^step_(\d+)$")
MODEL_STATES = "mp_rank_{:02d}_model_states.pt"  # DeepSpeed's weights file of one TP rank (ZeRO 0-2)
# One expert of one MoE layer (DeepSpeed's expert-file name, engine._get_expert_ckpt_name): written with
# expert parallelism, where each model-states file holds only its EP rank's experts.
EXPERT_STATES = "layer_{}_expert_{}_mp_rank_{:02d}_model_states.pt"
EXPERT_WEIGHTS = ("w_gate_up", "w_down")
CHECKPOINTS = "checkpoints"  # checkpoint.dir's default: where a run directory keeps its checkpoints


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


def hash_files(paths: list[str]) -> list[str]:
    """sha256 of each file (streamed in chunks), in order. Hashing is I/O plus C code that releases
    the GIL: one thread per file (up to 8) keeps a many-shard checkpoint near the speed of its
    slowest file rather than their sum. Used for writing manifests and verifying them."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(paths)))) as pool:
        return list(pool.map(sha256_file, paths))


def write_manifest(tag_dir: str, step: int) -> dict:
    rels = _files(tag_dir)
    digests = hash_files([os.path.join(tag_dir, rel) for rel in rels])
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
    problems, to_hash = [], []
    for rel, size, sha in entries:
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            problems.append(f"{full}: missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{full}: size {os.path.getsize(full)} != manifest {size} (truncated?)")
        else:
            to_hash.append((full, sha))
    for (full, sha), actual in zip(to_hash, hash_files([full for full, _ in to_hash])):
        if actual != sha:
            problems.append(f"{full}: sha256 mismatch (corrupted): manifest {sha}, file {actual}")
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


def read_latest(root: str) -> Optional[str]:
    """What <root>/latest says (stripped), or None when there is no readable `latest`."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip()
    except OSError:
        return None


def tags_under(root: str) -> list[str]:
    """Checkpoint tags on disk under `root`, oldest first (committed or not)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(root) if (m := TAG_RE.match(n))]
    return [n for _, n in sorted(found)]


def _committed(root: str, tag: str) -> bool:
    """Whether the save of `tag` under `root` finished (rank 0 wrote its manifest)."""
    return os.path.isfile(os.path.join(root, tag, MANIFEST))


def committed_tags(root: str) -> list[str]:
    """The tags under `root` whose save finished (a manifest), oldest first; nothing is verified."""
    return [tag for tag in tags_under(root) if _committed(root, tag)]


def replaced_stamp() -> str:
    """The UTC time a restart names what it sets aside with (set_aside's `stamp`)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def set_aside(root: str, stamp: Optional[str] = None) -> Optional[str]:
    """Moves a checkpoint directory that holds any checkpoint tag to <root>.replaced-<stamp> (default: the
    UTC time now) and returns the new path (None: nothing there). A run that starts over
    (checkpoint.resume=none) does this first: its own tags would otherwise sit among the old run's, and
    a later `auto` resume, which takes the newest committed tag whatever `latest` says, would pick up an
    old one with a higher step."""
    if not tags_under(root):
        return None
    return move_aside(root, stamp or replaced_stamp())


def move_aside(path: str, stamp: str) -> str:
    """Renames `path` (a file or directory) to <path>.replaced-<stamp>, a `_` appended while that name is
    taken (two restarts within a second); returns the new path. Nothing is deleted."""
    target = f"{path}.replaced-{stamp}"
    while os.path.exists(target):
        target += "_"
    os.rename(path, target)
    return target


def resume_tag(resume: str) -> str:
    """An explicit checkpoint.resume names its checkpoint by the last path component: a tag, or a
    path to a tag directory (looked up under the run's checkpoint.dir either way)."""
    return os.path.basename(os.path.normpath(resume))


# ---------------------------------------------------------------- resolving a checkpoint path


@dataclass(frozen=True)
class CheckpointPath:
    """One checkpoint on disk: <root>/<tag>, below the run directory that holds config.yaml."""

    root: str
    tag: str
    model_file: Optional[str] = None  # the model-states file the path named, when it named one

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.root, self.tag)

    @property
    def model_states(self) -> str:
        """TP rank 0's model-states file (ZeRO 0-2 keep the full weights of that rank there)."""
        return self.model_file or os.path.join(self.tag_dir, MODEL_STATES.format(0))

    @property
    def config(self) -> Optional[str]:
        """The run's config.yaml: runs/<name>/config.yaml above runs/<name>/<checkpoint.dir>/<tag>."""
        d = os.path.abspath(self.tag_dir)
        for _ in range(3):
            d = os.path.dirname(d)
            if os.path.isfile(os.path.join(d, "config.yaml")):
                return os.path.join(d, "config.yaml")
        return None


def _holds_weights(d: str) -> bool:
    return any(n.endswith("_model_states.pt") for n in os.listdir(d))


def _at(tag_dir: str, model_file: Optional[str] = None) -> CheckpointPath:
    root, tag = os.path.split(os.path.normpath(tag_dir))
    return CheckpointPath(root, tag, model_file)


def resolve_checkpoint(path: str, tag: Optional[str] = None) -> CheckpointPath:
    """A run directory (its checkpoints/), a checkpoints directory, a checkpoint tag directory or a
    model-states file -> that checkpoint. In a run or checkpoints directory `tag` picks one (default:
    the one `latest` names). Existence only: see `verify` for integrity. Raises CheckpointError."""
    if not os.path.exists(path):
        if tag is not None:
            raise CheckpointError(f"no checkpoint {tag!r} in {path} (that directory does not exist)")
        raise CheckpointError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        return _at(os.path.dirname(os.path.abspath(path)), path)
    if tag is None and _holds_weights(path):
        return _at(path)
    roots = [r for r in (path, os.path.join(path, CHECKPOINTS)) if os.path.isdir(r)]
    for root in roots:
        if tag is not None:
            if tag and os.path.isdir(os.path.join(root, tag)):
                return _at(os.path.join(root, tag))
            continue
        latest = read_latest(root)
        if latest is not None:
            if not latest or not os.path.isdir(os.path.join(root, latest)):
                raise CheckpointError(f"{os.path.join(root, LATEST)} names tag {latest!r}, which does not exist "
                                      f"in {root}")
            return _at(os.path.join(root, latest))
    if tag is not None:
        found = sorted(n for r in roots for n in os.listdir(r) if TAG_RE.match(n))
        have = f"checkpoints there: {', '.join(found)}" if found else "it holds no checkpoints"
        raise CheckpointError(f"no checkpoint {tag!r} in {path} ({have})")
    raise CheckpointError(f"{path} is not a megaroute checkpoint: no DeepSpeed model files, no `{LATEST}` and no "
                          f"{CHECKPOINTS}/ directory")


# ---------------------------------------------------------------- checkpoint.init_from


def init_from_file(path: str) -> str:
    """checkpoint.init_from (any path `resolve_checkpoint` takes) -> TP rank 0's model-states file."""
    try:
        found = resolve_checkpoint(path).model_states
    except CheckpointError as e:
        problem = str(e)
    else:
        problem = _weights_problem(found) if os.path.isfile(found) else f"{found} does not exist"
        if problem is None:
            return found
    raise ConfigError("checkpoint.init_from", f"no model weights at {path!r}: {problem} (expected a model-states "
                                              ".pt file, a checkpoint directory, or a run directory with checkpoints)")


def _weights_problem(path: str) -> Optional[str]:
    """Why `path` is not a state-dict file `load_init_weights` can read; None when it is one. Cheap, so
    that a wrong file fails before the process group: a zip-format file (any torch.save since 1.6) is
    memory-mapped, which reads its pickle but no tensor data; the legacy format cannot be mapped."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001 - a text file gives KeyError, a foreign pickle UnpicklingError...
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{path} is not a PyTorch checkpoint file: torch.load fails ({type(e).__name__}: {first})"
    if not isinstance(state, dict):
        return f"{path} holds a {type(state).__name__}, not a state dict"
    return None


def load_init_weights(model: torch.nn.Module, path: str, controller_only: bool = False) -> None:
    """Loads model weights from a model-states file (strict=False: a routed model has controller
    modules a dense checkpoint lacks). Every base parameter must be present: a silently random base
    would make controller-only training meaningless."""
    state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain containers only
    weights = state.get("module", state)
    if not weights:
        raise ConfigError("checkpoint.init_from", f"{path} holds no model weights (a ZeRO-3 checkpoint? convert "
                                                  "it with DeepSpeed's zero_to_fp32 first)")
    weights = _with_all_experts(model, weights, os.path.dirname(os.path.abspath(path)))
    try:  # a tensor-parallel model keeps its slice of each full (single-process) tensor
        weights = shard_full_state_dict(model, weights)
    except ValueError as e:
        raise ConfigError("checkpoint.init_from", f"{path}: {e}; init_from needs a checkpoint saved with "
                                                  "parallel.tp=1") from None
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected:
        raise ConfigError("checkpoint.init_from", f"{path} has keys this model lacks: {unexpected[:5]}")
    params = dict(model.named_parameters())
    base_missing = [k for k in missing if k in params and not is_controller_param(k)]
    if base_missing:
        raise ConfigError("checkpoint.init_from", f"{path} lacks base weights {base_missing[:5]}"
                          + (" (controller-only training would train on a random base)" if controller_only else ""))


# ---------------------------------------------------------------- expert-parallel weights


def moe_layers(model: torch.nn.Module) -> list[tuple[str, MoEFFN]]:
    """(state-dict prefix, layer) of every MoE FFN, in module order (the `layer_<i>` of EXPERT_STATES)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFFN)]


def save_experts(model: torch.nn.Module, tag_dir: str, mp_rank: int = 0) -> None:
    """This rank's experts, one file per expert (EXPERT_STATES, keys as in the full state dict). Only the
    first rank of each expert-data-parallel group writes: the others hold the same experts."""
    for layer_id, (prefix, m) in enumerate(moe_layers(model)):
        if m.ep_group is None or not m.expert_writer:
            continue
        for e in range(m.num_local_experts):
            weights = {f"{prefix}.{w}": getattr(m, w)[e].detach().clone() for w in EXPERT_WEIGHTS}
            global_id = m.ep_rank * m.num_local_experts + e
            torch.save(weights, os.path.join(tag_dir, EXPERT_STATES.format(layer_id, global_id, mp_rank)))


def load_experts(tag_dir: str, layer_id: int, prefix: str, experts: range, mp_rank: int = 0,
                 mmap: bool = False) -> dict[str, torch.Tensor]:
    """The stacked weights [len(experts), ...] of `experts` of one MoE layer from their EXPERT_STATES files."""
    parts: dict[str, list[torch.Tensor]] = {f"{prefix}.{w}": [] for w in EXPERT_WEIGHTS}
    for e in experts:
        path = os.path.join(tag_dir, EXPERT_STATES.format(layer_id, e, mp_rank))
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing expert file (a checkpoint saved with parallel.ep > 1 keeps "
                                  "each expert in its own file)")
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        for key, tensors in parts.items():
            if key not in state:
                raise CheckpointError(f"{path}: no tensor {key!r} (has {sorted(state)})")
            tensors.append(state[key])
    return {key: torch.stack(tensors) for key, tensors in parts.items()}


def _with_all_experts(model: torch.nn.Module, weights: dict, tag_dir: str) -> dict:
    """init_from an expert-parallel checkpoint: its model-states file holds EP rank 0's experts only;
    the full stacks come from the per-expert files beside it."""
    out = dict(weights)
    for layer_id, (prefix, m) in enumerate(moe_layers(model)):
        key = f"{prefix}.{EXPERT_WEIGHTS[0]}"
        if key in out and out[key].shape[0] < m.num_experts:
            try:
                out.update(load_experts(tag_dir, layer_id, prefix, range(m.num_experts)))
            except CheckpointError as e:
                raise ConfigError("checkpoint.init_from", str(e)) from None
    return out


def _expert_load_fn(tag_dir: str, mp_rank: int):
    """DeepSpeed's custom_load_fn: the model-states file holds EP rank 0's experts; each rank's own come
    from the expert files (ZeRO 1/2 restore their fp32 copies from the rank's optimizer partitions)."""

    def load(src: dict, dst: torch.nn.Module) -> None:
        state = dict(src)
        for layer_id, (prefix, m) in enumerate(moe_layers(dst)):
            per = m.num_local_experts
            state.update(load_experts(tag_dir, layer_id, prefix, range(m.ep_rank * per, (m.ep_rank + 1) * per),
                                      mp_rank))
        dst.load_state_dict(state, strict=True)

    return load


# ---------------------------------------------------------------- saving and resuming


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
        return tags_under(self.root)

    def latest_tag(self) -> Optional[str]:
        """The tag `latest` names; None when there is none (or it is not one of our tags)."""
        tag = read_latest(self.root)
        return tag if tag is not None and TAG_RE.match(tag) else None

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
            if _committed(self.root, tag) and self.latest_tag() == tag:
                # Replacing the committed checkpoint `latest` names (e.g. after resuming from an older
                # one): point `latest` at the previous committed one first, so a crash mid-save
                # leaves it at a complete checkpoint rather than at a half-written directory.
                older = [t for t in committed_tags(self.root) if _step_of(t) < step]
                if older:
                    _atomic_write(os.path.join(self.root, LATEST), older[-1])
                else:
                    os.remove(os.path.join(self.root, LATEST))
            shutil.rmtree(tag_dir)  # a leftover (or a replaced checkpoint) of the same step
        self._barrier()
        engine.save_checkpoint(self.root, tag=tag, client_state=client_state, save_latest=False)
        save_experts(engine.module, tag_dir, getattr(engine, "checkpoint_mp_rank", 0))
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
        committed = committed_tags(self.root)
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
            tag = resume_tag(explicit)
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
        for tag in reversed(committed_tags(self.root)):  # a save that never finished is not a checkpoint
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
        sharded = any(m.ep_group is not None for _, m in moe_layers(engine.module))
        custom = _expert_load_fn(os.path.join(self.root, tag), getattr(engine, "checkpoint_mp_rank", 0)) \
            if sharded else None
        path, client_state = engine.load_checkpoint(self.root, tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True, custom_load_fn=custom)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {self.root}")
        rng_path = os.path.join(self.root, tag, f"rank_{self.rank:05d}.pt")
        if os.path.isfile(rng_path):
            set_rng_state(torch.load(rng_path, weights_only=False))
        else:
            warnings.warn(f"{rng_path} missing (world size changed?); RNG state not restored", stacklevel=2)
        self.loaded_tag = tag
        return client_state or {}
