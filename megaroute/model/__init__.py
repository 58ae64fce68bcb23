"""Dense decoder-only transformer pieces; routed layers live in megaroute.model.routing."""

from .transformer import COMPILE_MODES, CUDA_GRAPH_MODES, DTYPES, ForwardOptions, ModelOutput, Transformer, build_model

__all__ = ["COMPILE_MODES", "CUDA_GRAPH_MODES", "DTYPES", "ForwardOptions", "ModelOutput", "Transformer",
           "build_model"]
