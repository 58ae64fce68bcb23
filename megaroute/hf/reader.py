"""Finding a megaroute checkpoint and reading its DeepSpeed files, one model-parallel rank at a time.

    runs/<name>/config.yaml                     resolved config (model + routing sections rebuild the model)
    runs/<name>/checkpoints/latest              tag of the newest committed checkpoint
    runs/<name>/checkpoints/<tag>/              mp_rank_XX_model_states.pt              ZeRO 0-2 (full weights per TP rank)
                                                zero_pp_rank_D_mp_rank_XX_*_states.pt   ZeRO-3 (weights only as fp32 partitions)

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

from ..config import Config, ConfigError, load_config
from ..train.checkpoint import LATEST, MANIFEST, TAG_RE

MODEL_STATES = "mp_rank_{:02d}_model_states.pt"
# A bf16 engine prefixes its optimizer partitions: bf16_zero_pp_rank_D_mp_rank_XX_optim_states.pt.
ZERO3_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


class ConversionError(RuntimeError):
    """A checkpoint that cannot be converted; the message names the file, tag or key."""


@dataclass
class CheckpointSource:
    tag_dir: str
    config: Config
    tp: int
    zero3: bool
    files: list[str] = field(default_factory=list)  # the DeepSpeed files that hold weights

    @property
    def tag(self) -> str:
        return os.path.basename(self.tag_dir)


def _find_config(tag_dir: str) -> Optional[str]:
    """The run's config.yaml: runs/<name>/config.yaml above runs/<name>/<checkpoint.dir>/<tag>."""
    d = os.path.abspath(tag_dir)
    for _ in range(3):
        d = os.path.dirname(d)
        if os.path.isfile(os.path.join(d, "config.yaml")):
            return os.path.join(d, "config.yaml")
    return None


def _resolve_tag_dir(path: str, tag: Optional[str]) -> str:
    if not os.path.exists(path):
        raise ConversionError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        raise ConversionError(f"{path}: expected a run directory, a checkpoints directory or a checkpoint tag directory")
    if tag is None and _has_weights(path):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        if not os.path.isdir(root):
            continue
        if tag is not None:
            if os.path.isdir(os.path.join(root, tag)):
                return os.path.join(root, tag)
            continue
        latest = os.path.join(root, LATEST)
        if os.path.isfile(latest):
            with open(latest) as f:
                name = f.read().strip()
            if not os.path.isdir(os.path.join(root, name)):
                raise ConversionError(f"{latest} names tag {name!r}, which does not exist in {root}")
            return os.path.join(root, name)
    if tag is not None:
        roots = [r for r in (path, os.path.join(path, "checkpoints")) if os.path.isdir(r)]
        known = sorted(n for r in roots for n in os.listdir(r) if TAG_RE.match(n))
        raise ConversionError(f"unknown checkpoint tag {tag!r} in {path} (available: {', '.join(known) or 'none'})")
    raise ConversionError(f"{path} is not a megaroute checkpoint: no DeepSpeed model files, no `{LATEST}` "
                          "and no checkpoints/ directory")


def _has_weights(d: str) -> bool:
    return any(n.endswith("_model_states.pt") for n in os.listdir(d))


def _check_manifest(tag_dir: str) -> None:
    """Cheap integrity check against the commit manifest (presence and sizes; hashes are left to resume)."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ConversionError(f"{tag_dir}: no {MANIFEST}: the checkpoint was never committed (still being written, "
                              "or its job died while saving)")
    with open(path) as f:
        files = json.load(f).get("files", {})
    for rel, meta in files.items():
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            raise ConversionError(f"{full}: missing (listed in {MANIFEST})")
        if os.path.getsize(full) != int(meta["size"]):
            raise ConversionError(f"{full}: size {os.path.getsize(full)} != {meta['size']} in {MANIFEST} (truncated?)")


def locate(path: str, tag: Optional[str] = None, config_path: Optional[str] = None) -> CheckpointSource:
    """Resolves `path` (run dir, checkpoints dir or tag dir; `tag` picks one) and checks its shards."""
    tag_dir = _resolve_tag_dir(path, tag)
    config_path = config_path or _find_config(tag_dir)
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
    return CheckpointSource(tag_dir, cfg, tp, bool(zero3), files)


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
        return out
    return [_zero3_rank(src, mp) for mp in range(src.tp)]


def _zero3_rank(src: CheckpointSource, mp: int) -> dict:
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
