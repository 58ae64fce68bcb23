"""Exporting a data.tokenizer.kind=hf tokenizer: AutoTokenizer on the exported directory encodes as
megaroute trained (no special tokens added by default), with the recorded EOS. Offline."""

import pytest

from megaroute.data.tokenizers import HFTokenizer, load_tokenizer
from megaroute.hf.convert import convert
from megaroute.hf.synthetic import write_checkpoint
from megaroute.hf.tokenizer import export_tokenizer

from ..data.hf_tokenizer_dirs import BOS, EOS, bpe_tokenizer_dir

SAMPLES = ["First Citizen:\nBefore we proceed any further, hear me speak.", "  ünïcødé ☃ 🐍 0123", ""]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.mark.parametrize("bos_template", [False, True])
def test_exported_hf_tokenizer_encodes_as_megaroute(tmp_path, bos_template):
    from transformers import AutoTokenizer

    ours = HFTokenizer.from_dir(str(bpe_tokenizer_dir(tmp_path / "src", bos_template=bos_template)))
    export_tokenizer(ours, str(tmp_path / "out"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert theirs.eos_token == EOS and theirs.eos_token_id == ours.eos_id and len(theirs) == ours.vocab_size
    for text in SAMPLES:
        # The default call too: a Llama-style BOS template is dropped, as megaroute never trains with it.
        assert theirs(text)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
        assert theirs.decode(ours.encode(text)) == text
    if bos_template:
        assert BOS in theirs.get_vocab()


def test_convert_a_run_with_an_hf_tokenizer(tmp_path, make_model):
    from transformers import AutoConfig, AutoTokenizer

    tok = HFTokenizer.from_dir(str(bpe_tokenizer_dir(tmp_path / "src")))
    saved = tmp_path / "prepared" / f"tokenizer-{tok.hash[:12]}.json"  # as prepare stores it
    saved.parent.mkdir()
    saved.write_bytes(tok.to_bytes())
    model, cfg = make_model("model.vocab_size=384", "data.tokenizer.vocab_size=384")
    run = tmp_path / "runs" / "run"
    write_checkpoint(model, cfg, str(run), tok.hash, step=1)
    out = convert(str(run), str(tmp_path / "hf"), tokenizer=str(saved), progress=False)
    assert AutoConfig.from_pretrained(out, trust_remote_code=True).eos_token_id == tok.eos_id
    exported = AutoTokenizer.from_pretrained(out)
    assert all(exported(t)["input_ids"] == tok.encode(t) for t in SAMPLES)
    assert load_tokenizer(str(tmp_path / "hf" / "megaroute_tokenizer.json")).hash == tok.hash  # provenance copy
