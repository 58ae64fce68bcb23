"""`megaroute data prepare|verify` end to end on the bundled corpus."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megaroute.cli import main
from megaroute.data.loader import PackedDataset
from megaroute.data.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[3]
CHAR_CONFIG = "configs/data/tinyshakespeare_char.yaml"


def test_prepare_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "char"
    assert main(["data", "prepare", "--config", CHAR_CONFIG, f"data.output_dir={out}", "--no-progress"]) == 0
    assert "train: 1,0" in capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    assert index["vocab_size"] == 65 and index["source"]["files"][0]["bytes"] == 1115394
    ds = PackedDataset(str(out), "train", verify="full", tokenizer_hash=load_tokenizer(str(out)).hash)
    assert ds.seq_len == 256 and len(ds) > 3000
    corpus = (REPO / "data" / "tinyshakespeare.txt").read_text()
    assert load_tokenizer(str(out)).decode(ds[0].tolist()) in corpus

    assert main(["data", "verify", str(out)]) == 0
    assert "val:" in capsys.readouterr().out


def test_prepare_errors_are_reported_not_raised(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    rc = main(["data", "prepare", "--config", CHAR_CONFIG, f"data.source={tmp_path}/missing.txt",
               f"data.output_dir={tmp_path}/out", "--no-progress"])
    assert rc == 1
    assert "megaroute: error: data.source:" in capsys.readouterr().err
    assert main(["data", "prepare", "--config", CHAR_CONFIG, "data.num_workers=0"]) == 2  # ConfigError
    assert "data.num_workers" in capsys.readouterr().err


def test_console_script(tmp_path):
    exe = Path(sys.executable).parent / "megaroute"
    if not exe.exists():
        exe = shutil.which("megaroute")
        if exe is None:
            pytest.skip("megaroute console script not installed (pip install -e .)")
    out = tmp_path / "bpe"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [str(exe), "data", "prepare", "--config", "configs/data/tinyshakespeare_bpe.yaml", f"data.output_dir={out}",
         "data.tokenizer.vocab_size=1024", "--no-progress"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "index.json").read_text())
    assert index["tokenizer"]["kind"] == "sentencepiece" and index["vocab_size"] == 1024
    assert index["eos_id"] == 2 and index["splits"]["val"]["num_tokens"] > 0
    tok = load_tokenizer(str(out))
    text = (REPO / "data" / "tinyshakespeare.txt").read_text()[:2000]
    assert tok.decode(tok.encode(text)) == text
