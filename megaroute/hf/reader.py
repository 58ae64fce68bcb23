"""Reading a megaroute checkpoint's DeepSpeed files, one model-parallel rank at a time, and merging
them into the TP=1 state dict (the converter streams it to disk; the audit loads it). Which
checkpoint a path names is decided by `train.checkpoint.resolve_checkpoint`.

    runs/<name>/config.yaml                     resolved config (model + routing sections rebuild the model)
    runs/<name>/checkpoints/latest              tag of the newest committed checkpoint
    runs/<name>/checkpoints/<tag>/              mp_rank_XX_model_states.pt              ZeRO 0-2 (full weights per TP rank)
                                                zero_pp_rank_D_mp_rank_XX_*_states.pt   ZeRO-3 (weights only as fp32 partitions)
                                                layer_L_expert_E_mp_rank_XX_model_states.pt   parallel.ep > 1: one MoE
                                                    expert each (the model-states file holds EP rank 0's only)

Files are opened with torch.load(mmap=True): a tensor's pages are read when it is used, so
converting one tensor at a time never holds a second copy of the checkpoint. ZeRO-3 weights are
reassembled by DeepSpeed's own zero_to_fp32 (lazy mode: one parameter at a time, Adam moments never
touched); it expects one model-parallel rank per directory, so each TP rank gets a view directory
of symlinks. (This and the reference test script are the only imports of deepspeed outside
train/engine.py: reassembling ZeRO-3 partitions is DeepSpeed's format, best read by its own code.)
weights_only=False: DeepSpeed's files hold its own Python objects (trusted, local files).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import Config, ConfigError, config_hash, load_config
from ..model import build_model
from ..train.checkpoint import (MANIFEST, MODEL_STATES, CheckpointError, load_experts, moe_layers, resolve_checkpoint,
                                verify)
from ..train.engine import import_deepspeed
from .adapter import StateDictAdapter

# A bf16 engine prefixes its optimizer partitions: bf16_zero_pp_rank_D_mp_rank_XX_optim_states.pt.
ZERO3_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


class ConversionError(RuntimeError):
    """A checkpoint that cannot be converted; the message names the file, tag or key."""


class IntegrityError(ConversionError):
    """The checkpoint's files do not match its manifest, or it was not saved under the config that
    rebuilds it (the converter's exit code 2)."""


@dataclass
class CheckpointSource:
    tag_dir: str
    config: Config
    tp: int
    zero3: bool
    files: list[str] = field(default_factory=list)  # the DeepSpeed files that hold weights
    config_path: Optional[str] = None  # the config.yaml `config` was loaded from
    run_dir: Optional[str] = None  # the run directory above the checkpoint (holds its config.yaml), if any

    @property
    def tag(self) -> str:
        return os.path.basename(self.tag_dir)


def _check_manifest(tag_dir: str) -> None:
    """Cheap integrity check against the commit manifest (presence and sizes; sha256: verify_checksums)."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        raise IntegrityError(f"{tag_dir}: no {MANIFEST}: the checkpoint was never committed (still being written, "
                              "or its job died while saving)")
    try:
        with open(path) as f:
            sizes = {rel: int(meta["size"]) for rel, meta in json.load(f).get("files", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # half-written or hand-edited
        raise IntegrityError(f"{path}: unreadable manifest ({type(e).__name__}: {e})") from None
    for rel, size in sizes.items():
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            raise IntegrityError(f"{full}: missing (listed in {MANIFEST})")
        if os.path.getsize(full) != size:
            raise IntegrityError(f"{full}: size {os.path.getsize(full)} != {size} in {MANIFEST} (truncated?)")


def locate(path: str, tag: Optional[str] = None, config_path: Optional[str] = None) -> CheckpointSource:
    """Resolves `path` (run dir, checkpoints dir, tag dir or model-states file; `tag` picks one; see
    `resolve_checkpoint`) and checks its shards."""
    # Any other file would stand for its directory, and be reported as an uncommitted checkpoint.
    if os.path.isfile(path) and not path.endswith("_model_states.pt"):
        raise ConversionError(f"{path} is not a checkpoint directory (nor a DeepSpeed *_model_states.pt file in one): "
                              "pass a run directory, its checkpoints/ directory or a checkpoint tag directory")
    try:
        where = resolve_checkpoint(path, tag)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    tag_dir = where.tag_dir
    run_config = where.config
    config_path = config_path or run_config
    if config_path is None:
        raise ConversionError(f"{tag_dir}: no config.yaml in the run directory above it (not a megaroute run?); "
                              "pass --config")
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise ConversionError(f"{config_path}: {e}") from None
    _check_manifest(tag_dir)
    tp = cfg.parallel.tp
    names = os.listdir(tag_dir)
    zero3 = {m.groups(): n for n in names if (m := ZERO3_RE.match(n))}
    if not any(kind == "model" for _, _, kind in zero3):
        zero3 = {}  # ZeRO 1/2 also write zero_pp_rank_* optimizer files; only ZeRO-3 writes model ones
    if zero3:
        dp = 1 + max(int(d) for d, _, _ in zero3)
        files = []
        for mp in range(tp):
            for d in range(dp):
                for kind in ("model", "optim"):
                    name = zero3.get((str(d), f"{mp:02d}", kind))
                    if name is None:
                        name = f"zero_pp_rank_{d}_mp_rank_{mp:02d}_{kind}_states.pt"
                        raise ConversionError(f"{os.path.join(tag_dir, name)}: missing ZeRO-3 shard "
                                              f"(parallel.tp={tp}, {dp} data-parallel ranks)")
                    files.append(os.path.join(tag_dir, name))
        extra = {int(mp) for _, mp, _ in zero3} - set(range(tp))
    else:
        files = [os.path.join(tag_dir, MODEL_STATES.format(r)) for r in range(tp)]
        for f in files:
            if not os.path.isfile(f):
                raise ConversionError(f"{f}: missing model shard (the run's config has parallel.tp={tp})")
        extra = {int(m.group(1)) for n in names if (m := re.match(r"^mp_rank_(\d+)_model_states\.pt$", n))} - set(range(tp))
    if extra:
        raise ConversionError(f"{tag_dir}: shards for model-parallel ranks {sorted(extra)} but the run's config has "
                              f"parallel.tp={tp} (mismatched config.yaml?)")
    return CheckpointSource(tag_dir, cfg, tp, bool(zero3), files, config_path,
                            os.path.dirname(run_config) if run_config else None)


def verify_checksums(src: CheckpointSource) -> None:
    """Every file of the checkpoint against its manifest's sha256 (train.checkpoint.verify: streamed,
    on a thread pool). Run before any file is unpickled. Raises IntegrityError naming each bad file."""
    problems = verify(src.tag_dir)
    if problems:
        raise IntegrityError(f"{src.tag_dir} does not match its {MANIFEST}: " + "; ".join(problems)
                             + " (--skip-verify converts it anyway)")


def check_config_hash(src: CheckpointSource, client: dict) -> None:
    """The checkpoint's client-state `config_hash` (saved by training) against the config that rebuilds
    it: another run's checkpoint with the same shapes must not convert under this run's config.
    Checkpoints saved without one (older runs) pass."""
    saved, ours = client.get("config_hash"), config_hash(src.config)
    if saved not in (None, ours):
        raise IntegrityError(
            f"{src.tag_dir}: client state key 'config_hash' is {saved}, but {src.config_path or 'the config'} hashes "
            f"to {ours}: the checkpoint was saved under another config (another run's checkpoint, or config.yaml "
            "changed since, e.g. by a resume with a changed config). Pass --config with the config it was saved "
            "with, or --skip-verify")


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # a truncated or foreign file: name it
        raise ConversionError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def client_state(src: CheckpointSource) -> dict:
    """Rank 0's model-states file (client state: step, tokenizer hash, ...), memory-mapped."""
    first = src.files[0] if not src.zero3 else os.path.join(src.tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    return _load(first)


def rank_state_dicts(src: CheckpointSource) -> list[dict]:
    """One lazily-read state dict per TP rank: name -> tensor (or an object with `.contiguous()`)."""
    if not src.zero3:
        out = []
        for f in src.files:
            module = _load(f).get("module")
            if not module:
                raise ConversionError(f"{f}: holds no model weights ('module' is empty)")
            out.append(module)
        if src.config.parallel.ep > 1:
            _gather_experts(src, out)
        return out
    return [_zero3_rank(src, mp) for mp in range(src.tp)]


def _gather_experts(src: CheckpointSource, ranks: list[dict]) -> None:
    """Expert parallelism: every MoE layer's full expert stacks [E, ...] from the per-expert files, in
    place of the EP-rank-0 slice the model-states files hold."""
    layers = moe_layers(build_model(src.config.model, src.config.routing, device="meta"))
    for mp, module in enumerate(ranks):
        for layer_id, (prefix, m) in enumerate(layers):
            try:
                module.update(load_experts(src.tag_dir, layer_id, prefix, range(m.num_experts), mp, mmap=True))
            except CheckpointError as e:
                raise ConversionError(str(e)) from None


def _zero3_rank(src: CheckpointSource, mp: int) -> dict:
    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    view = tempfile.mkdtemp(prefix="megaroute-zero3-")
    os.makedirs(os.path.join(view, src.tag))
    suffix = f"_mp_rank_{mp:02d}_"
    for f in src.files:
        if suffix in os.path.basename(f):
            os.symlink(os.path.abspath(f), os.path.join(view, src.tag, os.path.basename(f)))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 narrates every step on stdout
            return get_fp32_state_dict_from_zero_checkpoint(view, tag=src.tag, lazy_mode=True)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConversionError(f"{src.tag_dir}: cannot reassemble ZeRO-3 weights of model-parallel rank {mp}: {e}") from None
    finally:  # the files stay memory-mapped after their links are gone
        for n in os.listdir(os.path.join(view, src.tag)):
            os.unlink(os.path.join(view, src.tag, n))
        os.rmdir(os.path.join(view, src.tag))
        os.rmdir(view)


def materialize(t) -> torch.Tensor:
    """A stored tensor or a DeepSpeed lazy GatheredTensor -> a real tensor."""
    return t if isinstance(t, torch.Tensor) else t.contiguous()


def _checked_rank_state_dicts(src: CheckpointSource, adapter: StateDictAdapter) -> list[dict]:
    """Each model-parallel rank's (lazy) state dict, names checked before any tensor is read."""
    ranks = rank_state_dicts(src)
    for r, sd in enumerate(ranks):
        if adapter.tied and "embed.weight" in sd:
            sd.setdefault("lm_head.weight", sd["embed.weight"])  # ZeRO-3 stores a tied tensor once
        missing = [k for k in adapter.keys() if k not in sd]
        unexpected = [k for k in sd if k not in adapter.shapes]
        if missing or unexpected:
            raise ConversionError(f"{src.tag_dir} (model-parallel rank {r}) does not match the run's config: "
                                  f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return ranks


def merged_tensors(src: CheckpointSource, adapter: StateDictAdapter):
    """(key, full TP=1 tensor) for every tensor of the model, one at a time: TP shards merged, ZeRO-3
    partitions reassembled. Every rank's names are checked before the first tensor is read."""
    ranks = _checked_rank_state_dicts(src, adapter)
    for key in adapter.keys():
        try:
            yield key, adapter.merge(key, [materialize(sd[key]) for sd in ranks], src.tag_dir)
        except ValueError as e:
            raise ConversionError(str(e)) from None


def full_state_dict(src: CheckpointSource) -> dict[str, torch.Tensor]:
    """megaroute's TP=1 state dict of a checkpoint of any ZeRO stage and TP degree, in memory (the
    audit, tests; `convert` streams the same tensors to disk instead)."""
    adapter = StateDictAdapter(src.config.model, src.config.routing)
    return {key: full.clone() for key, full in merged_tensors(src, adapter)}
