"""Hugging Face wrapper around megaroute's own Transformer (the remote code of a routed export).

The wrapper holds a megaroute `Transformer` and calls its forward, so a converted model computes
exactly what megaroute computes; it contains no model code of its own. It is not copied as it is: the
converter ships it with the megaroute modules it imports, generated as flat files beside the weights
(megaroute/hf/bundle.py), so the exported directory needs only torch and transformers. Parameter
names are megaroute's, under "model.". Token dispatch in routed layers uses the PyTorch reference
(routing.dispatch "torch": the kernels' semantics; the Triton kernels are not shipped).

Generation: the cache (`cache` from transformers 5.2x, `past_key_values` before; forward takes either
and returns it under the installed version's name) is a MegarouteCache around megaroute's
routing-aware KV cache (a token that a routed layer skips writes no keys/values there). Cached
decoding needs a causal routing mode; the config's default ("causal") is one.
"""

from __future__ import annotations

import warnings
from dataclasses import MISSING, fields, is_dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..config import ModelConfig, RoutingConfig
from ..model import ForwardOptions, build_model
from ..model.rope import RotaryEmbedding
from .configuration_megaroute import TOPK_WARNING, MegarouteConfig


def _section(cls, values: dict, path: str):
    """A config section from its dataclasses.asdict() form in config.json, nested sections included."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"config.json: unknown key(s) {', '.join(f'{path}.{k}' for k in unknown)} "
                         "(written by a newer megaroute?)")
    kwargs = {}
    for key, value in values.items():
        nested = known[key].default_factory
        kwargs[key] = (_section(nested, value, f"{path}.{key}")
                       if nested is not MISSING and is_dataclass(nested) and isinstance(value, dict) else value)
    return cls(**kwargs)


def megaroute_sections(config: MegarouteConfig) -> tuple[ModelConfig, RoutingConfig]:
    """(ModelConfig, RoutingConfig) rebuilt from config.json and validated by megaroute's own sections."""
    model = _section(ModelConfig, {**config.megaroute_model, "dtype": "float32"}, "model")  # HF's dtype casts later
    routing = _section(RoutingConfig, config.megaroute_routing, "routing")
    model.validate("model")
    routing.validate("routing")
    return model, routing


# The output field generate() reads the cache back from: transformers 5.2x renamed `past_key_values` to
# `cache` (the old name still works, with a deprecation warning on every call).
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class MegarouteCache:
    """The cache generate() carries between steps: megaroute's KVCache plus the methods generate() calls."""

    def __init__(self, kv):
        self.kv = kv

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.kv.reorder(beam_idx)

    def __len__(self) -> int:
        return len(self.kv.layers)


class MegaroutePreTrainedModel(PreTrainedModel):
    config_class = MegarouteConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransformerBlock"]

    @torch.no_grad()
    def _init_weights(self, module):
        # Weights come from the checkpoint; only derived tables (rotary cos/sin, never saved) need
        # building, e.g. after HF constructed the model on the meta device.
        if isinstance(module, RotaryEmbedding):
            module.cos, module.sin = module._tables(module.cos.device if module.cos.device.type != "meta" else "cpu")


class MegarouteForCausalLM(MegaroutePreTrainedModel, GenerationMixin):
    def __init__(self, config: MegarouteConfig):
        super().__init__(config)
        model_cfg, routing_cfg = megaroute_sections(config)
        routing_cfg.dispatch = "torch"  # the same result as the Triton kernels, which are not shipped
        if config.routing_mode == "topk" and routing_cfg.method != "none":
            warnings.warn(TOPK_WARNING, stacklevel=2)
        self.model = build_model(model_cfg, routing_cfg)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # our forward creates its own routing-aware cache

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.lm_head

    def _padding(self, mask: torch.Tensor, mode: str, cached: bool) -> str:
        """"right" or "left" when this padding is exact; raises otherwise.

        There is no padding mask in megaroute's uncached forward, but right padding is exact there
        when every decision is causal: real tokens neither attend to later pads nor are routed by
        them. Left padding runs through the cached path, whose attention masks pads out as keys.
        """
        lengths = mask.sum(1, keepdim=True)
        idx = torch.arange(mask.shape[1], device=mask.device)
        causal = mode != "topk" and self.model.decodes_incrementally
        if not causal:
            raise ValueError("megaroute models have no padding mask for routing that sees later tokens or the "
                             f"padded length (mode {mode!r}, method {self.config.megaroute_routing.get('method')!r}); "
                             "use unpadded sequences (batch size 1)")
        if torch.equal(mask.bool(), idx < lengths) and not cached:
            return "right"
        if torch.equal(mask.bool(), idx >= mask.shape[1] - lengths):
            return "left"
        raise ValueError("megaroute models support left padding, or right padding without a KV cache; "
                         "this attention_mask has inner padding or right padding with a cache")

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[MegarouteCache] = None,
                use_cache: Optional[bool] = None, labels: Optional[torch.LongTensor] = None,
                return_dict: Optional[bool] = None, routing_mode: Optional[str] = None,
                cache: Optional[MegarouteCache] = None, **kwargs):
        if cache is not None:  # transformers >= 5.2x hands the cache over as `cache`
            if past_key_values is not None:
                raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
            past_key_values = cache
        mode = routing_mode or self.config.routing_mode
        key_mask, kv = None, None
        if past_key_values is None and use_cache and not self.training:
            past_key_values = MegarouteCache(self.model.new_cache())
        if past_key_values is not None:
            kv = past_key_values.kv
        if attention_mask is not None and not bool(attention_mask.all()):
            if self._padding(attention_mask, mode, cached=kv is not None) == "left":
                T = input_ids.shape[1]
                key_mask = attention_mask[:, -T:].bool()
                if position_ids is None:  # real tokens count from 0, as without padding
                    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
                if kv is None:  # a throwaway cache: the cached path is the one that masks keys
                    kv = self.model.new_cache()
        out = self.model(input_ids, options=ForwardOptions(mode=mode, positions=position_ids, cache=kv,
                                                           key_mask=key_mask))
        logits = self.model.gather_logits(out.logits)
        loss = None
        if labels is not None:  # HF convention: labels aligned with input_ids, shifted here
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: past_key_values})
