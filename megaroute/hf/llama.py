"""Dense megaroute models (routing.method none) as a native `LlamaForCausalLM`: no remote code.

A dense megaroute Transformer is the Llama architecture, so the export only renames and splits:
    embed.weight                      -> model.embed_tokens.weight (all rows: the padded vocabulary is kept)
    layers.i.block.attn_norm.weight   -> model.layers.i.input_layernorm.weight
    layers.i.block.attn.qkv.weight    -> model.layers.i.self_attn.{q,k,v}_proj.weight (q|k|v row blocks)
    layers.i.block.attn.out.weight    -> model.layers.i.self_attn.o_proj.weight
    layers.i.block.mlp_norm.weight    -> model.layers.i.post_attention_layernorm.weight
    layers.i.block.mlp.gate_up.weight -> model.layers.i.mlp.{gate,up}_proj.weight (gate|up row blocks)
    layers.i.block.mlp.down.weight    -> model.layers.i.mlp.down_proj.weight
    norm.weight                       -> model.norm.weight
    lm_head.weight                    -> lm_head.weight (omitted when tied: tie_word_embeddings)

The math matches term by term (megaroute/model/*.py): pre-norm RMSNorm (weight * x / rms, eps =
model.norm_eps), no biases, multi-head attention with n_kv_heads = n_heads and 1/sqrt(head_dim)
scaling, SwiGLU down(silu(gate) * up), and RoPE rotating the two *halves* of each head
(megaroute's apply_rotary is the GPT-NeoX / HF rotate_half layout, inv_freq = theta^(-2i/d)), so
q/k rows need no Meta->HF permutation. Routed methods keep the remote-code export (convert.py).
"""

from __future__ import annotations

import re

import torch

from ..config import ModelConfig

_LAYER = re.compile(r"^layers\.(\d+)\.block\.(.+)$")
_SPLIT = {"attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
          "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
_RENAME = {"attn_norm.weight": "input_layernorm.weight", "attn.out.weight": "self_attn.o_proj.weight",
           "mlp_norm.weight": "post_attention_layernorm.weight", "mlp.down.weight": "mlp.down_proj.weight"}
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


def llama_tensors(key: str, full: torch.Tensor, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """One full (TP-merged) megaroute tensor -> its (Llama name, tensor) pairs ([] for a tied LM head)."""
    if key in _TOP:
        return [] if key == "lm_head.weight" and tied else [(_TOP[key], full)]
    m = _LAYER.match(key)
    if m:
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest in _SPLIT:
            names = _SPLIT[rest]
            return [(prefix + n, t) for n, t in zip(names, full.chunk(len(names), dim=0))]
        if rest in _RENAME:
            return [(prefix + _RENAME[rest], full)]
    raise KeyError(f"{key}: no LlamaForCausalLM counterpart (export routed models with --format megaroute)")


def llama_config(m: ModelConfig, dtype: torch.dtype, **kwargs):
    """The LlamaConfig computing what megaroute's dense Transformer computes."""
    from transformers import LlamaConfig

    theta = float(m.rope_theta)
    config = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_hidden, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads, head_dim=m.head_dim, hidden_act="silu",
        max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=theta,
        tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        initializer_range=m.init_std, architectures=["LlamaForCausalLM"], dtype=str(dtype).removeprefix("torch."),
        **kwargs)
    rope = getattr(config, "rope_parameters", None)  # transformers 5 keeps theta here
    if isinstance(rope, dict) and float(rope.get("rope_theta", theta)) != theta:
        raise ValueError(f"LlamaConfig dropped rope_theta={theta}: {rope}")
    config.rope_theta = theta  # also as a top-level field, which transformers 4.x reads
    return config


def model_config_from_llama(config) -> ModelConfig:
    """The megaroute ModelConfig of a Llama export (inverse of llama_config; a LlamaConfig or its dict)."""
    c = config if isinstance(config, dict) else config.to_dict()
    rope = c.get("rope_parameters") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    if c.get("num_key_value_heads", c["num_attention_heads"]) != c["num_attention_heads"] or c.get("attention_bias") \
            or c.get("mlp_bias") or rope.get("rope_type", "default") != "default" or c.get("hidden_act", "silu") != "silu":
        raise ValueError("not a megaroute dense export: grouped-query attention, biases, rope scaling or a non-SiLU "
                         "activation have no megaroute equivalent")
    return ModelConfig(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                       n_heads=c["num_attention_heads"], d_ff=c["intermediate_size"],
                       max_seq_len=c["max_position_embeddings"], rope_theta=float(theta), norm_eps=c["rms_norm_eps"],
                       tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                       init_std=c.get("initializer_range", 0.02))


def megaroute_state_dict(llama_state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict -> megaroute's dense Transformer state dict (inverse of llama_tensors)."""
    inverse_top = {v: k for k, v in _TOP.items()}
    inverse_rename = {v: k for k, v in _RENAME.items()}
    out: dict[str, torch.Tensor] = {}
    layer = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    for name, t in llama_state.items():
        if name in inverse_top:
            out[inverse_top[name]] = t
        elif (m := layer.match(name)) and m.group(2) in inverse_rename:
            out[f"layers.{m.group(1)}.block.{inverse_rename[m.group(2)]}"] = t
    for fused, names in _SPLIT.items():
        for i in sorted({int(m.group(1)) for n in llama_state if (m := layer.match(n))}):
            out[f"layers.{i}.block.{fused}"] = torch.cat([llama_state[f"model.layers.{i}.{n}"] for n in names])
    if tied:
        out["lm_head.weight"] = out["embed.weight"]
    return out
