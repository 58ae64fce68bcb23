"""The run's tokenizer as Hugging Face tokenizer files, so AutoTokenizer.from_pretrained(dir) works.

SentencePiece: transformers' Llama tokenizer built from the `.model` file reproduces SentencePiece's
ids (no BOS added: megaroute never trains with one). Character tokenizer: a `tokenizers` WordLevel
model over single characters (each character is its own pre-token; decoding concatenates), with
newline as its BOS token and added EOS/pad tokens in the model's spare vocabulary rows, padding on
the left (see _char and special_ids). Hugging Face tokenizer (kind hf): its tokenizer.json as is, with
the special tokens megaroute recorded, minus a post-processor that adds tokens (see _hf).
`export_tokenizer` checks the exported ids against megaroute's on a sample before returning.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Optional

from ..data.tokenizers import CharTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer

# Added to an exported character tokenizer (whose vocabulary has no special tokens) at the first ids
# above it, which the model's padded vocabulary (model.vocab_size > the tokenizer's) holds; see special_ids.
CHAR_EOS, CHAR_PAD = "<|endoftext|>", "<|pad|>"
SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n  All: Speak, speak! 0123 ünïcødé"


def _sentencepiece(tok: SentencePieceTokenizer, out_dir: str):
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
            f.write(tok.to_bytes())
        hf = LlamaTokenizer.from_pretrained(tmp, add_bos_token=False, add_eos_token=False, legacy=False)
    hf.save_pretrained(out_dir)
    return hf


def special_ids(tok: Tokenizer, model_vocab_size: Optional[int] = None) -> tuple[Optional[int], Optional[int]]:
    """(eos_token_id, pad_token_id) of the exported tokenizer, for config.json and generation_config.json.

    SentencePiece / hf: the tokenizer's EOS for both. Character tokenizer (no special tokens of its own):
    EOS = the first id above its vocabulary and pad = the next one, rows that exist because
    model.vocab_size is padded above the tokenizer's size. Training never saw them (their logits were
    only trained down), so a model rarely ends a generation by itself; pads are masked out. With one
    spare row EOS doubles as pad; with none (model.vocab_size == the character count), newline (the
    BOS) serves as both, so generation stops at a line end: a warning says so at export.
    model_vocab_size None: assume no spare rows."""
    if tok.kind != "char":
        return tok.eos_id, tok.eos_id
    n = tok.vocab_size
    spare = 0 if model_vocab_size is None else model_vocab_size - n
    if spare >= 2:
        return n, n + 1
    if spare == 1:
        return n, n
    newline = tok.encode("\n")[0] if _encodable(tok, "\n") else None
    return newline, newline


def _char(tok: CharTokenizer, out_dir: str, model_vocab_size: Optional[int] = None):
    from tokenizers import Regex
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = tok.decode(range(tok.vocab_size))
    eos, pad = special_ids(tok, model_vocab_size)
    vocab = {c: i for i, c in enumerate(chars)}
    names = {i: c for c, i in vocab.items()}
    for name, i in ((CHAR_EOS, eos), (CHAR_PAD, pad)):
        if i is not None and i not in names:
            vocab[name], names[i] = i, name
    rust = RustTokenizer(models.WordLevel(vocab, unk_token=chars[0]))
    rust.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newlines too
    rust.decoder = decoders.Fuse()  # ids -> characters joined without separators
    # No special tokens exist, but evaluation harnesses need a token to condition an empty context on
    # (lm-eval's prefix token = BOS, else EOS): newline, where documents of a char corpus begin. It is
    # never added to encodings (no post-processor).
    special = {"bos_token": "\n"} if "\n" in chars else {}
    # EOS and pad (special_ids) so that batched generate() and lm-eval need no edits; padding on the left,
    # as generation from a batch of prompts needs (megaroute's remote code masks left pads in its cache).
    if eos is None:
        print("warning: the character tokenizer has no newline and model.vocab_size leaves no spare id: exported "
              "without EOS and pad tokens", file=sys.stderr)
    else:
        special.update(eos_token=names[eos], pad_token=names[pad])
        if eos < tok.vocab_size:
            print(f"warning: model.vocab_size={model_vocab_size} leaves no spare id above the {tok.vocab_size} "
                  "characters: the exported tokenizer uses newline as EOS and pad (generation stops at a line end)",
                  file=sys.stderr)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, clean_up_tokenization_spaces=False, padding_side="left",
                                 **special)
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


def export_tokenizer(tok: Tokenizer, out_dir: str, model_vocab_size: Optional[int] = None):
    """Writes tokenizer files into out_dir; returns the transformers tokenizer (ids checked).
    model_vocab_size: the model's (padded) vocabulary size, where a character tokenizer's added EOS/pad
    ids go (see special_ids)."""
    exporters = {"sentencepiece": _sentencepiece, "hf": _hf}
    hf = exporters[tok.kind](tok, out_dir) if tok.kind in exporters else _char(tok, out_dir, model_vocab_size)
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
