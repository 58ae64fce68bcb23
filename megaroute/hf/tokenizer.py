"""The run's tokenizer as Hugging Face tokenizer files, so AutoTokenizer.from_pretrained(dir) works.

SentencePiece: transformers' Llama tokenizer built from the `.model` file reproduces SentencePiece's
ids (no BOS added: megaroute never trains with one). Character tokenizer: a `tokenizers` WordLevel
model over single characters (each character is its own pre-token; decoding concatenates), with
newline as its BOS token (see _char). Hugging Face tokenizer (kind hf): its tokenizer.json as is, with
the special tokens megaroute recorded, minus a post-processor that adds tokens (see _hf).
`export_tokenizer` checks the exported ids against megaroute's on a sample before returning.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ..data.tokenizers import CharTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n  All: Speak, speak! 0123 ünïcødé"


def _sentencepiece(tok: SentencePieceTokenizer, out_dir: str):
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
            f.write(tok.to_bytes())
        hf = LlamaTokenizer.from_pretrained(tmp, add_bos_token=False, add_eos_token=False, legacy=False)
    hf.save_pretrained(out_dir)
    return hf


def _char(tok: CharTokenizer, out_dir: str):
    from tokenizers import Regex
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = tok.decode(range(tok.vocab_size))
    rust = RustTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    rust.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newlines too
    rust.decoder = decoders.Fuse()  # ids -> characters joined without separators
    # No special tokens exist, but evaluation harnesses need a token to condition an empty context on
    # (lm-eval's prefix token = BOS, else EOS): newline, where documents of a char corpus begin. It is
    # never added to encodings (no post-processor).
    special = {"bos_token": "\n"} if "\n" in chars else {}
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, clean_up_tokenization_spaces=False, **special)
    hf.save_pretrained(out_dir)
    return hf


def _hf(tok: HFTokenizer, out_dir: str):
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer.from_str(tok.tokenizer_json)
    if rust.encode("a").ids != rust.encode("a", add_special_tokens=False).ids:
        # A template post-processor (Llama's BOS) adds tokens the model never saw in training (megaroute
        # encodes without them): drop it, so the exported tokenizer's default encoding is the training one.
        rust.post_processor = None
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, clean_up_tokenization_spaces=False, **tok.special_tokens)
    hf.save_pretrained(out_dir)
    return hf


def export_tokenizer(tok: Tokenizer, out_dir: str):
    """Writes tokenizer files into out_dir; returns the transformers tokenizer (ids checked)."""
    exporters = {"sentencepiece": _sentencepiece, "hf": _hf}
    hf = exporters.get(tok.kind, _char)(tok, out_dir)
    sample = SAMPLE if tok.kind in exporters else "".join(c for c in SAMPLE if _encodable(tok, c))
    ours, theirs = tok.encode(sample), hf(sample, add_special_tokens=False)["input_ids"]
    if ours != theirs:
        raise RuntimeError(f"exported {tok.kind} tokenizer disagrees with megaroute's on {sample!r}: "
                           f"{theirs[:20]} != {ours[:20]}")
    return hf


def _encodable(tok: Tokenizer, c: str) -> bool:
    try:
        tok.encode(c)
        return True
    except Exception:
        return False


def copy_tokenizer_source(tok: Tokenizer, out_dir: str) -> None:
    """Also keep megaroute's own tokenizer file (provenance: its sha256 is the run's tokenizer hash)."""
    if tok.path and os.path.isfile(tok.path):
        shutil.copyfile(tok.path, os.path.join(out_dir, "megaroute_tokenizer" + tok.suffix))
