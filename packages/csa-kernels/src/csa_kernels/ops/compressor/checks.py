"""Input validation of the compressor (:func:`~csa_kernels.compressor_pool`, ``compress`` and its streaming form).

Shared by the fp32 reference and the Triton path (bad input -> ``ValueError`` saying what and how to fix); the
reference module holds the math only.
"""

from __future__ import annotations

from csa_kernels._checks import check_bounds, check_float, check_ratio, check_shape
from dsv4_primitives import RopeConfig


def check_pool_inputs(kv, score, ape, ratio, overlap, bounds):
    """Shapes, dtypes, ratio and the boundaries (a ``SeqBoundaries`` over ``kv``'s rows); returns ``bounds``."""
    check_pool_shapes(kv, score, ape, ratio, overlap)
    return check_bounds(bounds, kv.shape[0], "kv")


def check_pool_shapes(kv, score, ape, ratio, overlap) -> None:
    """Shapes, dtypes and ratio of the pooling inputs."""
    check_ratio(ratio, overlap)
    check_shape(kv, "kv", (None, None))
    check_float(kv, "kv")
    check_shape(score, "score", tuple(kv.shape))
    check_shape(ape, "ape", (ratio, kv.shape[1]))
    if overlap and kv.shape[1] % 2:
        raise ValueError(f"overlap=True needs an even channel count Dk = 2c, got Dk = {kv.shape[1]}")


def check_compressor_params(wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg) -> int:
    """Parameter checks of the full compressor (batch, streaming and Triton forms); returns the entry width ``c``."""
    check_ratio(ratio, overlap)
    check_shape(wkv, "wkv", (None, None))
    check_shape(wgate, "wgate", tuple(wkv.shape))
    check_shape(ape, "ape", (ratio, wkv.shape[0]))
    c = wkv.shape[0] // 2 if overlap else wkv.shape[0]
    check_shape(norm_weight, "norm_weight", (c,))
    if not isinstance(rope_cfg, RopeConfig):
        raise ValueError(f"rope_cfg must be a dsv4_primitives.RopeConfig, got {type(rope_cfg).__name__}")
    if rope_cfg.rope_dim > c:
        raise ValueError(f"rope_cfg.rope_dim = {rope_cfg.rope_dim} exceeds the entry width c = {c}")
    return c


def check_compress_inputs(x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg) -> None:
    """Shape / type checks of the full compressor (shared with the Triton path)."""
    check_shape(x, "x", (None, None))
    check_float(x, "x")
    check_shape(wkv, "wkv", (None, x.shape[1]))
    check_compressor_params(wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg)
