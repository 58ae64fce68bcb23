"""Dense decoder-only transformer pieces; routed layers live in megaroute.routing."""

from .transformer import DTYPES, ModelOutput, Transformer, build_model

__all__ = ["DTYPES", "ModelOutput", "Transformer", "build_model"]
