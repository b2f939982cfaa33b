"""Triton kernels of hash-moe (fused routing)."""

from hash_moe.kernels.routing_triton import fused_topk_route

__all__ = ["fused_topk_route"]
