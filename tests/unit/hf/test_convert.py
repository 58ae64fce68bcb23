"""Converter and HF wrapper on checkpoint-shaped run directories written without training.

Real components: transformers' Auto* loading from the converted directory (trust_remote_code),
lm-eval-harness's Python API on a local YAML task, safetensors files. Checkpoints from real
DeepSpeed jobs (ZeRO 1/3, TP 1/2) are in tests/integration/test_hf_convert.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaroute.data.tokenizers import CharTokenizer, train_sentencepiece
from megaroute.hf.adapter import StateDictAdapter
from megaroute.hf.convert import convert
from megaroute.hf.reader import ConversionError
from megaroute.hf.synthetic import write_checkpoint
from megaroute.model import ForwardOptions
from megaroute.model.routing.calibration import QuantileCut, calibrate_thresholds
from megaroute.parallel.layers import shard_dim

from ...hf_generation import assert_cached_generation_equals_uncached, scramble_weights
from ...lm_eval_tasks import multiple_choice_task

REPO = str(Path(__file__).resolve().parents[3])
TEXT = open(os.path.join(REPO, "data/tinyshakespeare.txt")).read()[:20000]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def char_tok(tmp_path):
    tok = CharTokenizer(TEXT)
    path = tmp_path / "tok.json"
    path.write_bytes(tok.to_bytes())
    return CharTokenizer.from_bytes(path.read_bytes(), str(path))


@pytest.fixture
def make_run(tmp_path, make_model, char_tok):
    """make_run(*overrides) -> (run_dir, model, cfg): a TP=1 checkpoint of a freshly initialized model."""

    def make(*overrides, name="run", seed=0):
        model, cfg = make_model(*overrides, f"name={name}", seed=seed)
        run = tmp_path / "runs" / name
        write_checkpoint(model, cfg, str(run), char_tok.hash, step=3)
        return str(run), model.eval(), cfg

    return make


def _load(out):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


def _convert(run, out, char_tok, **kw):
    return convert(run, str(out), tokenizer=char_tok.path, progress=False, **kw)


@pytest.mark.parametrize("method", ["none", "mod", "random", "stride", "first_k", "halting", "depth_gate",
                                    "early_exit"])  # MoE/MoDE: test_moe_and_mode_export_... below
@torch.no_grad()
def test_converted_logits_equal_megaroute_every_variant(make_run, tmp_path, char_tok, method):
    run, model, _ = make_run(f"routing.method={method}", "routing.capacity=0.5")
    out = _convert(run, tmp_path / "hf", char_tok, format="megaroute")  # dense too: the remote-code export
    hf = _load(out)
    x = torch.randint(0, 60, (2, 40))
    honest = "hard" if method == "halting" else "causal"  # the mode of eval/loss: halting's causal one is soft
    torch.manual_seed(1)  # the random baseline draws its causal choices
    ours = model(x, options=ForwardOptions(mode=honest)).logits
    torch.manual_seed(1)
    theirs = hf(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    assert hf.config.routing_mode == honest


@torch.no_grad()
def test_topk_mode_is_selectable(make_run, tmp_path, char_tok, capsys):
    run, model, _ = make_run("routing.method=mod")
    out = _convert(run, tmp_path / "hf", char_tok, routing_mode="topk")
    assert "WARNING: --routing-mode topk" in capsys.readouterr().err  # the export's numbers see the future
    with pytest.warns(UserWarning, match="routing_mode 'topk'.*sees future tokens"):  # and so does each load
        hf = _load(out)
    x = torch.randint(0, 60, (1, 32))
    torch.testing.assert_close(hf(x).logits, model(x, options=ForwardOptions(mode="topk")).logits, atol=1e-4, rtol=0)
    assert not torch.allclose(hf(x).logits, model(x, options=ForwardOptions(mode="causal")).logits, atol=1e-4)


@torch.no_grad()
def test_halting_exports_its_hard_forward_and_warns_for_the_soft_one(make_run, tmp_path, char_tok, capsys):
    """A halting run's eval/loss is the hard forward (tokens below tau skip their blocks); the default
    export is that forward. --routing-mode causal (the soft forward: every token runs every block) warns."""
    run, model, _ = make_run("routing.method=halting")
    x = torch.randint(0, 60, (1, 32))
    hard = model(x, options=ForwardOptions(mode="hard")).logits
    assert not torch.allclose(hard, model(x, options=ForwardOptions(mode="causal")).logits, atol=1e-4)
    hf = _load(_convert(run, tmp_path / "default", char_tok))
    torch.testing.assert_close(hf(x).logits, hard, atol=1e-4, rtol=0)
    assert "WARNING" not in capsys.readouterr().err
    _convert(run, tmp_path / "soft", char_tok, routing_mode="causal")
    assert "reports its eval/loss in 'hard' mode" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["mod", "depth_gate", "moe"])
@torch.no_grad()
def test_right_padded_batch_equals_unpadded_sequences(make_run, tmp_path, char_tok, method):
    run, _, _ = make_run(f"routing.method={method}", "routing.capacity=0.5")
    hf = _load(_convert(run, tmp_path / "hf", char_tok))
    a, b = torch.randint(0, 60, (1, 30)), torch.randint(0, 60, (1, 18))
    batch = torch.cat([a, torch.nn.functional.pad(b, (0, 12))])
    mask = torch.ones_like(batch)
    mask[1, 18:] = 0
    logits = hf(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[0], hf(a).logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1, :18], hf(b).logits[0], atol=1e-5, rtol=0)
    inner = torch.ones_like(batch)
    inner[1, 5] = 0
    with pytest.raises(ValueError, match="inner padding"):
        hf(batch, attention_mask=inner)
    with pytest.raises(ValueError, match="routing that sees later tokens.*'topk'"):
        hf(batch, attention_mask=mask, routing_mode="topk")


@pytest.mark.parametrize("method", ["none", "mod", "depth_gate", "halting", "mode_staged"])
@torch.no_grad()
def test_left_padded_batch_generates_like_each_sequence_alone(make_run, tmp_path, char_tok, method):
    run, _, _ = make_run(f"routing.method={method}", "routing.capacity=0.5", "routing.every=1", "routing.offset=0", seed=5)
    hf = _load(_convert(run, tmp_path / "hf", char_tok))
    a, b = torch.randint(1, 60, (1, 14)), torch.randint(1, 60, (1, 6))
    batch = torch.cat([a, torch.nn.functional.pad(b, (8, 0))])  # b left-padded with 8 pad tokens (id 0)
    mask = torch.ones_like(batch)
    mask[1, :8] = 0
    # One padded forward (the cached path masks the pads) gives each sequence's own logits.
    logits = hf(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[0], hf(a).logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1, 8:], hf(b).logits[0], atol=1e-5, rtol=0)
    scramble_weights(hf)  # tokens that follow their context (tests/hf_generation.py)
    args = dict(min_new_tokens=12, max_new_tokens=12, do_sample=False, pad_token_id=0)
    together = hf.generate(batch, attention_mask=mask, **args)
    for row, seq in ((0, a), (1, b)):
        alone = hf.generate(seq, **args)
        assert together[row, -12:].tolist() == alone[0, -12:].tolist(), row
        assert alone.tolist() == hf.generate(seq, use_cache=False, **args).tolist(), row


@pytest.mark.parametrize("method", ["none", "mod", "halting"])  # halting: its hard export
@torch.no_grad()
def test_generate_with_cache_equals_without(make_run, tmp_path, char_tok, method):
    run, _, _ = make_run(f"routing.method={method}", "routing.capacity=0.5", seed=3)
    hf = _load(_convert(run, tmp_path / "hf", char_tok))
    prompt = torch.randint(1, 60, (1, 12))
    assert_cached_generation_equals_uncached(hf, prompt, 30)
    # the cache reordered between beams (beam search settles on a repeated token sooner)
    assert_cached_generation_equals_uncached(hf, prompt, 12, min_distinct=2, num_beams=3)


# Tiny MoE/MoDE variants (4 experts of 16 units, 2 routed blocks of 4) covering both routers and both MoDEs;
# one saved as expert parallelism saves (per-expert files, the model-states file holding EP rank 0's experts).
MOE_VARIANTS = {
    "moe_token_choice_top2_shared": ("routing.method=moe", "routing.moe.top_k=2", "routing.moe.shared_experts=1"),
    "moe_expert_choice_ep2": ("routing.method=moe", "routing.moe.router=expert_choice", "parallel.ep=2"),
    "mode_staged": ("routing.method=mode_staged",),
    "mode_integrated": ("routing.method=mode_integrated", "routing.moe.router=expert_choice"),
}


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
@torch.no_grad()
def test_moe_and_mode_export_calibrated_thresholds_logits_and_cached_generation(make_model, tmp_path, char_tok,
                                                                                variant):
    """MoE/MoDE checkpoints with calibrated causal thresholds (expert choice: one per expert; MoDE staged:
    MoD's) export them as buffers: the HF model gives megaroute's causal logits (fp32, 1e-5) and cached
    generation equals uncached. Calibrating first makes the thresholds matter (all 0 would run everything)."""
    model, cfg = make_model(*MOE_VARIANTS[variant], "routing.capacity=0.5", "routing.moe.num_experts=4",
                            "routing.moe.expert_hidden=16", "name=run", seed=7)
    model.eval()
    batches = [torch.randint(0, 60, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    calibrate_thresholds(model, lambda t: model(t, options=ForwardOptions(mode="causal", calibrate=True)), batches)
    cuts = {n: m.threshold.item() for n, m in model.named_modules() if isinstance(m, QuantileCut)}
    if variant != "moe_token_choice_top2_shared":  # token choice in causal mode runs its top-k: no threshold
        assert cuts and all(t != 0 for t in cuts.values()), cuts
    run = tmp_path / "runs" / "run"
    tag_dir = write_checkpoint(model, cfg, str(run), char_tok.hash, step=3)
    assert len([f for f in os.listdir(tag_dir) if "_expert_" in f]) == (8 if cfg.parallel.ep > 1 else 0)
    hf = _load(_convert(run, tmp_path / "hf", char_tok))
    # (The HF model's modules are the bundle's classes, not megaroute's: compared by name.)
    assert {n.removeprefix("model.").removesuffix(".threshold"): b.item() for n, b in hf.named_buffers()
            if n.endswith(".threshold")} == cuts
    x = torch.randint(0, 60, (2, 40))
    out = model(x, options=ForwardOptions(mode="causal"))
    torch.testing.assert_close(hf(x).logits, out.logits, atol=1e-5, rtol=0)
    if cuts:  # the thresholds route: some tokens (expert choice: token-expert pairs) are left out
        assert 0 < min(out.executed.values() or [0.5]) and max(out.executed.values() or [0.5]) < 1, out.executed
    prompt = torch.randint(1, 60, (1, 10))  # no pad id (0) in the prompt: generate would mask it
    assert_cached_generation_equals_uncached(hf, prompt, 12)


def test_tp_merge_joins_shards_and_keeps_one_copy_of_replicated_tp_layers(make_config):
    """Under TP the MoE shared expert is a SwiGLU built without the TP group: each rank's file holds a full
    copy (taken once), while attention's fused q|k|v is split per block (joined). The TP=2 x EP=2 DeepSpeed
    export: tests/integration/test_expert_parallel.py."""
    cfg = make_config("routing.method=moe", "routing.moe.shared_experts=1", "routing.moe.num_experts=4",
                      "routing.moe.expert_hidden=16")
    adapter = StateDictAdapter(cfg.model, cfg.routing)
    shared = next(k for k in adapter.keys() if k.endswith("block.mlp.gate_up.weight"))
    qkv = next(k for k in adapter.keys() if k.endswith("attn.qkv.weight"))
    for key in (shared, qkv):
        full = torch.randn(adapter.shapes[key])
        assert torch.equal(adapter.merge(key, [full, full.clone()]), full), key  # replicas
        dim, chunks = adapter.split[key]
        assert torch.equal(adapter.merge(key, [shard_dim(full, dim, r, 2, chunks) for r in range(2)]), full), key
    with pytest.raises(ValueError, match="TP shards do not fit together"):
        adapter.merge(qkv, [torch.zeros(adapter.shapes[qkv]), torch.zeros(3, 3)])


def test_output_files_and_tokenizer(make_run, tmp_path, char_tok):
    from transformers import AutoConfig, AutoTokenizer

    run, model, cfg = make_run("routing.method=mod")
    out = _convert(run, tmp_path / "hf", char_tok)
    names = set(os.listdir(out))
    assert {"config.json", "configuration_megaroute.py", "modeling_megaroute.py", "model.safetensors",
            "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert config.auto_map["AutoModelForCausalLM"] == "modeling_megaroute.MegarouteForCausalLM"
    assert config.megaroute_model["d_model"] == cfg.model.d_model and config.megaroute_routing["method"] == "mod"
    tok = AutoTokenizer.from_pretrained(out)  # the plain call (transformers may ask about config.json's code)
    sample = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert tok(sample)["input_ids"] == char_tok.encode(sample)
    assert tok.decode(char_tok.encode(sample)) == sample
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hf")]  # no temporary directory left
    from megaroute.audit.report import load_run_model
    from megaroute.model import Transformer

    back, back_cfg = load_run_model(out)  # the audit runs this package's model on the export's weights
    assert type(back) is Transformer and back_cfg.routing.method == "mod"
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_sentencepiece_tokenizer_ids(tmp_path):
    from transformers import AutoTokenizer

    from megaroute.hf.tokenizer import export_tokenizer

    sp = train_sentencepiece(TEXT.splitlines(), 600)
    export_tokenizer(sp, str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    sample = "KING RICHARD:\n  What say you, 1234 times?"
    assert tok(sample)["input_ids"] == sp.encode(sample)
    assert tok.decode(sp.encode(sample)) == sample
    assert tok.eos_token_id == sp.eos_id


def test_sharded_safetensors(make_run, tmp_path, char_tok):
    run, model, _ = make_run()
    out = _convert(run, tmp_path / "hf", char_tok, max_shard_bytes=40_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and "model.safetensors" not in os.listdir(out)
    x = torch.randint(0, 60, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(_load(out)(x).logits, model(x, options=ForwardOptions(mode="causal")).logits,
                                   atol=1e-4, rtol=0)


def test_refuses_to_overwrite_unless_forced(make_run, tmp_path, char_tok):
    run, _, _ = make_run()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="already exists; pass --force"):
        _convert(run, out, char_tok)
    assert (out / "precious.txt").read_text() == "keep me"
    _convert(run, out, char_tok, force=True)
    assert "model.safetensors" in os.listdir(out) and "precious.txt" not in os.listdir(out)


def test_clear_errors(make_run, tmp_path, char_tok):
    run, _, _ = make_run("model.vocab_size=96", "data.tokenizer.vocab_size=96")  # divisible by 2, so the config below is a valid TP=2 one
    with pytest.raises(ConversionError, match=r"no checkpoint 'step_00000099' in .*\(checkpoints there: step_00000003\)"):
        _convert(run, tmp_path / "a", char_tok, tag="step_00000099")
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("hi")
    with pytest.raises(ConversionError, match="is not a megaroute checkpoint"):
        _convert(str(stranger), tmp_path / "b", char_tok)
    with pytest.raises(ConversionError, match="no such file"):
        _convert(str(tmp_path / "nope"), tmp_path / "c", char_tok)
    other = tmp_path / "other_tok.json"
    other.write_bytes(CharTokenizer("abc").to_bytes())
    with pytest.raises(ConversionError, match="was trained with tokenizer"):
        convert(run, str(tmp_path / "g"), tokenizer=str(other), progress=False)
    # The config says TP=2, so a second shard is expected.
    cfg_path = os.path.join(run, "config.yaml")
    text = open(cfg_path).read()
    open(cfg_path, "w").write(text.replace("  tp: 1", "  tp: 2"))
    with pytest.raises(ConversionError, match=r"mp_rank_01_model_states.pt: missing model shard"):
        _convert(run, tmp_path / "d", char_tok)
    open(cfg_path, "w").write(text.replace("d_model: 32", "d_model: 64"))
    with pytest.raises(ConversionError, match=r"client state key 'config_hash' is"):
        _convert(run, tmp_path / "e", char_tok)  # the config the checkpoint was saved with is not this one
    with pytest.raises(ConversionError, match=r"embed.weight: shape \(96, 32\).*expected \(96, 64\)"):
        _convert(run, tmp_path / "e", char_tok, skip_verify=True)
    open(cfg_path, "w").write(text)
    tag_dir = os.path.join(run, "checkpoints", "step_00000003")
    os.remove(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    with pytest.raises(ConversionError, match=r"mp_rank_00_model_states.pt: missing \(listed in manifest.json\)"):
        _convert(run, tmp_path / "f", char_tok)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_zero3_shards_of_a_bf16_engine_are_found(make_run):
    """A bf16 engine names its ZeRO-3 optimizer partitions bf16_zero_pp_rank_*: still ZeRO-3 shards."""
    from megaroute.hf.reader import locate
    from megaroute.train.checkpoint import write_manifest

    run, _, _ = make_run("optim.zero_stage=3", "train.precision=bf16")
    tag_dir = os.path.join(run, "checkpoints", "step_00000003")
    os.remove(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        open(os.path.join(tag_dir, name), "wb").close()
    write_manifest(tag_dir, 3)
    src = locate(run)
    assert src.zero3 and [os.path.basename(f) for f in src.files] == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_cli_reports_errors(make_run, tmp_path, char_tok, capsys):
    from megaroute.cli import main

    run, _, _ = make_run()
    assert main(["convert", run, str(tmp_path / "hf"), "--tokenizer", char_tok.path, "--no-progress"]) == 0
    assert main(["convert", run, str(tmp_path / "hf"), "--tokenizer", char_tok.path]) == 1
    assert "already exists; pass --force" in capsys.readouterr().err


def test_lm_eval_harness_on_local_task(make_run, tmp_path, char_tok):
    import lm_eval
    from lm_eval.tasks import TaskManager

    run, _, _ = make_run("routing.method=mod")
    out = _convert(run, tmp_path / "hf", char_tok)
    tasks = multiple_choice_task(tmp_path)
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},trust_remote_code=True",
                                      tasks=["megaroute_tiny"], task_manager=TaskManager(include_path=str(tasks)),
                                      batch_size=2, device="cpu")  # lm-eval pads on the right
    metrics = results["results"]["megaroute_tiny"]
    assert 0.0 <= metrics["acc,none"] <= 1.0
    assert all(v == v for k, v in metrics.items() if isinstance(v, float))  # finite, no NaN


def test_peak_memory_within_bound(tmp_path, make_model, char_tok):
    """Peak RSS of a conversion subprocess <= 1.5x the fp32 model size + 1 GB (largest model this CI affords)."""
    model, cfg = make_model("model.d_model=768", "model.n_heads=12", "model.n_layers=8", "model.vocab_size=8192",
                            "model.tie_embeddings=false", "model.max_seq_len=128", "name=big")
    fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
    write_checkpoint(model, cfg, str(tmp_path / "big"), char_tok.hash)
    del model
    shard = 32 * 2**20  # several output shards, as a large model has
    script = (f"from megaroute.hf.convert import convert; from megaroute.bench.convert import peak_rss_bytes; "
              "import safetensors.torch, tokenizers, tqdm, transformers; from megaroute.model import build_model; "
              "base = peak_rss_bytes(); "  # after the imports: what the process costs without any weights
              f"convert({str(tmp_path / 'big')!r}, {str(tmp_path / 'hf')!r}, tokenizer={char_tok.path!r}, progress=False, "
              f"max_shard_bytes={shard}); "
              "print(base, peak_rss_bytes())")  # VmHWM of the converter process itself
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    base, peak = map(int, res.stdout.strip().splitlines()[-1].split())
    bound = 1.5 * fp32_bytes + 2**30
    print(f"model {fp32_bytes / 2**20:.0f} MiB fp32, peak RSS {peak / 2**20:.0f} MiB (after imports "
          f"{base / 2**20:.0f} MiB), bound {bound / 2**20:.0f} MiB")
    assert fp32_bytes > 250 * 2**20
    assert peak <= bound
    # The +1 GB dominates at this size, so also bound the growth over the imported process: the
    # memory-mapped input (file-backed pages count as resident once read) plus less than one more
    # model-sized copy. A converter that materialized the full state dict twice would fail here.
    assert peak - base <= 2 * fp32_bytes


@pytest.mark.slow
def test_convert_benchmark_runs_on_tiny_configs(tmp_path, capsys):
    """Smoke test of python -m megaroute.bench.convert (figures are printed, not asserted): trains,
    calibrates, converts in subprocesses and samples, so it is slow."""
    from megaroute.bench import convert as bench

    assert bench.main(["--dense", os.path.join(REPO, "configs/tiny.yaml"), "--mod", os.path.join(REPO, "configs/tiny_mod.yaml"),
                       "--steps", "2", "--batch", "2", "--seq-len", "32", "--prompt-len", "8", "--new-tokens", "8",
                       "--repeats", "1", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("peak RSS") == 2 and "ok)" in out, out
    assert "trained 2 steps" in out and "causal thresholds calibrated on 8x2 windows of real text" in out, out
    frac = float(out.split("cpu: MoD / dense sampling speed ")[1].split("at executed fraction ")[1].split("%")[0])
    assert 0 <= frac <= 100


# Runs in a Python that cannot import megaroute: `-I -S` (isolated, no site: neither PYTHONPATH, the
# user site nor the venv's .pth files, so megaroute's editable-install finder is never installed),
# from a temporary cwd, with only the venv's site-packages directories appended to sys.path.
LLAMA_CHECK = r"""
import importlib.util, json, sys
sys.path.extend(json.loads(sys.argv[1]))
assert importlib.util.find_spec("megaroute") is None, "megaroute is importable"
try:
    import megaroute  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("megaroute is importable")
import torch
from transformers import AutoModelForCausalLM
out, tokens_path, logits_path, tasks = sys.argv[2:6]
hf = AutoModelForCausalLM.from_pretrained(out).eval()  # no trust_remote_code
assert type(hf).__name__ == "LlamaForCausalLM", type(hf)
with torch.no_grad():
    torch.save(hf(torch.load(tokens_path)).logits, logits_path)
import lm_eval
from lm_eval.tasks import TaskManager
results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out}", tasks=["megaroute_tiny"],
                                  task_manager=TaskManager(include_path=tasks), batch_size=2, device="cpu")
metrics = results["results"]["megaroute_tiny"]
assert 0.0 <= metrics["acc,none"] <= 1.0 and all(v == v for v in metrics.values() if isinstance(v, float)), metrics
assert "megaroute" not in sys.modules
print("LLAMA_OK", type(hf).__name__)
"""


@pytest.mark.parametrize("tie", [True, False])
@torch.no_grad()
def test_dense_exports_native_llama_without_megaroute(make_run, tmp_path, char_tok, tie):
    import sysconfig

    from safetensors import safe_open

    from megaroute.audit.report import load_run_model

    run, model, cfg = make_run(f"model.tie_embeddings={str(tie).lower()}", "model.rope_theta=500.0",
                               "model.norm_eps=1e-6")
    out = _convert(run, tmp_path / "hf", char_tok)  # format auto: dense -> llama
    assert not [n for n in os.listdir(out) if n.endswith(".py")]
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config and config["tie_word_embeddings"] is tie
    assert config["rms_norm_eps"] == 1e-6 and config["vocab_size"] == cfg.model.vocab_size
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"} <= names
    assert ("lm_head.weight" in names) is (not tie)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.max_seq_len))
    torch.save(tokens, tmp_path / "tokens.pt")
    tasks = multiple_choice_task(tmp_path)
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-I", "-S", "-c", LLAMA_CHECK, json.dumps(paths), out,
                          str(tmp_path / "tokens.pt"), str(tmp_path / "theirs.pt"), str(tasks)],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "LLAMA_OK LlamaForCausalLM" in res.stdout, res.stdout[-3000:] + res.stderr[-5000:]
    ours = model(tokens, options=ForwardOptions(mode="causal")).logits
    torch.testing.assert_close(torch.load(tmp_path / "theirs.pt"), ours, atol=1e-5, rtol=0)
    back, back_cfg = load_run_model(out)  # the audit reads the export back (e.g. a dense --reference)
    assert back_cfg.routing.method == "none" and back_cfg.model.tie_embeddings is tie
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_format_choice(make_run, tmp_path, char_tok):
    run, _, _ = make_run()
    out = _convert(run, tmp_path / "forced", char_tok, format="megaroute")
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "megaroute"
    assert type(_load(out)).__name__ == "MegarouteForCausalLM"
    routed, _, _ = make_run("routing.method=mod", name="routed")
    with pytest.raises(ConversionError, match="--format llama needs a dense model"):
        _convert(routed, tmp_path / "llama", char_tok, format="llama")
    assert json.load(open(os.path.join(_convert(routed, tmp_path / "auto", char_tok), "config.json")))[
        "model_type"] == "megaroute"
