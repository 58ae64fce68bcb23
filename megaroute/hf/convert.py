"""`megaroute convert` / launcher/convert_checkpoint.py: a DeepSpeed checkpoint -> a Hugging Face model dir.

    out/config.json                 MegarouteConfig + auto_map (trust_remote_code)
    out/configuration_megaroute.py  out/modeling_megaroute.py   thin wrapper around megaroute's Transformer
    out/megaroute_*.py              the megaroute modules it needs, generated from the package's source
                                    (bundle.py): the directory needs torch and transformers, not megaroute
    out/model.safetensors           or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    out/generation_config.json      out/tokenizer*.json / tokenizer.model

Dense models (routing.method none) are written by default as a native `LlamaForCausalLM` instead
(config.json model_type llama, Llama tensor names, no Python files: plain transformers loads it
without trust_remote_code or megaroute; see llama.py). `--format megaroute` forces the remote-code
export for them too; `--format llama` refuses routed models.

Order of work: every check (output path, which may not overlap the run it reads; tag, shards, config,
tokenizer; the files' sha256 against the manifest and the checkpoint's config_hash, unless --skip-verify:
IntegrityError, exit code 2) runs before any weight is read and before anything is written. Weights
stream one tensor at a time (TP shards merged, ZeRO-3 partitions reassembled, an expert-parallel run's
per-expert files stacked into each MoE layer's [E, ...] tensors) into output shards of at most
`max_shard_bytes`, so peak memory is about the memory-mapped input plus one output shard. Everything
is written into a temporary directory next to the output and renamed into place at the end: an
interrupted conversion leaves no half-written model, and --force replaces an existing one only once
the new one is complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Optional

import torch
from tqdm import tqdm

from ..argtypes import positive_float
from ..data import DataError
from ..data.tokenizers import load_tokenizer
from ..model.routing import honest_routing_mode
from ..paths import dir_problem
from .adapter import StateDictAdapter
from .bundle import BundleError, bundle_sources
from .configuration_megaroute import ROUTING_MODES, TOPK_WARNING, MegarouteConfig
from .llama import llama_config, llama_tensors
from .reader import (CheckpointSource, ConversionError, IntegrityError, check_config_hash, client_state, locate,
                     merged_tensors, verify_checksums)
from .tokenizer import copy_tokenizer_source, export_tokenizer, special_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("auto", "llama", "megaroute")  # auto: llama for routing.method none, megaroute otherwise
# One output shard is held in memory next to the memory-mapped input: peak ~ process baseline
# (~0.5 GB with transformers imported) + model + min(model, shard), within 1.5x model + 1 GB at any size.
DEFAULT_SHARD_BYTES = 1 << 29


def _plan_shards(adapter: StateDictAdapter, dtype: Optional[torch.dtype], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key in adapter.keys():
        n = adapter.nbytes(key, dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _check_output(out: str, force: bool) -> None:
    """The output is a directory or does not exist yet, and its parent takes new entries (the model is
    written into a temporary directory beside it): checked first, so a bad path fails at once, naming
    itself, not after the conversion."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ConversionError(f"{out} exists and is not a directory: the output must be a directory (or not exist)")
    if os.path.exists(out) and not force:
        raise ConversionError(f"{out} already exists; pass --force to replace it")
    problem = dir_problem(os.path.dirname(out))
    if problem:
        raise ConversionError(f"cannot write {out}: {problem}")


def _check_not_source(out: str, src: CheckpointSource, tokenizer: str) -> None:
    """--force deletes the old output whole, so it must not hold anything the conversion reads, and the
    output must not land inside the checkpoint (its manifest lists what belongs there). Elsewhere in the
    run (runs/x/hf) is fine. Real paths: a symlink does not hide either."""
    real = os.path.realpath(out)
    reads = {"checkpoint": src.tag_dir, "run directory": src.run_dir, "config": src.config_path,
             "tokenizer": tokenizer}
    for what, path in reads.items():
        if path and _within(os.path.realpath(path), real):
            raise ConversionError(f"output {out} is or contains the {what} {path} being converted (--force would "
                                  "delete it): choose another output directory")
    if _within(real, os.path.realpath(src.tag_dir)):
        raise ConversionError(f"output {out} is inside the checkpoint {src.tag_dir} being converted: choose an "
                              "output directory outside it")


def _tokenizer(src: CheckpointSource, path: Optional[str]):
    where = path or src.config.data.output_dir
    try:
        return load_tokenizer(where)
    except DataError as e:
        raise ConversionError(f"tokenizer of run {src.tag_dir}: {e} (pass --tokenizer <prepared data dir or "
                              "tokenizer file>)") from None


def _write_weights(src: CheckpointSource, adapter: StateDictAdapter, out: str, dtype: Optional[torch.dtype],
                   max_bytes: int, progress: bool, llama: bool = False) -> dict:
    from safetensors.torch import save_file

    tensors_in_order = merged_tensors(src, adapter)  # adapter.keys() order, which the plan keeps
    plan = _plan_shards(adapter, dtype, max_bytes)
    names = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    weight_map, total = {}, 0
    bar = tqdm(total=len(adapter.keys()), desc=f"converting {src.tag}", unit="tensor", disable=not progress)
    for name, keys in zip(names, plan):
        tensors = {}
        for key in keys:
            merged_key, full = next(tensors_in_order)
            assert merged_key == key
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            pieces = llama_tensors(key, full, adapter.tied) if llama else [(adapter.to_hf_name(key), full)]
            for hf_name, t in pieces:
                # A fresh, contiguous tensor: safetensors refuses shared storage (tied embedding/LM head).
                tensors[hf_name] = t.contiguous().clone()
                total += t.numel() * t.element_size()
            bar.update()
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        os.chmod(os.path.join(out, name), 0o644)  # safetensors creates files owner-only
        weight_map.update({k: name for k in tensors})
        del tensors
    bar.close()
    if len(plan) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return weight_map


def _write_config(src: CheckpointSource, out: str, tokenizer, routing_mode: str, dtype: torch.dtype,
                  code: dict[str, str]) -> None:
    from transformers import GenerationConfig

    for name, text in code.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write(text)
    eos, pad = special_ids(tokenizer, src.config.model.vocab_size)
    config = MegarouteConfig(
        megaroute_model=dataclasses.asdict(src.config.model), megaroute_routing=dataclasses.asdict(src.config.routing),
        routing_mode=routing_mode, architectures=["MegarouteForCausalLM"], eos_token_id=eos, pad_token_id=pad,
        auto_map={"AutoConfig": "configuration_megaroute.MegarouteConfig",
                  "AutoModelForCausalLM": "modeling_megaroute.MegarouteForCausalLM"},
        dtype=str(dtype).removeprefix("torch."),
    )
    config.megaroute_source = {"checkpoint": os.path.abspath(src.tag_dir), "run": src.config.name,
                               "tokenizer_sha256": tokenizer.hash}
    config.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(out)


def _write_llama_config(src: CheckpointSource, out: str, tokenizer, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig

    eos, pad = special_ids(tokenizer, src.config.model.vocab_size)
    config = llama_config(src.config.model, dtype, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    config.megaroute_source = {"checkpoint": os.path.abspath(src.tag_dir), "run": src.config.name,
                               "tokenizer_sha256": tokenizer.hash}
    config.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(out)


def convert(path: str, out: str, tag: Optional[str] = None, *, force: bool = False,
            routing_mode: Optional[str] = None, dtype: Optional[str] = None, tokenizer: Optional[str] = None,
            config: Optional[str] = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
            format: str = "auto", skip_verify: bool = False) -> str:
    """Converts one checkpoint; returns the output directory. format: "auto" (dense -> "llama", routed ->
    "megaroute"), "llama" (native LlamaForCausalLM, dense only) or "megaroute" (remote code).
    Integrity (IntegrityError, before anything is written): every file's sha256 against the manifest and
    the checkpoint's config_hash against the config; skip_verify skips both (with a warning on stderr)."""
    out = os.path.abspath(out)
    _check_output(out, force)
    if routing_mode is not None and routing_mode not in ROUTING_MODES:
        raise ConversionError(f"--routing-mode must be one of {ROUTING_MODES}, got {routing_mode!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if format not in FORMATS:
        raise ConversionError(f"--format must be one of {FORMATS}, got {format!r}")
    src = locate(path, tag, config)
    _check_not_source(out, src, tokenizer or src.config.data.output_dir)
    dense = src.config.routing.method == "none"
    if format == "llama" and not dense:
        raise ConversionError(f"--format llama needs a dense model (routing.method none); {src.tag_dir} uses "
                              f"routing.method {src.config.routing.method!r}: use --format megaroute")
    llama = format == "llama" or (format == "auto" and dense)
    honest = honest_routing_mode(src.config.routing.method)
    routing_mode = routing_mode or honest
    if routing_mode == "topk" and not dense:
        print(f"WARNING: --routing-mode topk: {TOPK_WARNING}", file=sys.stderr, flush=True)
    elif routing_mode != honest and not dense:
        print(f"WARNING: --routing-mode {routing_mode}: routing.method {src.config.routing.method!r} reports its "
              f"eval/loss in {honest!r} mode; this export's log-likelihoods are of another forward (for halting "
              "gates, 'causal' is the soft one: every token runs every block)", file=sys.stderr, flush=True)
    if skip_verify:
        print(f"WARNING: --skip-verify: the sha256 of {src.tag_dir}'s files and its config_hash are NOT checked; "
              "a damaged or foreign checkpoint converts into a plausible but wrong model", file=sys.stderr, flush=True)
    else:
        verify_checksums(src)  # before any file is unpickled
    tok = _tokenizer(src, tokenizer)
    client = client_state(src)
    saved_hash = client.get("tokenizer_hash")
    if saved_hash not in (None, tok.hash):
        raise ConversionError(f"{src.tag_dir} was trained with tokenizer {saved_hash}, but {tok.path} is {tok.hash}")
    if not skip_verify:
        check_config_hash(src, client)
    adapter = StateDictAdapter(src.config.model, src.config.routing)
    code = None
    if not llama:
        try:  # generated before anything is written
            code = bundle_sources()
        except BundleError as e:
            raise ConversionError(f"cannot generate the remote code: {e}") from None

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        export_tokenizer(tok, tmp, src.config.model.vocab_size)
        copy_tokenizer_source(tok, tmp)
        out_dtype = DTYPES[dtype] if dtype else None
        _write_weights(src, adapter, tmp, out_dtype, max_shard_bytes, progress, llama=llama)
        first_float = next(t for t in adapter.dtypes.values() if t.is_floating_point)
        written = out_dtype or (torch.float32 if src.zero3 else first_float)
        if llama:
            _write_llama_config(src, tmp, tok, written)
        else:
            _write_config(src, tmp, tok, routing_mode, written, code)
        if os.path.exists(out):  # --force: swap, then delete the old copy
            old = os.path.join(parent, f".{os.path.basename(out)}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a checkpoint to a Hugging Face model directory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run dir, checkpoints dir (uses `latest`), checkpoint tag dir or model-states "
                                      "file (its tag dir)")
    p.add_argument("output", help="Hugging Face model directory to create")
    p.add_argument("--tag", help="checkpoint tag, e.g. step_00001000 (default: `latest`)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--routing-mode", default=None, choices=ROUTING_MODES,
                   help="routing of routed layers in the HF model (default: the mode of the run's eval/loss, each "
                        "token routed from its own past at the compute the method spends: causal; hard for halting "
                        "gates); topk sees future tokens")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="auto (default): dense models (routing.method none) as a native LlamaForCausalLM (no "
                        "remote code), routed ones as megaroute remote code; llama or megaroute force one")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: as stored; fp32 for ZeRO-3)")
    p.add_argument("--tokenizer", help="prepared data dir or tokenizer file (default: the run's data.output_dir)")
    p.add_argument("--config", help="the run's config.yaml (default: found above the checkpoint)")
    p.add_argument("--max-shard-size", type=positive_float, default=DEFAULT_SHARD_BYTES / 2**30, metavar="GiB",
                   help="split model.safetensors above this size (default 0.5)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--skip-verify", action="store_true",
                   help="do not check the files' sha256 against the checkpoint's manifest, nor its config_hash "
                        "against the config (a warning says so)")


def run(args: argparse.Namespace) -> int:
    t0 = time.time()
    try:
        out = convert(args.checkpoint, args.output, args.tag, force=args.force, routing_mode=args.routing_mode,
                      dtype=args.dtype, tokenizer=args.tokenizer, config=args.config,
                      max_shard_bytes=int(args.max_shard_size * 2**30), progress=not args.no_progress,
                      format=args.format, skip_verify=args.skip_verify)
    except IntegrityError as e:  # a damaged or foreign checkpoint: exit 2, distinct from usage errors (1)
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    except ConversionError as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.time() - t0:.1f}s", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
