"""The converter refuses damaged or foreign checkpoints before writing anything (sha256 against the
manifest, config_hash against the config; exit code 2), and exports the character tokenizer with EOS
and pad tokens that batched generate() uses as is."""

import json
import os

import pytest
import torch

from megaroute.cli import main
from megaroute.hf.convert import convert
from megaroute.hf.reader import IntegrityError
from megaroute.hf.tokenizer import CHAR_EOS, CHAR_PAD, export_tokenizer

from .test_convert import _offline, char_tok, make_run  # noqa: F401  (fixtures)

SHARD = os.path.join("checkpoints", "step_00000003", "mp_rank_00_model_states.pt")


def _zero_middle(path: str, n: int = 64 * 1024) -> None:
    """Zeroes n bytes in the middle of a file, keeping its size: only the sha256 can tell."""
    data = bytearray(open(path, "rb").read())
    n = min(n, len(data) // 2)
    start = (len(data) - n) // 2
    data[start:start + n] = bytes(n)
    with open(path, "wb") as f:
        f.write(data)


def _cli(run, out, char_tok, *extra):
    return main(["convert", str(run), str(out), "--tokenizer", char_tok.path, "--no-progress", *extra])


def _leftovers(parent):
    return [n for n in os.listdir(parent) if n.startswith(".")]


def test_damaged_shard_is_refused_before_any_output(make_run, tmp_path, char_tok, capsys):
    from megaroute.train.checkpoint import MANIFEST

    run, _, _ = make_run("routing.method=mod")
    shard = os.path.join(run, SHARD)
    size = os.path.getsize(shard)
    expected = json.load(open(os.path.join(os.path.dirname(shard), MANIFEST)))["files"][os.path.basename(shard)]
    _zero_middle(shard)
    assert os.path.getsize(shard) == size
    capsys.readouterr()
    assert _cli(run, tmp_path / "out" / "hf", char_tok) == 2
    err = capsys.readouterr().err
    assert shard in err and "sha256 mismatch" in err and expected["sha256"] in err and "--skip-verify" in err
    assert not (tmp_path / "out").exists()  # not even the parent directory
    # An existing output stays as it was, even with --force.
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("keep me")
    assert _cli(run, keep, char_tok, "--force") == 2
    assert os.listdir(keep) == ["precious.txt"] and not _leftovers(tmp_path)
    with pytest.raises(IntegrityError, match="mp_rank_00_model_states.pt: sha256 mismatch"):
        convert(run, str(tmp_path / "api"), tokenizer=char_tok.path, progress=False)
    assert not (tmp_path / "api").exists()

    # --skip-verify converts the damaged checkpoint anyway, and says so loudly.
    assert _cli(run, tmp_path / "forced", char_tok, "--skip-verify") == 0
    assert "WARNING: --skip-verify" in capsys.readouterr().err
    assert "model.safetensors" in os.listdir(tmp_path / "forced")


@pytest.mark.parametrize("override", ["train.seed=7", None])
def test_foreign_runs_checkpoint_is_refused_before_any_output(make_run, tmp_path, char_tok, capsys, override):
    """Same shapes, another config (seed or name): its config_hash differs, so it must not convert
    under this run's config."""
    ours, _, _ = make_run(name="ours")
    theirs, _, _ = make_run(*([override] if override else []), name="theirs", seed=1)
    capsys.readouterr()
    # The other run's checkpoint with our config.yaml...
    assert _cli(theirs, tmp_path / "hf", char_tok, "--config", os.path.join(ours, "config.yaml")) == 2
    err = capsys.readouterr().err
    assert "'config_hash'" in err and os.path.join(ours, "config.yaml") in err
    assert not (tmp_path / "hf").exists() and not _leftovers(tmp_path)
    # ...or copied into our run directory.
    os.replace(os.path.join(ours, "checkpoints"), str(tmp_path / "ours_checkpoints"))
    os.rename(os.path.join(theirs, "checkpoints"), os.path.join(ours, "checkpoints"))
    with pytest.raises(IntegrityError, match="client state key 'config_hash'"):
        convert(ours, str(tmp_path / "hf"), tokenizer=char_tok.path, progress=False)
    assert not (tmp_path / "hf").exists()
    assert _cli(ours, tmp_path / "hf", char_tok, "--skip-verify") == 0  # the opt-out


@pytest.mark.parametrize("method", ["none", "mod"])  # the native Llama export and the remote-code one
@torch.no_grad()
def test_char_tokenizer_has_eos_and_pad_for_batched_generation(make_run, tmp_path, char_tok, method):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    run, _, cfg = make_run(f"routing.method={method}", "routing.capacity=0.5", "routing.every=1",
                         "routing.offset=0", seed=5)
    out = convert(run, str(tmp_path / "hf"), tokenizer=char_tok.path, progress=False)
    n = char_tok.vocab_size
    assert cfg.model.vocab_size >= n + 2  # the spare rows the added tokens use
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (CHAR_EOS, n, CHAR_PAD, n + 1)
    assert tok.padding_side == "left"
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.pad_token_id) == (n, n + 1)
    sample = "First Citizen:\nBefore we proceed"
    assert tok(sample)["input_ids"] == char_tok.encode(sample)  # nothing added to plain encodings

    # Batched generation straight from the exported files: no pad_token_id argument, no tokenizer edits.
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    prompts = ["First Citizen:\nBefore we proceed", "Speak, speak"]
    batch = tok(prompts, padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, 0] == 0  # the shorter prompt is padded on the left, with the pad id
    assert batch["input_ids"][1, 0] == n + 1
    together = model.generate(**batch, max_new_tokens=10, do_sample=False)
    for row, prompt in enumerate(prompts):
        alone = model.generate(**tok([prompt], return_tensors="pt"), max_new_tokens=10, do_sample=False)
        new = alone[0, len(char_tok.encode(prompt)):].tolist()
        got = together[row, batch["input_ids"].shape[1]:].tolist()
        assert got[:len(new)] == new and all(t == n + 1 for t in got[len(new):]), row


def test_char_tokenizer_without_spare_ids(tmp_path, char_tok, capsys):
    """One spare row: EOS doubles as pad; none: newline (the BOS) serves as both, with a warning."""
    n = char_tok.vocab_size
    one = export_tokenizer(char_tok, str(tmp_path / "one"), n + 1)
    assert (one.eos_token_id, one.pad_token_id, one.eos_token) == (n, n, CHAR_EOS)
    capsys.readouterr()
    none = export_tokenizer(char_tok, str(tmp_path / "none"), n)
    assert none.eos_token == none.pad_token == "\n" and none.eos_token_id < n
    assert "no spare id" in capsys.readouterr().err


def test_lm_eval_generate_until_batched(make_run, tmp_path, char_tok):
    """lm-eval's generation path (left-padded batches, the tokenizer's pad and EOS) on the exported files."""
    import textwrap

    import lm_eval
    from lm_eval.tasks import TaskManager

    run, _, _ = make_run("routing.method=mod")
    out = convert(run, str(tmp_path / "hf"), tokenizer=char_tok.path, progress=False)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [{"context": "First Citizen:\nYou are all resolved rather to", "answer": " die"},
            {"context": "Speak, speak", "answer": "!"}, {"context": "We know't, we know", "answer": "'t."}]
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "megaroute_gen.yaml").write_text(textwrap.dedent(f"""\
        task: megaroute_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tasks / 'docs.jsonl'}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{context}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n\\n"]
          max_gen_toks: 6
          do_sample: false
        metric_list:
          - metric: exact_match
        """))
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},trust_remote_code=True",
                                      tasks=["megaroute_gen"], task_manager=TaskManager(include_path=str(tasks)),
                                      batch_size=2, device="cpu", log_samples=True)
    assert 0.0 <= results["results"]["megaroute_gen"]["exact_match,none"] <= 1.0
    assert all(isinstance(s["resps"][0][0], str) for s in results["samples"]["megaroute_gen"])
