"""Checkpoints of real DeepSpeed jobs (ZeRO 1 and 3, TP 1 and 2; dense, MoD and MoE with a shared expert)
-> Hugging Face -> same logits;
the audit's loader (the converter's reader, in memory) gives them too.

Each run trains 2 steps on CPU ranks and checkpoints. The reference logits come from the same
checkpoint loaded the way training resumes it (DeepSpeed engine + CheckpointManager.load, with the
run's TP layout and ZeRO stage; tests/integration/hf_reference.py), so the comparison covers the
converter's TP merge and ZeRO-3 reassembly against DeepSpeed itself. The HF side is a fresh
process-level load: AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True).
"""

import os
import subprocess
import sys

import pytest
import torch

from ..hf_generation import assert_cached_generation_equals_uncached
from .conftest import BIN, REPO, start_job
from .ports import free_port

pytestmark = pytest.mark.slow

MOE = ("routing.method=moe", "routing.every=2", "routing.offset=1", "routing.moe.num_experts=4",
       "routing.moe.shared_experts=1")
RUNS = {  # name: (config, zero stage, tp, overrides)
    "dense_z1_tp1": ("configs/tiny.yaml", 1, 1, ()),
    "mod_z1_tp2": ("configs/tiny_mod.yaml", 1, 2, ()),
    "mod_z3_tp1": ("configs/tiny_mod.yaml", 3, 1, ()),
    "dense_z3_tp2": ("configs/tiny.yaml", 3, 2, ()),
    "moe_z3_tp2": ("configs/tiny.yaml", 3, 2, MOE),  # ZeRO-3 partitions the experts (no EP with ZeRO-3)
}
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, char_data):
    """name -> run directory, each with one committed checkpoint (step 2)."""
    work = tmp_path_factory.mktemp("hf_runs")
    out = {}
    for name, (config, zero, tp, overrides) in RUNS.items():
        job = start_job(work, char_data, config, f"optim.zero_stage={zero}", f"parallel.tp={tp}", *overrides,
                        "train.max_steps=2", "checkpoint.interval=2", "tracking.enabled=false", name=name)
        assert job.wait(400) == 0, job.output()[-3000:]
        out[name] = work / "runs" / name
    return out


def _reference_logits(run_dir, tokens, tmp_path):
    tokens_path, out = tmp_path / "tokens.pt", tmp_path / "ref.pt"
    torch.save(tokens, tokens_path)
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(tmp_path / "torchelastic"),  # not /tmp: each launch leaves its log folder
           str(REPO / "tests/integration/hf_reference.py"), str(run_dir), str(tokens_path), str(out)]
    res = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return torch.load(out)


def _convert(args):
    res = subprocess.run([sys.executable, str(REPO / "launcher/convert_checkpoint.py"), *map(str, args)],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


@pytest.mark.parametrize("name", list(RUNS))
@torch.no_grad()
def test_converted_and_audit_loaded_logits_equal_deepspeed_checkpoint(runs, name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megaroute.audit.report import load_run_model
    from megaroute.model import ForwardOptions

    out = tmp_path / "hf"
    res = _convert([runs[name] / "checkpoints", out])  # `latest` of the checkpoints directory
    assert "converting step_00000002" in res.stderr  # the progress bar
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    # Dense runs export as native Llama (format auto), routed ones as megaroute remote code.
    assert type(hf).__name__ == ("LlamaForCausalLM" if name.startswith("dense") else "MegarouteForCausalLM")
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)  # from the run's prepared data dir
    text = ["First Citizen:\nBefore we proceed any further, hear me", "MENENIUS:\nWhat work's, my countrymen, in h"]
    tokens = torch.tensor([tok(t)["input_ids"][:40] for t in text])
    reference = _reference_logits(runs[name], tokens, tmp_path)
    torch.testing.assert_close(hf(tokens).logits, reference, atol=1e-4, rtol=0)
    audited, _ = load_run_model(str(runs[name]))  # TP shards merged / ZeRO-3 reassembled, as for `convert`
    torch.testing.assert_close(audited(tokens, options=ForwardOptions(mode="causal")).logits, reference, atol=1e-4,
                               rtol=0)
    if name.startswith(("mod", "moe")):  # routed: cached decoding equals the full forward
        assert_cached_generation_equals_uncached(hf, tokens[:1, :10], 24)


def test_tag_argument_and_unknown_tag(runs, tmp_path):
    run = runs["dense_z1_tp1"]
    _convert([run, tmp_path / "a", "--tag", "step_00000002", "--no-progress"])
    res = subprocess.run([sys.executable, str(REPO / "launcher/convert_checkpoint.py"), str(run), str(tmp_path / "b"),
                          "--tag", "step_00000007"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "no checkpoint 'step_00000007'" in res.stderr and "step_00000002" in res.stderr
