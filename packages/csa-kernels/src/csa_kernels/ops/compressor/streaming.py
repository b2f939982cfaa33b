"""Streaming (token-by-token) form of the compressor: the decode / chunked-prefill state (oracle C1).

Keeps the raw rows ``(kv, score + ape)`` of the block being filled and, for the overlapping layout, the P-half of the
last completed block. When block ``w`` completes it pools exactly as :func:`compress_ref` does for that block:
overlap -> slots ``[previous block's P-half ; this block's Q-half]`` (empty previous half for ``w = 0``), softmax over
the slots per channel, weighted sum, RMSNorm, RoPE at position ``w * ratio``.
"""

from __future__ import annotations

import torch

from csa_kernels._checks import check_shape, compute_dtype
from csa_kernels.ops.compressor.checks import check_compressor_params
from csa_kernels.ops.compressor.reference import (
    _empty_half,
    _norm_rope,
    _pool_slots,
)
from dsv4_primitives import RopeConfig


class CompressorState:
    """Compressor state of ``batch`` sequences advancing in lockstep, one token per :meth:`step`.

    Args:
        wkv, wgate: ``[Dk, d]`` projections; ``ape`` ``[ratio, Dk]``; ``norm_weight`` ``[c]``.
        ratio, overlap, rope_cfg, eps: as in :func:`compress_ref`.
        batch: number of sequences ``B``.
    """

    def __init__(
        self,
        wkv: torch.Tensor,
        wgate: torch.Tensor,
        ape: torch.Tensor,
        norm_weight: torch.Tensor,
        ratio: int,
        overlap: bool,
        rope_cfg: RopeConfig,
        eps: float = 1e-6,
        batch: int = 1,
    ) -> None:
        self.c = check_compressor_params(wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg)
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.dtype = compute_dtype(wkv, wgate, ape, norm_weight)
        self.wkv, self.wgate = wkv.to(self.dtype), wgate.to(self.dtype)
        self.ape, self.norm_weight = ape.to(self.dtype), norm_weight.to(self.dtype)
        self.ratio, self.overlap, self.rope_cfg, self.eps, self.batch = ratio, overlap, rope_cfg, eps, batch
        self.position = 0  # tokens consumed so far (per sequence)
        self._kv: list[torch.Tensor] = []  # rows of the block being filled, each [B, Dk]
        self._logit: list[torch.Tensor] = []
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None  # P-half of the last block, [B, m, c] x2

    def step(self, x_t: torch.Tensor) -> torch.Tensor | None:
        """Consume one token per sequence, ``x_t [B, d]``; return the new entries ``[B, c]`` (x.dtype) or ``None``."""
        check_shape(x_t, "x_t", (self.batch, self.wkv.shape[1]))
        xf = x_t.to(self.dtype)
        slot = self.position % self.ratio
        self._kv.append(xf @ self.wkv.T)  # [B, Dk]
        self._logit.append(xf @ self.wgate.T + self.ape[slot])  # [B, Dk]
        self.position += 1
        if len(self._kv) < self.ratio:
            return None
        kv_b = torch.stack(self._kv, 1)  # [B, m, Dk]
        logit_b = torch.stack(self._logit, 1)  # [B, m, Dk]
        self._kv, self._logit = [], []
        if self.overlap:
            c = self.c
            prev = self._prev or _empty_half(kv_b, logit_b, self.batch, self.ratio, c)  # [B, m, c] x2
            self._prev = (kv_b[..., :c], logit_b[..., :c])
            pooled = _pool_slots(kv_b, logit_b, *prev)  # [B, c]
        else:
            pooled = _pool_slots(kv_b, logit_b)  # [B, c]
        w = self.position // self.ratio - 1
        pos = torch.full((self.batch,), w * self.ratio, dtype=torch.int64, device=x_t.device)
        return _norm_rope(pooled, self.norm_weight, self.eps, pos, self.rope_cfg).to(x_t.dtype)
