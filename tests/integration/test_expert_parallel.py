"""Expert parallelism under the real DeepSpeed engine: launcher/pretrain.py on 4 CPU gloo ranks (torchrun)
with parallel.ep=2 (each rank holds 2 of the 4 experts of every MoE layer, tokens exchanged by
all_to_all; expert gradients averaged over the expert-data-parallel groups by DeepSpeed's MoE path),
at DP=4 and at TP=2 x DP=2 (attention TP-sharded, experts EP-sharded, router and shared expert
replicated), against a single-process run of the same config (ZeRO 1, the default; ZeRO 2 at EP=2 x DP=2).

The per-step losses must match within 1e-5 (fp32) over 5 optimizer steps, with the gradient norms
(DeepSpeed's clip norm and the per-group probe), and every parameter after the 5 steps, read back
from the checkpoints (experts gathered from their per-expert files by megaroute.hf.reader). A run
stopped at step 3 and resumed from its expert checkpoint continues bit for bit, at EP=2 x DP=4 and at
TP=2 x EP=2. The TP=2 x EP=2 checkpoint exported to Hugging Face gives the logits of megaroute's
single-process model loaded from it.
"""

from __future__ import annotations

import pytest
import torch

from megaroute.hf.adapter import StateDictAdapter
from megaroute.hf.convert import convert
from megaroute.hf.reader import full_state_dict, locate, rank_state_dicts
from megaroute.model import ForwardOptions, build_model
from megaroute.train.signals import EXIT_OK

from ..hf_generation import assert_cached_generation_equals_uncached
from .conftest import losses, read_metrics, start_job
from .test_tensor_parallel import final_parameters

pytestmark = pytest.mark.slow
STEPS = 5
# 2 layers, MoE at layer 1 with 4 experts (top-2, capacity 1.25: drops happen) and a shared expert,
# 32-token sequences; global batch 8 in micro-batches of 2: the single process accumulates 4, each of
# 4 DP ranks runs one.
SMALL = ["data.seq_len=32", "model.max_seq_len=32", f"train.max_steps={STEPS}", "checkpoint.interval=1000",
         "tracking.enabled=false", "train.micro_batch_size=2", "routing.method=moe", "routing.every=2",
         "routing.offset=1", "routing.moe.num_experts=4", "routing.moe.top_k=2", "routing.moe.shared_experts=1"]


def _job(workdir, data, name, *overrides, nprocs=1):
    return start_job(workdir, data, "configs/tiny.yaml", *SMALL, *overrides, nprocs=nprocs,
                     launcher="python" if nprocs == 1 else "torchrun", name=name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


LAYOUTS = {"single": ((), 1), "ep2_dp4": (("parallel.ep=2",), 4),  # name -> (overrides, ranks)
           "tp2_ep2": (("parallel.tp=2", "parallel.ep=2"), 4),  # TP=2 x DP=2, the DP pair one EP group
           "ep2_dp2_zero2": (("parallel.ep=2", "optim.zero_stage=2"), 2)}  # ZeRO-2: gradients partitioned


@pytest.fixture(scope="module")
def runs(workdir, char_data):
    """run(name) -> {step: metrics}: each layout of LAYOUTS launched once per module."""
    cache: dict[str, dict[int, dict]] = {}

    def get(name: str) -> dict[int, dict]:
        if name not in cache:
            overrides, nprocs = LAYOUTS[name]
            job = _job(workdir, char_data, name, *overrides, nprocs=nprocs)
            assert job.wait(600) == EXIT_OK, job.output()[-4000:]
            cache[name] = read_metrics(workdir / "runs" / name)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS)[1:])
def test_expert_parallel_run_matches_single_process(workdir, runs, name):
    reference, parallel = runs("single"), runs(name)
    assert sorted(reference) == sorted(parallel) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        ref, got = reference[step], parallel[step]
        assert abs(got["train/loss"] - ref["train/loss"]) <= 1e-5, (step, got["train/loss"], ref["train/loss"])
        for key in ("train/grad_norm", "grad_norm/base"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4), (step, key, got[key], ref[key])
    files = {p.name for p in (workdir / "runs" / name / "checkpoints" / f"step_{STEPS:08d}").iterdir()}
    tp = 2 if name.startswith("tp2") else 1
    assert {f"layer_0_expert_{e}_mp_rank_{t:02d}_model_states.pt" for e in range(4) for t in range(tp)} <= files
    reference_w, parallel_w = (final_parameters(workdir / "runs" / n) for n in ("single", name))
    assert reference_w.keys() == parallel_w.keys() and "layers.1.moe.w_gate_up" in reference_w
    for key, want in reference_w.items():
        torch.testing.assert_close(parallel_w[key], want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("layout", ["ep2_dp4", "tp2_ep2"])
def test_save_and_resume_continues_identically(workdir, char_data, runs, layout):
    name = f"resume_{layout}"
    overrides, nprocs = LAYOUTS[layout]
    first = _job(workdir, char_data, name, *overrides, "train.exit_interval=3", nprocs=nprocs)
    assert first.wait(600) != EXIT_OK  # requeue exit (torchrun reports any non-zero exit as 1)
    second = _job(workdir, char_data, name, *overrides, nprocs=nprocs)
    assert second.wait(600) == EXIT_OK, second.output()[-4000:]
    assert "at step 3" in second.output()
    assert losses(workdir / "runs" / name) == {s: m["train/loss"] for s, m in runs(layout).items()}


@torch.no_grad()
def test_tp2_ep2_checkpoint_exports_to_hf_with_megaroute_logits(workdir, runs, tmp_path):
    """Attention and vocabulary in per-TP-rank shards, routed experts in per-expert files, router and
    shared expert replicated over TP (a full copy in each rank's file: taken once, not concatenated). The
    reference reads the checkpoint through the same reader; test_expert_parallel_run_matches_single_process
    checks that reader's weights against the single-process run."""
    from transformers import AutoModelForCausalLM

    runs("tp2_ep2")
    src = locate(str(workdir / "runs" / "tp2_ep2"))
    cfg = src.config
    assert (cfg.parallel.tp, cfg.parallel.ep) == (2, 2)
    shapes = StateDictAdapter(cfg.model, cfg.routing).shapes
    for key in ("layers.1.block.mlp.gate_up.weight", "layers.1.moe.router.weight", "layers.1.moe.w_gate_up"):
        assert [tuple(r[key].shape) for r in rank_state_dicts(src)] == [shapes[key]] * 2, key
    model = build_model(cfg.model, cfg.routing).eval()
    model.load_state_dict(full_state_dict(src))
    hf = AutoModelForCausalLM.from_pretrained(convert(src.tag_dir, str(tmp_path / "hf"), progress=False),
                                             trust_remote_code=True).eval()
    x = torch.randint(1, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf(x).logits, model(x, options=ForwardOptions(mode="causal")).logits, atol=1e-5,
                               rtol=0)
    assert_cached_generation_equals_uncached(hf, x[:1, :10], 12)
