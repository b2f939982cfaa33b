"""RMSNorm (dsv4-architecture.md §0): fp32 reference, fused Triton forward/backward, megatron spec module."""

from dsv4_primitives.rmsnorm.apply import rms_norm
from dsv4_primitives.rmsnorm.module import RMSNorm
from dsv4_primitives.rmsnorm.reference import rms_norm_ref

__all__ = ["RMSNorm", "rms_norm", "rms_norm_ref"]
