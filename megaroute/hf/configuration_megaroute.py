"""Hugging Face config for megaroute models (shipped next to the weights of a converted checkpoint).

It stores megaroute's own `model` and `routing` config sections verbatim, so the model is rebuilt
by megaroute itself; the standard HF fields are derived from them for tools that read them.
"""

from __future__ import annotations

from transformers import PretrainedConfig

ROUTING_MODES = ("causal", "hard", "topk")
TOPK_WARNING = ("routing_mode 'topk': routed layers choose their tokens by top-k over the whole sequence, which "
                "sees future tokens; log-likelihoods (lm-eval) and generations of this model are not "
                "autoregressive. The default, the mode of the run's eval/loss (causal; hard for halting), is honest.")


class MegarouteConfig(PretrainedConfig):
    model_type = "megaroute"

    def __init__(self, megaroute_model: dict | None = None, megaroute_routing: dict | None = None,
                 routing_mode: str = "causal", **kwargs):
        # Routed layers default to "causal": each token decides from its own past, which honest
        # log-likelihood evaluation and sampling need. "topk" (training-time, sees the future) is opt-in.
        if routing_mode not in ROUTING_MODES:
            raise ValueError(f"routing_mode must be one of {ROUTING_MODES}, got {routing_mode!r}")
        self.megaroute_model = dict(megaroute_model or {})
        self.megaroute_routing = dict(megaroute_routing or {"method": "none"})
        self.routing_mode = routing_mode
        m = self.megaroute_model
        for hf_name, ours in (("vocab_size", "vocab_size"), ("hidden_size", "d_model"),
                              ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                              ("max_position_embeddings", "max_seq_len"), ("rms_norm_eps", "norm_eps"),
                              ("rope_theta", "rope_theta")):
            if ours in m:
                kwargs.setdefault(hf_name, m[ours])
        # megaroute ties the LM head itself (both weights are stored); HF must not re-tie or re-init them.
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
