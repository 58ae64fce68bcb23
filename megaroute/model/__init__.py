"""Dense decoder-only transformer pieces; routed layers live in megaroute.model.routing."""

from .transformer import DTYPES, ForwardOptions, ModelOutput, Transformer, build_model

__all__ = ["DTYPES", "ForwardOptions", "ModelOutput", "Transformer", "build_model"]
