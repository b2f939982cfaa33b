"""Public compressor entry points: THD (``cu_seqlens``) and SBHD (equal-length batch) forms with a ``backend`` switch."""

from __future__ import annotations

import torch

from csa_kernels._checks import check_shape
from csa_kernels._dispatch import resolve_backend
from csa_kernels.ops.compressor.reference import compress_ref, compressor_pool_ref
from csa_kernels.varlen import sbhd_cu_seqlens, sbhd_to_thd, thd_to_sbhd
from dsv4_primitives import RopeConfig


def compressor_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
    cu_seqlens: torch.Tensor,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-gated block pooling, THD. Shapes and math: :func:`compressor_pool_ref`."""
    if resolve_backend(backend, kv, score) == "triton":
        from csa_kernels.ops.compressor.autograd import compressor_pool_triton

        return compressor_pool_triton(kv, score, ape, ratio, overlap, cu_seqlens)
    return compressor_pool_ref(kv, score, ape, ratio, overlap, cu_seqlens)


def compress(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    ratio: int,
    overlap: bool,
    rope_cfg: RopeConfig,
    cu_seqlens: torch.Tensor,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full compressor, THD: ``(entries [Tc, c] in x.dtype, cu_seqlens_c)``. Math: :func:`compress_ref`."""
    if resolve_backend(backend, x) == "triton":
        from csa_kernels.ops.compressor.autograd import compress_triton

        return compress_triton(x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg, cu_seqlens, eps)
    return compress_ref(x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg, cu_seqlens, eps)


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
    cu = sbhd_cu_seqlens(b, s, kv.device)
    pooled, _ = compressor_pool(sbhd_to_thd(kv), sbhd_to_thd(score), ape, ratio, overlap, cu, backend=backend)
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
    cu = sbhd_cu_seqlens(b, s, x.device)
    entries, _ = compress(
        sbhd_to_thd(x), wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg, cu, eps, backend=backend
    )
    return thd_to_sbhd(entries, b)
