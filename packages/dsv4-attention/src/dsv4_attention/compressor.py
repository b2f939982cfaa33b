"""KV compressor (spec §3): CSA (ratio 4, overlapping "two series") and HCA (ratio 128, plain blocks).

Per document of a pack (``bounds``, a :class:`dsv4_primitives.varlen.SeqBoundaries`), from the block input ``x`` (after ``attn_norm``, NOT the query latent):

    kv    = linear_wkv(x)                       # [T, coff*c]   coff = 2 for ratio 4 (overlap), 1 for ratio 128
    score = linear_wgate(x)                     # [T, coff*c]   gate logits; ape [ratio, coff*c] (fp32) is added
    P     = csa_kernels.compressor_pool(kv, score, ape, ratio, overlap, bounds)   # [Tc, c] fp32 softmax pooling
    C     = RoPE(norm(P), pos = w * ratio)      # [Tc, c]   weighted RMSNorm, rotation at the block's first token

Only complete blocks are compressed (a document of length ``L`` gives ``floor(L / ratio)`` entries). Plain PyTorch:
the linears and the norm are injected (bias-free ``nn.Linear`` / :class:`dsv4_primitives.RMSNorm` by default); the
pooling numerics come from csa-kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4_attention._kernels import compressed_positions, compressor_pool
from dsv4_attention._linears import default_norm, linear_out, plain_linear
from dsv4_attention._rope import rope
from dsv4_attention.kind import LayerKind
from dsv4_primitives import KeepFP32Mixin, RopeConfig, mark_keep_in_fp32
from dsv4_primitives.varlen import SeqBoundaries


@dataclass(frozen=True)
class CompressorConfig:
    """One compressor: its layer ``kind`` (CSA or HCA), input width ``d`` and entry width ``c``.

    Attributes:
        kind: :attr:`LayerKind.CSA` (ratio 4, overlapping) or :attr:`LayerKind.HCA` (ratio 128).
        hidden_size: ``d`` (width of the block input ``x``).
        head_dim: entry width ``c`` (512 for the main KV, ``c_I`` = 128 for the indexer keys).
        eps: epsilon of the weighted RMSNorm.
    """

    kind: LayerKind
    hidden_size: int
    head_dim: int
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LayerKind) or not self.kind.has_compressor:
            raise ValueError(f"a compressor needs kind LayerKind.CSA or LayerKind.HCA, got {self.kind!r}")
        if self.hidden_size <= 0 or self.head_dim <= 0:
            raise ValueError(
                f"compressor sizes must be positive, got hidden_size={self.hidden_size}, head_dim={self.head_dim}"
            )

    @property
    def ratio(self) -> int:
        return self.kind.compress_ratio

    @property
    def width(self) -> int:
        """``coff * c``: output width of ``linear_wkv`` / ``linear_wgate`` (``coff`` = 2 when overlapping)."""
        return (2 if self.kind.overlap else 1) * self.head_dim


class Compressor(KeepFP32Mixin, torch.nn.Module):
    """Softmax-gated block compressor producing one ``head_dim``-wide entry per complete block.

    Args:
        cfg: :class:`CompressorConfig`.
        rope_cfg: the layer's rotary table.
        linear_wkv, linear_wgate: ``[d] -> [coff*c]`` projections (default: bias-free ``nn.Linear``).
        norm: weighted RMSNorm over ``c`` (default :class:`dsv4_primitives.RMSNorm`).
        device: where ``ape`` (and default submodules) are created.
        init_method: initialiser of ``ape`` (``None``: zeros).
    """

    def __init__(
        self,
        cfg: CompressorConfig,
        rope_cfg: RopeConfig,
        *,
        linear_wkv: torch.nn.Module | None = None,
        linear_wgate: torch.nn.Module | None = None,
        norm: torch.nn.Module | None = None,
        device=None,
        init_method: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        super().__init__()
        self._init_compressor(cfg, rope_cfg, linear_wkv, linear_wgate, norm, device, init_method)

    def _init_compressor(self, cfg, rope_cfg, linear_wkv, linear_wgate, norm, device, init_method) -> None:
        self.cfg = cfg
        self.compress_ratio = cfg.ratio
        self.overlap = cfg.kind.overlap
        self.head_dim = cfg.head_dim
        self.rope_cfg = rope_cfg
        d, width = cfg.hidden_size, cfg.width
        self.linear_wkv = linear_wkv if linear_wkv is not None else plain_linear(d, width, device=device)
        self.linear_wgate = (
            linear_wgate if linear_wgate is not None else plain_linear(d, width, device=device)
        )
        self.norm = norm if norm is not None else default_norm(cfg.head_dim, cfg.eps, device)
        self.ape = torch.nn.Parameter(torch.zeros(cfg.ratio, width, dtype=torch.float32, device=device))
        if init_method is not None and self.ape.device.type != "meta":
            init_method(self.ape)
        mark_keep_in_fp32(self.ape)

    def forward(
        self,
        x: torch.Tensor,
        bounds: SeqBoundaries,
        backend: str = "auto",
        position_offset: int = 0,
        max_position: int | None = None,
    ) -> tuple[torch.Tensor, SeqBoundaries]:
        """``x [T, d]`` -> ``(entries [Tc, c] in x.dtype, bounds.compressed(ratio))``.

        Entry ``w`` of a document is rotated at ``w * ratio + position_offset``. ``max_position``: host bound of
        those positions (:attr:`~dsv4_attention.layout.TokenLayout.max_rope_position`; with it and host boundaries
        the compressor does no device-to-host synchronisation). Static boundaries (static-shape THD, the CUDA-graph
        path): the entries are ``[T // ratio, c]`` (rows past the real count are padding no index points to) and
        nothing is read back from the device.
        """
        kv = linear_out(self.linear_wkv, x)  # [T, coff*c]
        score = linear_out(self.linear_wgate, x)  # [T, coff*c]
        pooled, bounds_c = compressor_pool(
            kv, score, self.ape, self.compress_ratio, self.overlap, bounds, backend=backend
        )  # [Tc, c] fp32
        normed = self.norm(pooled)  # [Tc, c] fp32 math
        pos = compressed_positions(bounds, self.compress_ratio) + position_offset  # [Tc]
        return rope(normed, pos, self.rope_cfg, max_position=max_position).to(x.dtype), bounds_c
