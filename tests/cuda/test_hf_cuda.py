"""Checkpoints written by one-GPU jobs -> launcher/convert_checkpoint.py -> transformers on CUDA.

The converted model on CUDA (moved with .to("cuda"), and loaded with device_map="cuda") gives the
CPU model's logits, and greedy generate() with the KV cache on CUDA is a greedy decode of the CPU
model: every generated token is the CPU argmax, up to near-ties (within TIE of the best logit).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .harness import EXIT_OK, REPO, Case, peak_override, start_gpu_job

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

RUNS = {"dense": Case("dense"), "mod": Case("mod"), "mod_z3": Case("mod", zero=3)}
TIE = 1e-3
TEXT = ["First Citizen:\nBefore we proceed any further, hear me", "MENENIUS:\nWhat work's, my countrymen, in h"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, char_data):
    """name -> converted HF directory of a 2-step bf16 GPU run (checkpoint at step 2)."""
    work = tmp_path_factory.mktemp("gpu_hf")
    out = {}
    for name, case in RUNS.items():
        job = start_gpu_job(work, char_data, name, *case.overrides(), *peak_override(), "train.max_steps=2",
                            "checkpoint.interval=2", "train.eval_interval=2")
        assert job.wait(600) == EXIT_OK, job.output()[-4000:]
        hf_dir = work / f"hf_{name}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        res = subprocess.run([sys.executable, str(REPO / "launcher/convert_checkpoint.py"), str(work / "runs" / name),
                              str(hf_dir), "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        out[name] = hf_dir
    return out


def _load(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw).eval()


def _tokens(path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    return torch.tensor([tok(t)["input_ids"][:40] for t in TEXT])


def _assert_greedy_decode_of(reference, seq: torch.Tensor, prompt_len: int, tie: float) -> None:
    """Each token after the prompt is the reference model's argmax given the tokens before it, or
    within `tie` of it (logits of the whole sequence in one uncached forward on the reference).
    A row that emitted EOS is checked up to it (generate pads it afterwards)."""
    seq = seq.cpu()
    logits = reference(seq).logits.float()
    eos = reference.generation_config.eos_token_id
    done = torch.zeros(seq.shape[0], dtype=torch.bool)
    for t in range(prompt_len, seq.shape[1]):
        step = logits[:, t - 1]
        gap = step.max(dim=-1).values - step.gather(1, seq[:, t:t + 1]).squeeze(1)
        assert (gap[~done] <= tie).all(), f"token {t}: chosen logit {gap[~done].max().item():.2e} below the argmax"
        if eos is not None:
            done |= torch.isin(seq[:, t], torch.tensor(eos).flatten())


@pytest.mark.parametrize("name", list(RUNS))
@torch.no_grad()
def test_converted_checkpoint_on_cuda_matches_cpu_and_generates(converted, name):
    path = converted[name]
    tokens = _tokens(path)
    cpu = _load(path, dtype=torch.float32)
    want = cpu(tokens).logits

    moved = _load(path, dtype=torch.float32).to("cuda")
    mapped = _load(path, dtype=torch.float32, device_map="cuda")  # how accelerate / lm-eval place it
    for model in (moved, mapped):
        assert next(model.parameters()).is_cuda
        got = model(tokens.cuda()).logits
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)

    prompt = tokens[:, :10].cuda()
    for use_cache in (True, False):
        seq = moved.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                             use_cache=use_cache, pad_token_id=0)  # explicit mask: 0 is also a real token id
        assert seq.is_cuda and 10 < seq.shape[1] <= 34 and torch.equal(seq[:, :10], prompt)
        _assert_greedy_decode_of(cpu, seq, 10, TIE)


@pytest.mark.parametrize("name", ["dense", "mod"])
@torch.no_grad()
def test_bf16_generation_on_cuda(converted, name):
    """As stored (bf16 from a bf16 engine): generation runs on the GPU and agrees with fp32 on most
    next-token argmaxes of real text (a routed decision near its threshold may differ in bf16)."""
    path = converted[name]
    tokens = _tokens(path)
    model = _load(path, dtype=torch.bfloat16).to("cuda")
    assert next(model.parameters()).dtype == torch.bfloat16
    logits = model(tokens.cuda()).logits
    assert torch.isfinite(logits).all()
    agree = (logits.float().argmax(-1).cpu() == _load(path, dtype=torch.float32)(tokens).logits.argmax(-1))
    assert agree.float().mean() >= 0.9, agree.float().mean()
    prompt = tokens[:, :10].cuda()
    seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                         pad_token_id=0)
    assert seq.is_cuda and 10 < seq.shape[1] <= 34 and int(seq.max()) < model.config.vocab_size
