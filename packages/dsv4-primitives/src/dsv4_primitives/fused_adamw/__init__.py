"""Fused AdamW (issue 34): gradient clipping, the AdamW update of fp32 main params and moments, and the bf16 copy
into the model params in one pass over many tensors (a Triton pointer-table kernel), with its fp32 reference."""

from dsv4_primitives.fused_adamw.apply import DEFAULT_BLOCK, AdamWHyper, fused_adamw_step
from dsv4_primitives.fused_adamw.reference import fused_adamw_ref

__all__ = ["DEFAULT_BLOCK", "AdamWHyper", "fused_adamw_ref", "fused_adamw_step"]
