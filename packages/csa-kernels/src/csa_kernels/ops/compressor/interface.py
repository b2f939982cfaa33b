"""Public compressor entry points: THD (``cu_seqlens``) and SBHD (equal-length batch) forms with a ``backend`` switch."""

from __future__ import annotations

import torch

from csa_kernels._checks import check_shape
from csa_kernels.ops.compressor.autograd import compress_triton, compressor_pool_triton
from csa_kernels.ops.compressor.reference import compress_ref, compressor_pool_ref
from dsv4_primitives import RopeConfig
from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.varlen import sbhd_cu_seqlens, sbhd_cu_seqlens_host, sbhd_to_thd, thd_to_sbhd


def compressor_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
    cu_seqlens: torch.Tensor,
    *,
    backend: str = "auto",
    cu_seqlens_host: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-gated block pooling, THD. Shapes and math: :func:`compressor_pool_ref`.

    ``cu_seqlens_host``: the caller's host copy of ``cu_seqlens`` (structure validated in Python, not compared with
    the device tensor); with it the call does no device -> host sync.
    """
    if resolve_backend(backend, kv, score, op="csa_kernels.compressor_pool") == "triton":
        return compressor_pool_triton(
            kv, score, ape, ratio, overlap, cu_seqlens, cu_seqlens_host=cu_seqlens_host
        )
    return compressor_pool_ref(kv, score, ape, ratio, overlap, cu_seqlens, cu_seqlens_host=cu_seqlens_host)


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
    cu_seqlens_host: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full compressor, THD: ``(entries [Tc, c] in x.dtype, cu_seqlens_c)``. Math: :func:`compress_ref`.

    ``cu_seqlens_host``: as in :func:`compressor_pool` (no device -> host sync when given).
    """
    args = (x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg, cu_seqlens, eps)
    if resolve_backend(backend, x, op="csa_kernels.compress") == "triton":
        return compress_triton(*args, cu_seqlens_host=cu_seqlens_host)
    return compress_ref(*args, cu_seqlens_host=cu_seqlens_host)


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
    pooled, _ = compressor_pool(
        sbhd_to_thd(kv),
        sbhd_to_thd(score),
        ape,
        ratio,
        overlap,
        cu,
        backend=backend,
        cu_seqlens_host=sbhd_cu_seqlens_host(b, s),
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
    cu = sbhd_cu_seqlens(b, s, x.device)
    entries, _ = compress(
        sbhd_to_thd(x),
        wkv,
        wgate,
        ape,
        norm_weight,
        ratio,
        overlap,
        rope_cfg,
        cu,
        eps,
        backend=backend,
        cu_seqlens_host=sbhd_cu_seqlens_host(b, s),
    )
    return thd_to_sbhd(entries, b)
