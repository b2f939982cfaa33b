"""Triton kernels of hash-moe (fused routing, fused clamped SwiGLU)."""

from hash_moe.kernels.routing_triton import fused_topk_route
from hash_moe.kernels.swiglu_triton import fused_clamped_swiglu

__all__ = ["fused_clamped_swiglu", "fused_topk_route"]
