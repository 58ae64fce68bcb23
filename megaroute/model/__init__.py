"""Dense decoder-only transformer pieces; routed layers live in megaroute.model.routing."""

from .transformer import DTYPES, ModelOutput, Transformer, build_model

__all__ = ["DTYPES", "ModelOutput", "Transformer", "build_model"]
