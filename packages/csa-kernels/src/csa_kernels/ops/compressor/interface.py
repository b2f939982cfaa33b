"""Public compressor entry points: THD (``SeqBoundaries``) and SBHD (equal-length batch) forms with a ``backend``
switch."""

from __future__ import annotations

import torch

from csa_kernels._checks import check_shape
from csa_kernels.ops.compressor.autograd import compress_triton, compressor_pool_triton
from csa_kernels.ops.compressor.reference import compress_ref, compressor_pool_ref
from dsv4_primitives import RopeConfig
from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.varlen import SeqBoundaries, sbhd_cu_seqlens_host, sbhd_to_thd, thd_to_sbhd


def compressor_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
    bounds: SeqBoundaries,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, SeqBoundaries]:
    """Softmax-gated block pooling, THD: ``(pooled [Tc, c] fp32, bounds.compressed(ratio))``. Shapes and math:
    :func:`compressor_pool_ref`.

    Host boundaries: no device -> host sync. Static boundaries (CUDA graphs): ``pooled [T // ratio, c]``, rows past
    the real entry count are zero and get no gradient; the Triton path reads nothing back (capturable), the
    reference path reads the boundaries back (CPU; never captured).
    """
    if resolve_backend(backend, kv, score, op="csa_kernels.compressor_pool") == "triton":
        return compressor_pool_triton(kv, score, ape, ratio, overlap, bounds)
    return compressor_pool_ref(kv, score, ape, ratio, overlap, bounds)


def compress(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    ratio: int,
    overlap: bool,
    rope_cfg: RopeConfig,
    bounds: SeqBoundaries,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, SeqBoundaries]:
    """Full compressor, THD: ``(entries [Tc, c] in x.dtype, bounds.compressed(ratio))``. Math:
    :func:`compress_ref`; boundaries as in :func:`compressor_pool`."""
    args = (x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg, bounds, eps)
    if resolve_backend(backend, x, op="csa_kernels.compress") == "triton":
        return compress_triton(*args)
    return compress_ref(*args)


def compressor_pool_sbhd(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """SBHD form: ``kv, score [S, B, Dk]`` -> ``pooled [S // ratio, B, c]`` (every sequence compressed alone)."""
    check_shape(kv, "kv", (None, None, None))
    check_shape(score, "score", tuple(kv.shape))
    s, b = kv.shape[:2]
    bounds = SeqBoundaries.from_host(sbhd_cu_seqlens_host(b, s), kv.device)
    pooled, _ = compressor_pool(
        sbhd_to_thd(kv), sbhd_to_thd(score), ape, ratio, overlap, bounds, backend=backend
    )
    return thd_to_sbhd(pooled, b)


def compress_sbhd(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    ratio: int,
    overlap: bool,
    rope_cfg: RopeConfig,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """SBHD form: ``x [S, B, d]`` -> ``entries [S // ratio, B, c]`` (positions ``w * ratio`` per sequence)."""
    check_shape(x, "x", (None, None, None))
    s, b = x.shape[:2]
    bounds = SeqBoundaries.from_host(sbhd_cu_seqlens_host(b, s), x.device)
    entries, _ = compress(
        sbhd_to_thd(x), wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg, bounds, eps, backend=backend
    )
    return thd_to_sbhd(entries, b)
