"""Hugging Face tokenizer directories built offline for the tests of data.tokenizer.kind=hf: a tiny
byte-level BPE trained here on a few strings, and a GPT-2-sized stand-in (50257 ids). Nothing is
downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

EOS = "<|endoftext|>"
BOS = "<s>"
# What transformers needs to load a directory that holds only tokenizer.json (no config.json).
FAST_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}

TRAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "First Citizen: Before we proceed any further, hear me speak.",
    "def routed(x):\n    return x + 1  # indentation and newlines\n",
    "Tokens 0123456789, café, naïve, ☃ and 🐍 are bytes to a byte-level BPE.",
] * 20


def bpe_tokenizer_dir(path: Path, tokenizer_config: Optional[dict] = FAST_CONFIG, bos_template: bool = False,
                      vocab_size: int = 330, special_tokens_map: Optional[dict] = None) -> Path:
    """A GPT-2-style byte-level BPE (EOS <|endoftext|>) saved as tokenizer.json in `path`, plus a
    tokenizer_config.json (None: none). bos_template: a Llama-style post-processor that prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = [EOS, BOS] if bos_template else [EOS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(TRAIN_TEXTS, trainer)
    if bos_template:
        tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tk.token_to_id(BOS))])
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if special_tokens_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return path


def gpt2_sized_tokenizer_dir(path: Path) -> Path:
    """GPT-2's shape without its merges: 50256 word-level entries plus <|endoftext|> at id 50256, and a
    tokenizer_config.json that, like the hub's openai-community/gpt2, names no special token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50256)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([EOS])
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    return path
